//! Decode and verify steps replayed as CUDA graphs, one graph per (batch-size bucket, rows per
//! sequence).
//!
//! Launching a decode step kernel by kernel costs more host time than a small batch costs the
//! GPU (hundreds of launches). A step in which every scheduled sequence computes the same
//! number of rows R (1 for a decode; its last token and R - 1 drafts for a speculative verify
//! step, R below the prompt-chunk size) and samples all of them is instead padded to the next
//! bucket of sequences and run by replaying a graph captured for that bucket and R (a step
//! whose sequences verify different numbers of drafts first pads each to the most rows, where
//! that pays: `pad_pays`):
//! the step's token ids and attention metadata are uploaded into buffers the graphs read, and
//! the graph leaves the logits and their argmax in buffers the engine reads (only the ids, or
//! the logits when some row samples, are copied back). Padding rows write no KV (slot NO_SLOT)
//! and attend to one token of block 0; padding sequences hold no recurrent state slot
//! (NO_SLOT: the recurrent kernels skip them); their outputs are ignored.
//!
//! A bucket is captured the first time a step of its size comes: one real pass first (its
//! results are that step's output; it also fills candle's cache of the small layout uploads
//! its ops make, which a capture may not do), then the same pass captured. A model whose pass
//! cannot be captured keeps running op by op for that bucket.

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use super::step_output::{draw_on_device, StepOutput};
use crate::batch::{
    AttentionMeta, Batch, DeviceAttentionMeta, MetaLayout, Positions, SeqSlice, NO_SLOT, PREFILL_MIN_ROWS,
};
use crate::kv::KvCache;
use crate::models::TextModel;
use crate::ops::argmax::Argmax;
use crate::ops::sample::Draw;

/// Batch sizes graphs are captured for; a step runs in the smallest that holds it.
const BUCKETS: [usize; 14] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256];

pub struct DecodeGraphs {
    device: Device,
    buckets: Vec<usize>,
    max_blocks_per_seq: usize,
    max_positions: usize,
    /// Most rows per sequence a graph runs (1, or 1 + the most draft tokens).
    max_rows_per_seq: usize,
    /// Shared by every bucket's graph (one runs at a time); made at the first capture.
    buffers: Option<Buffers>,
    /// By (bucket, rows per sequence).
    graphs: HashMap<(usize, usize), Option<Graph>>,
    /// `IRIS_CUDA_STEP_TIMING=1`: how much of a replayed step's wall time the GPU spends in
    /// the graph (the rest is host work between steps, while the GPU idles).
    timing: Option<StepTiming>,
}

/// Replayed steps' GPU time (events around the graph) against the wall time between replays.
struct StepTiming {
    steps: u32,
    gpu_ms: f64,
    wall_ms: f64,
    last: Option<std::time::Instant>,
}

impl StepTiming {
    const REPORT_EVERY: u32 = 64;

    fn record(&mut self, gpu_ms: f64) {
        let now = std::time::Instant::now();
        if let Some(last) = self.last.replace(now) {
            self.steps += 1;
            self.gpu_ms += gpu_ms;
            self.wall_ms += (now - last).as_secs_f64() * 1e3;
        }
        if self.steps == Self::REPORT_EVERY {
            let n = self.steps as f64;
            tracing::info!(
                "decode graphs: {:.1} us GPU per step of {:.1} us wall ({:.1}% idle), over {} steps",
                self.gpu_ms / n * 1e3,
                self.wall_ms / n * 1e3,
                100.0 * (1.0 - self.gpu_ms / self.wall_ms),
                self.steps
            );
            (self.steps, self.gpu_ms, self.wall_ms) = (0, 0.0, 0.0);
        }
    }
}

/// What the graphs read (token ids, attention metadata) and write (logits, argmax ids), sized
/// for the largest bucket; a bucket uses the first rows.
struct Buffers {
    tokens: Tensor,
    meta: Tensor,
    logits: Tensor,
    ids: Tensor,
}

/// A captured graph, moved between threads with the engine that owns it.
struct Graph(CudaGraph);

// SAFETY: the graph is only ever used by the one thread running the engine at a time (cudarc
// binds the device's context to the calling thread before each use); it is never shared.
unsafe impl Send for Graph {}

