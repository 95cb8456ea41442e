//! The KV memory described per group of layers. Each group keeps its layers' memory one way:
//! paged dense keys and values, paged TurboQuant codes (with an optional float window per
//! sequence), or a recurrent state per sequence (a hybrid model's linear-attention layers: no
//! per-token memory, a fixed state per sequence, with a copy per verified row for
//! speculation). The pool is sized from the groups' sum: bytes per token for the paged
//! blocks, bytes per state slot (one slot per sequence that may run) for the rest.

use super::format::{KvDtype, TqBits, TqSpec};
use crate::config::{KvShape, TextConfig};

/// How one group of layers keeps its memory.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheKind {
    /// Keys and values per token in paged blocks.
    PagedDense { dtype: KvDtype },
    /// TurboQuant codes per token in paged blocks; with `float_window` > 0, each sequence's
    /// last `float_window` keys and values also in `float_dtype` (a ring in its state slot).
    PagedTurboQuant { bits: TqBits, float_dtype: KvDtype, float_window: usize },
    /// A fixed state per sequence and layer (`state_bytes`), no per-token memory.
    Recurrent { state_bytes: usize },
}

#[derive(Debug, Clone, PartialEq)]
pub struct CacheGroup {
    pub kind: CacheKind,
    /// The layers it covers, ascending.
    pub layers: Vec<usize>,
}

/// Every layer's cache, by group.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSpec {
    pub groups: Vec<CacheGroup>,
    /// Each layer's key/value geometry, by layer index.
    shapes: Vec<KvShape>,
    /// Copies of a recurrent state each slot holds: 1, or 1 + the most draft tokens, so that
    /// a verify step can keep the state after each of its rows and roll back to any of them.
    pub state_checkpoints: usize,
}

/// What a memory budget buys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSize {
    pub num_blocks: usize,
    /// Bytes reserved for the state slots.
    pub slot_bytes: u64,
}

impl CacheSpec {
    /// Every layer of `cfg`: attention layers dense in `float`, or TurboQuant codes as `tq`
    /// says (its skipped layers dense); a hybrid model's linear-attention layers recurrent.
    /// KV-sharing layers are in no group: they keep nothing.
    pub fn for_model(cfg: &TextConfig, float: KvDtype, tq: Option<&TqSpec>) -> Self {
        let shapes = (0..cfg.num_cache_layers()).map(|l| cfg.kv_shape(l)).collect();
        let spec = Self::for_attention_layers(cfg.cache_layers(), shapes, float, tq, cfg.num_layers);
        match &cfg.linear_attn {
            Some(l) if !cfg.linear_layers().is_empty() => spec.with_group(CacheGroup {
                kind: CacheKind::Recurrent { state_bytes: l.state_bytes() },
                layers: cfg.linear_layers(),
            }),
            _ => spec,
        }
    }

    /// The same for `num_layers` attention layers of `num_kv_heads` x `head_dim`.
    pub fn for_layers(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        float: KvDtype,
        tq: Option<&TqSpec>,
    ) -> Self {
        let shapes = vec![KvShape { num_kv_heads, head_dim }; num_layers];
        Self::for_attention_layers((0..num_layers).collect(), shapes, float, tq, num_layers)
    }

    /// Layers from `first_mtp` on are MTP layers (a drafter's), kept in floats: their rows are
    /// written again as drafts are verified, which codes and float-window rings do not allow.
    fn for_attention_layers(
        all: Vec<usize>,
        shapes: Vec<KvShape>,
        float: KvDtype,
        tq: Option<&TqSpec>,
        first_mtp: usize,
    ) -> Self {
        let groups = match tq {
            None => vec![CacheGroup { kind: CacheKind::PagedDense { dtype: float }, layers: all }],
            Some(t) => {
                let quantized =
                    CacheKind::PagedTurboQuant { bits: t.bits, float_dtype: float, float_window: t.float_window };
                let (coded, dense): (Vec<usize>, Vec<usize>) =
                    all.into_iter().partition(|&l| t.quantizes(l) && l < first_mtp);
                [(CacheKind::PagedDense { dtype: float }, dense), (quantized, coded)]
                    .into_iter()
                    .filter(|(_, layers)| !layers.is_empty())
                    .map(|(kind, layers)| CacheGroup { kind, layers })
                    .collect()
            }
        };
        CacheSpec { groups, shapes, state_checkpoints: 1 }
    }

    /// Adds a group (a hybrid model's recurrent layers, say).
    pub fn with_group(mut self, group: CacheGroup) -> Self {
        self.groups.push(group);
        self
    }

    pub fn with_state_checkpoints(mut self, n: usize) -> Self {
        self.state_checkpoints = n.max(1);
        self
    }

    /// The kind of cache `layer` has.
    pub fn kind_of(&self, layer: usize) -> Option<&CacheKind> {
        self.groups.iter().find(|g| g.layers.binary_search(&layer).is_ok()).map(|g| &g.kind)
    }

    /// Bytes one token occupies in the paged blocks, over every group.
    pub fn bytes_per_token(&self) -> usize {
        self.per_layer(|kind, KvShape { num_kv_heads: h, head_dim: d }| match kind {
            CacheKind::PagedDense { dtype } => 2 * h * d * dtype.bytes(),
            CacheKind::PagedTurboQuant { bits, .. } => {
                let (rk, rv) = TqSpec::new(*bits).row_bytes(d);
                h * (rk + rv)
            }
            CacheKind::Recurrent { .. } => 0,
        })
    }

