//! Tensor parallelism: one model's layers divided among ranks (devices), which run each step
//! together and combine their partial results through a [`Communicator`].
//!
//! Megatron's division, as vLLM makes it: the products that open a sublayer (q/k/v, gate/up)
//! are split by output rows (column-parallel), so each rank computes its own heads and its share
//! of the MLP's width from the whole input; the products that close it (o, down) are split by
//! input columns (row-parallel), so each rank's output is a partial sum, and one all-reduce per
//! sublayer adds them. Keys and values are split by head with the queries that read them (a
//! head is replicated where there are fewer KV heads than ranks), so each rank's cache holds its
//! own heads. The embedding table and the output head are split by vocabulary: a rank looks up
//! the ids in its range (zeros elsewhere; an all-reduce adds them up) and computes its range of
//! logits (an all-gather puts them side by side).
//!
//! Which tensor is divided how is one table (`split_of`), read by the weights store
//! (`Weights::with_shard`): a layer asks for the shape its rank's config implies and gets its
//! rank's slice, and a product whose output is partial holds the collective that completes it
//! (`Collective`, in `layers::linear`). The model files do not change; `models::tensor_parallel`
//! runs the ranks together as one model.

mod comm;
mod threads;

#[cfg(feature = "nccl")]
mod nccl;

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Result, Tensor};

use crate::config::{Arch, TextConfig};

pub use comm::{Collective, Communicator};
#[cfg(feature = "nccl")]
pub use nccl::nccl_group;
pub use threads::thread_group;

/// One rank's place in the group, which the weights store hands its layers.
#[derive(Clone)]
pub struct Shard {
    pub comm: Arc<dyn Communicator>,
}

/// How a tensor is divided among the ranks: each rank holds one part, in rank order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// By the first axis: output rows of a product (column-parallel), vocabulary entries.
    Rows,
    /// By the last axis: input columns of a product (row-parallel), whose outputs are partial.
    Columns,
    /// By the first axis within each of two stacked halves (a fused gate/up projection: gate
    /// rows, then up rows): a rank holds its part of the gate rows, then of the up rows.
    RowHalves,
}

impl Shard {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// Whether tensor `name` may be replicated where it has fewer parts than there are ranks
    /// (the KV projections, when there are fewer KV heads than ranks).
    pub fn replicable(name: &str) -> bool {
        name.contains("k_proj.") || name.contains("v_proj.")
    }

    /// How tensor `name` is divided; None: every rank holds it whole (norms, biases added
    /// after a sum, a router) or, for a routed expert's, holds it or not at all (`experts`).
    pub fn split_of(name: &str) -> Option<Split> {
        const ROWS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"];
        const COLUMNS: [&str; 2] = ["o_proj", "down_proj"];
        let (module, param) = name.rsplit_once('.')?;
        if module.contains(".experts.") {
            return None;
        }
        let last = module.rsplit('.').next().unwrap_or(module);
        let (weight, bias) = (param == "weight", param == "bias");
        if ROWS.contains(&last) && (weight || bias) {
            Some(Split::Rows)
        } else if last == "gate_up_proj" && (weight || bias) {
            Some(Split::RowHalves)
        } else if COLUMNS.contains(&last) && weight {
            Some(Split::Columns)
        } else {
            None
        }
    }

    /// The routed experts this rank holds and runs, whole, over the rows sent to them (expert
    /// parallelism, as vLLM's `--enable-expert-parallel`): an even share of the `num_experts`,
    /// in order. The router is on every rank, so each rank sees every row's choice; the experts'
    /// outputs are partial sums over the ranks, added up with the shared expert's part.
    pub fn experts(&self, num_experts: usize) -> std::ops::Range<usize> {
        let (rank, world) = (self.rank(), self.world());
        rank * num_experts / world..(rank + 1) * num_experts / world
    }

    /// The collective that completes the product whose weight is `name`.
    pub fn collective_after(&self, name: &str) -> Option<Collective> {
        match Self::split_of(name)? {
            Split::Columns => Some(Collective::Sum(self.comm.clone())),
            Split::Rows if name.starts_with("lm_head.") => Some(Collective::Gather(self.comm.clone())),
            Split::Rows | Split::RowHalves => None,
        }
    }