impl DecodeGraphs {
    /// None when graphs are off: not a CUDA device, or `IRIS_CUDA_GRAPHS=0`.
    pub fn new(
        device: &Device,
        max_num_seqs: usize,
        max_blocks_per_seq: usize,
        max_positions: usize,
        max_rows_per_seq: usize,
    ) -> Option<Self> {
        if !graphs_on(device) {
            return None;
        }
        let buckets: Vec<usize> = BUCKETS.iter().copied().filter(|&b| b < max_num_seqs).chain([max_num_seqs]).collect();
        Some(DecodeGraphs {
            device: device.clone(),
            buckets,
            max_blocks_per_seq,
            max_positions,
            max_rows_per_seq: max_rows_per_seq.clamp(1, PREFILL_MIN_ROWS - 1),
            buffers: None,
            graphs: HashMap::new(),
            timing: std::env::var("IRIS_CUDA_STEP_TIMING").is_ok_and(|v| v == "1").then_some(StepTiming {
                steps: 0,
                gpu_ms: 0.0,
                wall_ms: 0.0,
                last: None,
            }),
        })
    }

    /// Device bytes the graphs' buffers take at most (the largest bucket's logits, rows of
    /// `vocab` f32, dominate: 1.2 GiB for 256 sequences of 5 rows over 250k tokens); 0 when
    /// graphs are off. The engine's default KV budget leaves them room.
    pub fn buffer_bytes(device: &Device, max_num_seqs: usize, max_rows_per_seq: usize, vocab: usize) -> u64 {
        if !graphs_on(device) {
            return 0;
        }
        let rows = (max_num_seqs * max_rows_per_seq.clamp(1, PREFILL_MIN_ROWS - 1)) as u64;
        // Per row: its logits, token id and argmax, and its share of the metadata.
        rows * (4 * vocab as u64 + 4 * 8)
    }

    /// A step ran without a graph: the wall time to the next replay is not a decode step's.
    pub fn ran_other_step(&mut self) {
        if let Some(timing) = &mut self.timing {
            timing.last = None;
        }
    }

    fn max_bucket(&self) -> usize {
        self.buckets.last().copied().unwrap_or(1)
    }

