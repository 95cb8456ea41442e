//! Decode steps replayed as CUDA graphs, one graph per batch-size bucket.
//!
//! Launching a decode step kernel by kernel costs more host time than a small batch costs the
//! GPU (about a thousand launches). A step in which every scheduled sequence decodes one token
//! is instead padded to the next bucket size and run by replaying a graph captured for that
//! size: the step's token ids and attention metadata are uploaded into buffers the graph reads,
//! and the graph leaves the final hidden states in a buffer the engine reads. Padding rows
//! write no KV (slot PAD_SLOT) and attend to one token of block 0; their outputs are ignored.
//!
//! A bucket is captured the first time a step of its size comes: one real forward pass first
//! (its results are that step's output; it also fills candle's cache of the small layout
//! uploads its ops make, which a capture may not do), then the same pass captured. A model
//! whose pass cannot be captured keeps running op by op for that bucket.

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use crate::batch::{AttentionMeta, Batch, DeviceAttentionMeta, MetaLayout, Positions, SeqSlice};
use crate::kv::KvCache;
use crate::models::TextModel;

/// Batch sizes graphs are captured for; a step runs in the smallest that holds it.
const BUCKETS: [usize; 14] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256];

pub struct DecodeGraphs {
    device: Device,
    buckets: Vec<usize>,
    max_blocks_per_seq: usize,
    max_positions: usize,
    graphs: HashMap<usize, Option<Captured>>,
}

/// A captured graph, moved between threads with the engine that owns it.
struct Graph(CudaGraph);

// SAFETY: the graph is only ever used by the one thread running the engine at a time (cudarc
// binds the device's context to the calling thread before each use); it is never shared.
unsafe impl Send for Graph {}

/// One bucket's graph and the buffers it reads and writes.
struct Captured {
    graph: Graph,
    tokens: Tensor,
    meta: Tensor,
    hidden: Tensor,
}

impl DecodeGraphs {
    /// None when graphs are off: not a CUDA device, or `IRIS_CUDA_GRAPHS=0`.
    pub fn new(device: &Device, max_num_seqs: usize, max_blocks_per_seq: usize, max_positions: usize) -> Option<Self> {
        if !device.is_cuda() || std::env::var("IRIS_CUDA_GRAPHS").is_ok_and(|v| v == "0") {
            return None;
        }
        let buckets: Vec<usize> = BUCKETS.iter().copied().filter(|&b| b < max_num_seqs).chain([max_num_seqs]).collect();
        Some(DecodeGraphs { device: device.clone(), buckets, max_blocks_per_seq, max_positions, graphs: HashMap::new() })
    }

    /// Runs a pure decode step (one row per sequence, every row sampled) through its bucket's
    /// graph and returns the `[rows, hidden]` final hidden states; None for any other step.
    pub fn run(
        &mut self,
        model: &dyn TextModel,
        kv: &KvCache,
        batch: &Batch,
        sample_rows: &[u32],
    ) -> Result<Option<Tensor>> {
        let meta = &batch.attn;
        let t = meta.num_rows();
        let decode = t > 0
            && meta.seqs.len() == t
            && meta.seqs.iter().all(|s| {
                s.q_len == 1 && s.block_table.len() <= self.max_blocks_per_seq && s.context_len <= self.max_positions
            })
            && sample_rows.len() == t
            && sample_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        let Some(&bucket) = self.buckets.iter().find(|&&b| b >= t).filter(|_| decode) else { return Ok(None) };
        let Positions::Flat(_) = &batch.positions;
        let tokens: Vec<u32> = batch.token_ids.to_vec1()?;
        let layout = MetaLayout::new(bucket, bucket);
        let packed = meta.packed(&layout);
        match self.graphs.get(&bucket) {
            Some(Some(c)) => {
                write_host(&c.tokens, &padded(&tokens, bucket))?;
                write_host(&c.meta, &packed)?;
                c.graph.0.launch().w()?;
                Ok(Some(c.hidden.narrow(0, 0, t)?))
            }
            Some(None) => Ok(None),
            None => {
                let (captured, hidden) = self.capture(model, kv, meta, bucket, layout, &tokens, &packed)?;
                self.graphs.insert(bucket, captured);
                Ok(Some(hidden.narrow(0, 0, t)?))
            }
        }
    }

    /// Runs the step once for real in the bucket's buffers, then captures the same pass.
    /// Returns the graph (None if the pass could not be captured) and the step's hidden states.
    #[allow(clippy::too_many_arguments)]
    fn capture(
        &self,
        model: &dyn TextModel,
        kv: &KvCache,
        meta: &AttentionMeta,
        bucket: usize,
        layout: MetaLayout,
        tokens: &[u32],
        packed: &[u32],
    ) -> Result<(Option<Captured>, Tensor)> {
        let dev = &self.device;
        let cuda = dev.as_cuda_device()?;
        let tokens_buf = Tensor::zeros(bucket, DType::U32, dev)?;
        let meta_buf = Tensor::zeros(layout.block_tables + bucket * self.max_blocks_per_seq + 1, DType::U32, dev)?;
        write_host(&tokens_buf, &padded(tokens, bucket))?;
        write_host(&meta_buf, packed)?;
        // The host side of the captured batch: `bucket` one-token sequences. Only its shape
        // matters (the ops check it while capturing); the kernels read the device buffers.
        let pads = (0..bucket).map(|i| {
            let real = meta.seqs.get(i);
            SeqSlice {
                q_start: i,
                q_len: 1,
                context_len: real.map_or(1, |s| s.context_len),
                block_table: real.map_or_else(|| vec![0], |s| s.block_table.clone()),
            }
        });
        let mut attn = AttentionMeta::new(meta.block_size, pads.collect());
        attn.device = Some(DeviceAttentionMeta { data: meta_buf.clone(), layout });
        let positions = attn.seqs.iter().map(|s| s.first_position() as u32).collect();
        let batch = Batch { token_ids: tokens_buf.clone(), positions: Positions::Flat(positions), attn };
        let hidden_dims = (bucket, model.config().hidden_size);
        let _cache = cuda.enable_cuda_graph_htod_cache();
        let first = model.forward(&batch, kv, None)?;
        let hidden = Tensor::zeros(hidden_dims, first.dtype(), dev)?;
        hidden.slice_set(&first, 0, 0)?;
        drop(first);

        let stream = cuda.cuda_stream();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).w()?;
        let pass = model.forward(&batch, kv, None).and_then(|h| hidden.slice_set(&h, 0, 0));
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        let captured = match (pass, graph) {
            (Ok(()), Ok(Some(graph))) => {
                graph.upload().w()?;
                Some(Captured { graph: Graph(graph), tokens: tokens_buf, meta: meta_buf, hidden: hidden.clone() })
            }
            (pass, graph) => {
                let why = pass.err().map(|e| e.to_string()).or_else(|| graph.err().map(|e| e.to_string()));
                tracing::warn!("decode step of {bucket} rows runs op by op: capture failed ({})", why.unwrap_or_default());
                None
            }
        };
        Ok((captured, hidden))
    }
}

fn padded(tokens: &[u32], n: usize) -> Vec<u32> {
    let mut v = tokens.to_vec();
    v.resize(n, 0);
    v
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
