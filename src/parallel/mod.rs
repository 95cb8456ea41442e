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
    /// after a sum).
    pub fn split_of(name: &str) -> Option<Split> {
        const ROWS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"];
        const COLUMNS: [&str; 2] = ["o_proj", "down_proj"];
        let (module, param) = name.rsplit_once('.')?;
        let last = module.rsplit('.').next().unwrap_or(module);
        if ROWS.contains(&last) && (param == "weight" || param == "bias") {
            Some(Split::Rows)
        } else if COLUMNS.contains(&last) && param == "weight" {
            Some(Split::Columns)
        } else {
            None
        }
    }

    /// The collective that completes the product whose weight is `name`.
    pub fn collective_after(&self, name: &str) -> Option<Collective> {
        match Self::split_of(name)? {
            Split::Columns => Some(Collective::Sum(self.comm.clone())),
            Split::Rows if name.starts_with("lm_head.") => Some(Collective::Gather(self.comm.clone())),
            Split::Rows => None,
        }
    }

    /// This rank's part of a stored tensor `t` divided by `split`, the part having `len` entries
    /// along that axis: part `rank` of `world`, or, where `replicable` (KV heads) and the tensor
    /// has fewer parts than there are ranks, the part this rank's queries read. None when `t`
    /// does not divide so.
    pub fn part(&self, t: &Tensor, split: Split, len: usize, replicable: bool) -> Result<Option<Tensor>> {
        let axis = match split {
            Split::Rows => 0,
            Split::Columns => t.rank().saturating_sub(1),
        };
        let full = t.dim(axis)?;
        let world = self.world();
        if len == 0 || full % len != 0 {
            return Ok(None);
        }
        let parts = full / len;
        if parts != world && !(replicable && parts < world && world % parts == 0) {
            return Ok(None);
        }
        let index = self.rank() * parts / world;
        Ok(Some(t.narrow(axis, index * len, len)?.contiguous()?))
    }
}

/// Why a model cannot be divided among `world` ranks; None when it can.
pub fn unsupported(cfg: &TextConfig, world: usize) -> Option<String> {
    let arch = cfg.arch;
    if !matches!(arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3) {
        return Some(format!(
            "{} is not divided across ranks yet (llama, qwen2, qwen3 and gemma3 text models are)",
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
    if !(divides(kv) || world.is_multiple_of(kv)) {
        return Some(format!("{world} ranks neither divide the {kv} KV heads nor are a multiple of them"));
    }
    if !cfg.layer_kv.is_empty() {
        return Some("per-layer KV shapes are not divided across ranks yet".into());
    }
    None
}

/// The config of one rank's layers: its share of the heads (at least one KV head) and of the
/// MLP's width; the vocabulary stays whole (the output head's logits are gathered).
pub fn rank_config(cfg: &TextConfig, world: usize) -> TextConfig {
    let mut c = cfg.clone();
    c.num_heads /= world;
    c.num_kv_heads = (cfg.num_kv_heads / world).max(1);
    c.intermediate_size /= world;
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