    /// Runs a decode or verify step (R rows per sequence, every row sampled) through its
    /// bucket's graph; None for any other step (or a bucket that cannot be captured). `masked`:
    /// some row has a grammar mask, so the draws wait for it (`StepOutput::Undrawn`).
    pub fn run(
        &mut self,
        model: &dyn TextModel,
        kv: &KvCache,
        batch: &Batch,
        sample_rows: &[u32],
        draws: Option<&[Draw]>,
        masked: bool,
    ) -> Result<Option<StepOutput>> {
        // Graphs replay text steps with 1-D positions (the rotary table's); others run op by op.
        if !matches!(batch.positions, Positions::Flat(_)) || batch.images.is_some() {
            return Ok(None);
        }
        let t = batch.attn.num_rows();
        let n = batch.attn.seqs.len();
        let r = batch.attn.seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
        let decodes = t > 0
            && (1..=self.max_rows_per_seq).contains(&r)
            && sample_rows.len() == t
            && sample_rows.iter().enumerate().all(|(i, &row)| row as usize == i);
        let Some(&bucket) = self.buckets.iter().find(|&&b| b >= n).filter(|_| decodes) else { return Ok(None) };
        // Sequences verifying fewer drafts than the most are padded to its rows, when the
        // padding costs less than running op by op would (`pad_pays`).
        let padded;
        let (meta, real_rows) = if batch.attn.seqs.iter().all(|s| s.q_len == r) {
            (&batch.attn, None)
        } else if pad_pays(bucket * r, t) {
            padded = batch.attn.rows_padded_to(r);
            (&padded.0, Some(&padded.1))
        } else {
            return Ok(None);
        };
        let fits = meta
            .seqs
            .iter()
            .all(|s| s.block_table.len() <= self.max_blocks_per_seq + r && s.context_len <= self.max_positions);
        if !fits || matches!(self.graphs.get(&(bucket, r)), Some(None)) {
            return Ok(None);
        }
        let layout = MetaLayout::new(bucket * r, bucket, &[]);
        if self.buffers.is_none() {
            self.buffers = Some(self.make_buffers(model)?);
        }
        let bufs = self.buffers.as_ref().expect("made above");
        let step_tokens: Vec<u32> = batch.token_ids.to_vec1()?;
        let mut tokens = match real_rows {
            None => step_tokens,
            Some(real) => {
                let mut padded = vec![0; n * r];
                for (&row, &tok) in real.iter().zip(&step_tokens) {
                    padded[row as usize] = tok;
                }
                padded
            }
        };
        tokens.resize(bucket * r, 0);
        write_host(&bufs.tokens, &tokens)?;
        write_host(&bufs.meta, &meta.packed(&layout))?;
        match self.graphs.get(&(bucket, r)) {
            Some(Some(g)) => match &mut self.timing {
                None => g.0.launch().w()?,
                Some(timing) => {
                    let stream = self.device.as_cuda_device()?.cuda_stream();
                    let timed = Some(candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                    let start = stream.record_event(timed).w()?;
                    g.0.launch().w()?;
                    let end = stream.record_event(timed).w()?;
                    timing.record(start.elapsed_ms(&end).w()? as f64);
                }
            },
            _ => {
                let graph = self.capture(model, kv, meta, bucket, r, layout)?;
                self.graphs.insert((bucket, r), graph);
            }
        }
        let bufs = self.buffers.as_ref().expect("made above");
        // The step's own rows. Greedy steps read the ids buffer whole (a u32 per row) and pick
        // them on the host; logits are gathered on the device first, since a narrowed view
        // would copy the whole buffer to the host (candle copies a tensor's storage, not its
        // view; so does `Tensor::copy`): 250 MB for 256 sequences of 5 rows over 49k tokens.
        let rows: Vec<u32> = match real_rows {
            Some(real) => real.clone(),
            None => (0..t as u32).collect(),
        };
        let logits = || bufs.logits.index_select(&Tensor::new(rows.as_slice(), &self.device)?, 0);
        Ok(Some(match draws {
            Some(draws) if masked => StepOutput::Undrawn { logits: logits()?, draws: draws.to_vec() },
            Some(draws) if draws.iter().all(|d| d.inv_temperature == 0.0) => {
                let ids: Vec<u32> = bufs.ids.to_vec1()?;
                StepOutput::Tokens(rows.iter().map(|&r| ids[r as usize]).collect())
            }
            Some(draws) => StepOutput::Tokens(draw_on_device(&logits()?, None, draws)?),
            None => StepOutput::Logits(logits()?.to_vec2()?),
        }))
    }

    fn make_buffers(&self, model: &dyn TextModel) -> Result<Buffers> {
        let (dev, b, r) = (&self.device, self.max_bucket(), self.max_rows_per_seq);
        // The padding sequences' block table entries follow the real tables (`packed`), which
        // rows padded to `r` may lengthen by a block per row at most.
        let meta_len = MetaLayout::new(b * r, b, &[]).block_tables + b * (self.max_blocks_per_seq + r) + r;
        Ok(Buffers {
            tokens: Tensor::zeros(b * r, DType::U32, dev)?,
            meta: Tensor::zeros(meta_len, DType::U32, dev)?,
            logits: Tensor::zeros((b * r, model.config().vocab_size), DType::F32, dev)?,
            ids: Tensor::zeros(b * r, DType::U32, dev)?,
        })
    }

    /// Runs the step once for real on the buffers (already holding its inputs), then captures
    /// the same pass. Returns the graph, or None if the pass could not be captured.
    fn capture(
        &self,
        model: &dyn TextModel,
        kv: &KvCache,
        meta: &AttentionMeta,
        bucket: usize,
        r: usize,
        layout: MetaLayout,
    ) -> Result<Option<Graph>> {
        let _setup = crate::device::cuda_setup_lock();
        let bufs = self.buffers.as_ref().expect("buffers exist before a capture");
        let cuda = self.device.as_cuda_device()?;
        // The host side of the captured batch: `bucket` sequences of `r` rows. Only its shape
        // matters (the ops check it while capturing); the kernels read the device buffers.
        let pad_blocks = r.div_ceil(meta.block_size);
        let pads = (0..bucket).map(|i| {
            let real = meta.seqs.get(i);
            SeqSlice {
                q_start: i * r,
                q_len: r,
                context_len: real.map_or(r, |s| s.context_len),
                block_table: real.map_or_else(|| vec![0; pad_blocks], |s| s.block_table.clone()),
            }
        });
        let mut attn = AttentionMeta::new(meta.block_size, pads.collect());
        if let Some(slots) = &meta.state_slots {
            // Padding sequences hold no state slot: the recurrent kernels skip them.
            attn.set_state_slots((0..bucket).map(|i| slots.get(i).copied().unwrap_or(NO_SLOT)).collect())?;
        }
        if let Some(w) = &meta.window {
            let rings = (0..bucket).map(|i| w.rings.get(i).copied().unwrap_or(0)).collect();
            attn.set_float_window(w.len, rings)?;
        }
        attn.device = Some(DeviceAttentionMeta { data: bufs.meta.clone(), layout });
        let positions = attn.seqs.iter().flat_map(|s| (s.first_position()..s.context_len).map(|p| p as u32)).collect();
        let batch = Batch {
            token_ids: bufs.tokens.narrow(0, 0, bucket * r)?,
            positions: Positions::Flat(positions),
            attn,
            images: None,
            output_rows: None,
        };
        let pass = || -> Result<()> {
            let logits = model.logits(&model.forward(&batch, kv, None)?)?;
            bufs.ids.slice_set(&Argmax::forward(&logits)?, 0, 0)?;
            bufs.logits.slice_set(&logits, 0, 0)
        };
        let _cache = cuda.enable_cuda_graph_htod_cache();
        pass()?;

        let stream = cuda.cuda_stream();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).w()?;
        let captured = pass();
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        Ok(match (captured, graph) {
            (Ok(()), Ok(Some(graph))) => {
                graph.upload().w()?;
                Some(Graph(graph))
            }
            (captured, graph) => {
                let why = captured.err().map(|e| e.to_string()).or_else(|| graph.err().map(|e| e.to_string()));
                tracing::warn!(
                    "steps of {bucket} sequences of {r} rows run op by op: capture failed ({})",
                    why.unwrap_or_default()
                );
                None
            }
        })
    }
}