    /// This rank's part of a stored tensor `t` divided by `split`, the part having `len` entries
    /// along that axis (`runs`). None when `t` does not divide so.
    pub fn part(&self, t: &Tensor, split: Split, len: usize, replicable: bool) -> Result<Option<Tensor>> {
        let last = t.rank().saturating_sub(1);
        let Some((rows, cols)) = self.runs(split, t.dim(0)?, t.dim(last)?, len, replicable) else { return Ok(None) };
        let parts = rows.iter().map(|r| t.narrow(0, r.start, r.len())).collect::<Result<Vec<_>>>()?;
        let mut part = if parts.len() == 1 { parts[0].clone() } else { Tensor::cat(&parts, 0)? };
        if split == Split::Columns {
            part = part.narrow(last, cols.start, cols.len())?;
        }
        Ok(Some(part.contiguous()?))
    }

    /// Which rows and columns of an `[n, k]` matrix divided by `split` this rank holds, its
    /// part having `len` entries along that axis: runs of rows (taken one after another) and
    /// the columns of each. Part `rank` of `world`, or, where `replicable` (KV heads) and the
    /// matrix has fewer parts than there are ranks, the part this rank's queries read; a fused
    /// gate/up projection's part of each half. None when the matrix does not divide so. Every
    /// stored form (dense, MLX affine, GGUF blocks) takes its part from these.
    #[allow(clippy::single_range_in_vec_init)] // a list of runs, often of one
    pub fn runs(
        &self,
        split: Split,
        n: usize,
        k: usize,
        len: usize,
        replicable: bool,
    ) -> Option<(Vec<Range<usize>>, Range<usize>)> {
        match split {
            Split::Rows => self.start(n, len, replicable).map(|s| (vec![s..s + len], 0..k)),
            Split::RowHalves => {
                if !n.is_multiple_of(2) || !len.is_multiple_of(2) {
                    return None;
                }
                let (half, l) = (n / 2, len / 2);
                self.start(half, l, false).map(|s| (vec![s..s + l, half + s..half + s + l], 0..k))
            }
            Split::Columns => self.start(k, len, replicable).map(|s| (vec![0..n], s..s + len)),
        }
    }

    /// Where this rank's part of `len` entries starts along an axis of `full` (see `part`);
    /// None when the axis does not divide so.
    pub fn start(&self, full: usize, len: usize, replicable: bool) -> Option<usize> {
        let world = self.world();
        if len == 0 || !full.is_multiple_of(len) {
            return None;
        }
        let parts = full / len;
        if parts != world && !(replicable && parts < world && world.is_multiple_of(parts)) {
            return None;
        }
        Some(self.rank() * parts / world * len)
    }
}

/// Why a model cannot be divided among `world` ranks; None when it can.
pub fn unsupported(cfg: &TextConfig, world: usize) -> Option<String> {
    let arch = cfg.arch;
    if !matches!(arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Glm4v | Arch::Glm4vMoe) {
        return Some(format!(
            "{} is not divided across ranks yet (llama, qwen2, qwen3, gemma3, glm4v and glm4v_moe are)",
            arch.name()
        ));
    }
    let kv = cfg.num_kv_heads;
    let divides = |n: usize| n.is_multiple_of(world);
    if !divides(cfg.num_heads) || !divides(cfg.intermediate_size) || !divides(cfg.vocab_size) {
        return Some(format!(
            "{world} ranks must divide the attention heads ({}), the MLP width ({}) and the vocabulary ({})",
            cfg.num_heads, cfg.intermediate_size, cfg.vocab_size
        ));
    }
    if let Some(m) = &cfg.moe {
        if !divides(m.num_experts) || !divides(m.shared_intermediate_size) {
            return Some(format!(
                "{world} ranks must divide the routed experts ({}) and the shared expert's width ({})",
                m.num_experts, m.shared_intermediate_size
            ));
        }
    }
    if !(divides(kv) || world.is_multiple_of(kv)) {
        return Some(format!("{world} ranks neither divide the {kv} KV heads nor are a multiple of them"));
    }
    if !cfg.layer_kv.is_empty() {
        return Some("per-layer KV shapes are not divided across ranks yet".into());
    }
    None
}