    /// The sum over every grouped layer of `bytes(its kind, its shape)`.
    fn per_layer(&self, bytes: impl Fn(&CacheKind, KvShape) -> usize) -> usize {
        let shape = |l: usize| self.shapes.get(l).copied().unwrap_or(KvShape { num_kv_heads: 0, head_dim: 0 });
        self.groups.iter().flat_map(|g| g.layers.iter().map(|&l| bytes(&g.kind, shape(l)))).sum()
    }

    /// Bytes one state slot holds, over every group: float-window rings, recurrent states
    /// (times their checkpoints).
    pub fn bytes_per_slot(&self) -> usize {
        self.per_layer(|kind, KvShape { num_kv_heads: h, head_dim: d }| match kind {
            CacheKind::PagedDense { .. } => 0,
            CacheKind::PagedTurboQuant { float_dtype, float_window, .. } => {
                2 * float_window * h * d * float_dtype.bytes()
            }
            CacheKind::Recurrent { state_bytes } => state_bytes * self.state_checkpoints,
        })
    }

    /// Of `bytes_per_slot`, the recurrent states' share.
    pub fn recurrent_bytes_per_slot(&self) -> usize {
        self.groups
            .iter()
            .map(|g| match &g.kind {
                CacheKind::Recurrent { state_bytes } => g.layers.len() * state_bytes * self.state_checkpoints,
                _ => 0,
            })
            .sum()
    }

    /// The pool `budget` bytes hold: `slots` state slots first, the rest in blocks of
    /// `block_size` tokens. None when the slots alone do not fit.
    pub fn pool(&self, budget: u64, block_size: usize, slots: usize) -> Option<PoolSize> {
        let slot_bytes = (self.bytes_per_slot() * slots) as u64;
        if slot_bytes > 0 && slot_bytes >= budget {
            return None;
        }
        let rest = budget - slot_bytes;
        let per_block = (self.bytes_per_token() * block_size) as u64;
        let num_blocks = if per_block == 0 { 0 } else { (rest / per_block) as usize };
        Some(PoolSize { num_blocks, slot_bytes })
    }
}

impl TqSpec {
    /// Bytes one token occupies in the paged blocks across all layers.
    pub fn bytes_per_token(&self, cfg: &TextConfig, float: KvDtype) -> usize {
        CacheSpec::for_model(cfg, float, Some(self)).bytes_per_token()
    }

    /// Bytes of the float-window rings of `window_rings` sequences (outside the paged blocks,
    /// fixed at start).
    pub fn window_bytes(&self, cfg: &TextConfig, float: KvDtype) -> usize {
        let spec = CacheSpec::for_model(cfg, float, Some(self));
        self.window_rings * (spec.bytes_per_slot() - spec.recurrent_bytes_per_slot())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_turboquant_groups_cover_every_layer_once() {
        let dense = CacheSpec::for_layers(4, 2, 64, KvDtype::Bf16, None);
        assert_eq!(dense.groups.len(), 1);
        assert_eq!(dense.bytes_per_token(), 4 * 2 * 2 * 64 * 2);
        assert_eq!(dense.bytes_per_slot(), 0);
        let tq = TqSpec { skip_layers: vec![0], float_window: 8, ..TqSpec::new(TqBits { key: 4, value: 4 }) };
        let s = CacheSpec::for_layers(4, 2, 64, KvDtype::F32, Some(&tq));
        assert_eq!(s.kind_of(0), Some(&CacheKind::PagedDense { dtype: KvDtype::F32 }));
        assert!(matches!(s.kind_of(3), Some(CacheKind::PagedTurboQuant { float_window: 8, .. })));
        assert_eq!(s.kind_of(4), None);
        // Layer 0 dense f32; three layers of 4-bit codes (32 bytes + an f32 norm per head row).
        assert_eq!(s.bytes_per_token(), 2 * 2 * 64 * 4 + 3 * 2 * (36 + 36));
        assert_eq!(s.bytes_per_slot(), 3 * 2 * 8 * 2 * 64 * 4);
    }

    /// A hybrid model: two attention layers paged, two recurrent layers with a state per
    /// sequence, kept once per verified row when speculating.
    #[test]
    fn recurrent_state_is_sized_per_slot_with_its_checkpoints() {
        let spec = CacheSpec::for_layers(2, 2, 64, KvDtype::Bf16, None)
            .with_group(CacheGroup { kind: CacheKind::Recurrent { state_bytes: 1000 }, layers: vec![2, 3] })
            .with_state_checkpoints(5);
        assert_eq!(spec.kind_of(2), Some(&CacheKind::Recurrent { state_bytes: 1000 }));
        assert_eq!(spec.bytes_per_token(), 2 * 2 * 2 * 64 * 2);
        assert_eq!(spec.bytes_per_slot(), 2 * 1000 * 5);
        // 8 slots take 80,000 bytes of the budget; the rest is blocks of 16 tokens (16 KiB each).
        let pool = spec.pool(80_000 + 3 * 16 * 1024 + 5, 16, 8).unwrap();
        assert_eq!(pool, PoolSize { num_blocks: 3, slot_bytes: 80_000 });
        assert_eq!(spec.pool(80_000, 16, 8), None, "no room left beside the slots");
    }
}
