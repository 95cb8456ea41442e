//! Runs a step's batch through the model on the engine's device and returns what sampling
//! needs: the logits of the rows that sample, copied to the host, or, when every such row draws
//! from its logits as they are, just the token ids, drawn on a GPU (one small copy per step).

use candle_core::{Device, Result, Tensor};

use crate::batch::Batch;
use crate::kv::KvCache;
use crate::models::TextModel;
use crate::ops::argmax::Argmax;
use crate::ops::sample::{Draw, Sample, PARAMS_PER_ROW};

pub enum StepOutput {
    /// `[rows, vocab]` logits of the sampled rows, in order.
    Logits(Vec<Vec<f32>>),
    /// The token drawn for each sampled row, in order.
    Tokens(Vec<u32>),
}

pub struct StepRunner {
    device: Device,
    #[cfg(feature = "cuda")]
    graphs: Option<super::cuda_graph::DecodeGraphs>,
}

impl StepRunner {
    /// `max_blocks_per_seq` bounds a sequence's block table (decode graphs size their buffers
    /// by it); graphs run steps whose positions are all below `max_positions` (the model's
    /// rotary table on the device).
    pub fn new(device: Device, max_num_seqs: usize, max_blocks_per_seq: usize, max_positions: usize) -> Self {
        #[cfg(feature = "cuda")]
        let graphs = super::cuda_graph::DecodeGraphs::new(&device, max_num_seqs, max_blocks_per_seq, max_positions);
        #[cfg(not(feature = "cuda"))]
        let _ = (max_num_seqs, max_blocks_per_seq, max_positions);
        StepRunner {
            device,
            #[cfg(feature = "cuda")]
            graphs,
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs `batch` (built on the host) and returns the next-token data of `sample_rows`;
    /// `draws`, one per sampled row, let a GPU pick the tokens itself (None: logits to the host).
    pub fn run(
        &mut self,
        model: &dyn TextModel,
        kv: &KvCache,
        batch: Batch,
        sample_rows: &[u32],
        draws: Option<&[Draw]>,
    ) -> Result<StepOutput> {
        if self.device.is_cpu() {
            let hidden = model.forward(&batch, kv, None)?;
            return self.logits(model, &hidden, sample_rows);
        }
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &mut self.graphs {
            if let Some(out) = graphs.run(model, kv, &batch, sample_rows, draws)? {
                return Ok(out);
            }
            graphs.ran_other_step();
        }
        let hidden = self.forward(model, kv, batch)?;
        if sample_rows.is_empty() {
            return Ok(StepOutput::Logits(Vec::new()));
        }
        let all_rows =
            sample_rows.len() == hidden.dim(0)? && sample_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        let hidden =
            if all_rows { hidden } else { hidden.index_select(&Tensor::new(sample_rows, &self.device)?, 0)? };
        self.pick(model, &hidden, draws)
    }

    /// The model's plain forward pass over `batch` (built on the host) on the device: hidden
    /// states of every row.
    pub fn forward(&self, model: &dyn TextModel, kv: &KvCache, mut batch: Batch) -> Result<Tensor> {
        batch.to_device(&self.device)?;
        model.forward(&batch, kv, None)
    }

    /// The logits of `sample_rows` of `hidden`, copied to the host.
    pub fn logits(&self, model: &dyn TextModel, hidden: &Tensor, sample_rows: &[u32]) -> Result<StepOutput> {
        if sample_rows.is_empty() {
            return Ok(StepOutput::Logits(Vec::new()));
        }
        let rows = Tensor::new(sample_rows, hidden.device())?;
        Ok(StepOutput::Logits(model.logits(&hidden.index_select(&rows, 0)?)?.to_vec2()?))
    }

    fn pick(&self, model: &dyn TextModel, hidden: &Tensor, draws: Option<&[Draw]>) -> Result<StepOutput> {
        let logits = model.logits(hidden)?;
        match draws {
            Some(draws) => Ok(StepOutput::Tokens(draw_on_device(&logits, None, draws)?)),
            None => Ok(StepOutput::Logits(logits.to_vec2()?)),
        }
    }
}

/// Each row's token, drawn where `logits` (`[rows, vocab]` f32) are; `argmax` holds the rows'
/// argmax when the caller has it already (used when every draw is greedy).
pub fn draw_on_device(logits: &Tensor, argmax: Option<&Tensor>, draws: &[Draw]) -> Result<Vec<u32>> {
    let ids = if draws.iter().all(|d| d.inv_temperature == 0.0) {
        match argmax {
            Some(ids) => ids.clone(),
            None => Argmax::forward(logits)?,
        }
    } else {
        let params: Vec<f32> = draws.iter().flat_map(|d| d.to_params()).collect();
        Sample::forward(logits, &Tensor::from_vec(params, (draws.len(), PARAMS_PER_ROW), logits.device())?)?
    };
    ids.to_vec1()
}