/// The config of one rank's layers: its share of the heads (at least one KV head), of the
/// MLP's width and of the shared expert's; the vocabulary stays whole (the output head's
/// logits are gathered), and so do the routed experts (a rank holds some of them whole) and
/// their number (every rank routes over all of them).
pub fn rank_config(cfg: &TextConfig, world: usize) -> TextConfig {
    let mut c = cfg.clone();
    c.num_heads /= world;
    c.num_kv_heads = (cfg.num_kv_heads / world).max(1);
    c.intermediate_size /= world;
    if let Some(m) = &mut c.moe {
        m.shared_intermediate_size /= world;
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_divides_the_sublayers_products() {
        let split = Shard::split_of;
        assert_eq!(split("model.layers.3.self_attn.q_proj.weight"), Some(Split::Rows));
        assert_eq!(split("model.layers.3.self_attn.k_proj.bias"), Some(Split::Rows));
        assert_eq!(split("model.layers.3.self_attn.o_proj.weight"), Some(Split::Columns));
        assert_eq!(split("model.layers.3.mlp.down_proj.weight"), Some(Split::Columns));
        assert_eq!(split("model.layers.3.mlp.down_proj.bias"), None, "added once, after the sum");
        assert_eq!(split("model.embed_tokens.weight"), Some(Split::Rows));
        assert_eq!(split("model.layers.3.self_attn.q_norm.weight"), None);
        assert_eq!(split("model.norm.weight"), None);
        assert_eq!(split("model.layers.0.mlp.gate_up_proj.weight"), Some(Split::RowHalves));
        assert_eq!(split("model.layers.3.mlp.experts.5.gate_proj.weight"), None, "held whole or not at all");
        assert_eq!(split("model.layers.3.mlp.experts.5.down_proj.weight"), None);
        assert_eq!(split("model.layers.3.mlp.shared_experts.down_proj.weight"), Some(Split::Columns));
        assert_eq!(split("model.layers.3.mlp.gate.weight"), None, "the router is on every rank");
    }

    #[test]
    fn experts_and_fused_halves_are_shared_out_in_order() {
        let comms = thread_group(2);
        let shards: Vec<_> = comms.iter().map(|c| Shard { comm: c.clone() }).collect();
        assert_eq!((shards[0].experts(8), shards[1].experts(8)), (0..4, 4..8));
        // Gate rows 0..4, up rows 4..8: rank 1 holds gate rows 2, 3 and up rows 6, 7.
        let t = Tensor::arange(0f32, 8.0, &candle_core::Device::Cpu).unwrap().reshape((8, 1)).unwrap();
        let part = shards[1].part(&t, Split::RowHalves, 4, false).unwrap().unwrap();
        assert_eq!(part.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [2.0, 3.0, 6.0, 7.0]);
        assert!(shards[1].part(&t, Split::RowHalves, 3, false).unwrap().is_none());
    }

    #[test]
    fn kv_heads_are_replicated_where_there_are_fewer_than_ranks() {
        let comms = thread_group(4);
        // 2 KV heads of 3 rows each: ranks 0, 1 read head 0; ranks 2, 3 head 1.
        let t = Tensor::arange(0f32, 12.0, &candle_core::Device::Cpu).unwrap().reshape((6, 2)).unwrap();
        for (rank, want) in [(0, 0.0), (1, 0.0), (2, 6.0), (3, 6.0)] {
            let shard = Shard { comm: comms[rank].clone() };
            let part = shard.part(&t, Split::Rows, 3, true).unwrap().unwrap();
            assert_eq!(part.dims(), &[3, 2]);
            assert_eq!(part.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0], want, "rank {rank}");
        }
        let shard = Shard { comm: comms[1].clone() };
        assert_eq!(shard.part(&t, Split::Columns, 1, true).unwrap().unwrap().dims(), &[6, 1]);
        assert!(shard.part(&t, Split::Rows, 4, true).unwrap().is_none(), "6 rows do not divide into 4s");
        assert!(shard.part(&t, Split::Rows, 3, false).unwrap().is_none(), "only KV heads are replicated");
        assert!(shard.part(&t, Split::Rows, 6, false).unwrap().is_none(), "a whole tensor is no part");
    }
}