fn graphs_on(device: &Device) -> bool {
    device.is_cuda() && crate::switches::switched_on!("IRIS_CUDA_GRAPHS")
}

/// Whether a step of `real` rows whose sequences verify different numbers of drafts runs
/// padded to `padded` rows in a graph rather than op by op. A decode step costs about the same
/// for any row count while its weights are read once for all rows, up to some tens of rows
/// (on an H200, 8 sequences of 5 rows cost 1.04x 8 of 1 at the 7B shape), and op by op costs
/// the launches of hundreds of kernels: so padding up to `IRIS_CUDA_PAD_ROWS` rows (64) always
/// pays, and beyond that while it at most doubles the rows. `IRIS_CUDA_PAD_ROWS=0`: never.
fn pad_pays(padded: usize, real: usize) -> bool {
    let free = crate::switches::tuned!("IRIS_CUDA_PAD_ROWS", usize, 64);
    free > 0 && padded <= free.max(2 * real)
}

/// Copies host values into the start of a device u32 tensor, in stream order.
fn write_host(dst: &Tensor, values: &[u32]) -> Result<()> {
    dst.inplace_op1(&WriteHost(values))
}

struct WriteHost<'a>(&'a [u32]);

impl InplaceOp1 for WriteHost<'_> {
    fn name(&self) -> &'static str {
        "write-host"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        match s {
            CpuStorage::U32(d) if l.start_offset() + self.0.len() <= d.len() => {
                d[l.start_offset()..l.start_offset() + self.0.len()].copy_from_slice(self.0);
                Ok(())
            }
            _ => candle_core::bail!("write-host: destination is not a large enough u32 tensor"),
        }
    }

    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        let dev = s.device().clone();
        let o = l.start_offset();
        match &mut s.slice {
            candle_core::cuda_backend::CudaStorageSlice::U32(d) if o + self.0.len() <= d.len() => {
                let mut view = d.slice_mut(o..o + self.0.len());
                dev.memcpy_htod(self.0, &mut view)
            }
            _ => candle_core::bail!("write-host: destination is not a large enough u32 tensor"),
        }
    }
}
