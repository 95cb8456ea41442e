use std::fmt;

use candle_core::{DType, Device, Tensor};

use crate::models::config::TextConfig;

/// Element type of a dense KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
    F16,
}

impl KvDtype {
    pub fn dtype(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::Bf16 => DType::BF16,
            KvDtype::F16 => DType::F16,
        }
    }

    pub fn from_dtype(d: DType) -> Option<Self> {
        match d {
            DType::F32 => Some(KvDtype::F32),
            DType::BF16 => Some(KvDtype::Bf16),
            DType::F16 => Some(KvDtype::F16),
            _ => None,
        }
    }

    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
        })
    }
}

/// Shape of the pool: how many blocks of how many tokens, in which type.
#[derive(Debug, Clone, Copy)]
pub struct KvCacheSpec {
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

impl KvCacheSpec {
    /// Bytes one token occupies across all layers (keys and values).
    pub fn bytes_per_token(cfg: &TextConfig, dtype: KvDtype) -> usize {
        cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.bytes()
    }

    /// As many blocks as `budget_bytes` holds.
    pub fn from_budget(cfg: &TextConfig, dtype: KvDtype, block_size: usize, budget_bytes: u64) -> Self {
        let per_block = (Self::bytes_per_token(cfg, dtype) * block_size) as u64;
        KvCacheSpec { block_size, num_blocks: (budget_bytes / per_block.max(1)) as usize, dtype }
    }

    pub fn capacity_tokens(&self) -> usize {
        self.block_size * self.num_blocks
    }
}

/// One layer's block storage. Quantized storage (TurboQuant codes + norms) is a future variant.
pub enum LayerCache {
    /// Keys and values as `[num_blocks * block_size, kv_heads, head_dim]`.
    Dense { k: Tensor, v: Tensor },
}

/// The whole pool: every layer's storage for the same set of blocks.
pub struct KvCache {
    spec: KvCacheSpec,
    layers: Vec<LayerCache>,
    bytes: usize,
}

impl KvCache {
    pub fn new(cfg: &TextConfig, spec: KvCacheSpec, device: &Device) -> candle_core::Result<Self> {
        let slots = spec.num_blocks * spec.block_size;
        let shape = (slots, cfg.num_kv_heads, cfg.head_dim);
        let layers = (0..cfg.num_layers)
            .map(|_| {
                Ok(LayerCache::Dense {
                    k: Tensor::zeros(shape, spec.dtype.dtype(), device)?,
                    v: Tensor::zeros(shape, spec.dtype.dtype(), device)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let bytes = layers
            .iter()
            .map(|l| match l {
                LayerCache::Dense { k, v } => (k.elem_count() + v.elem_count()) * spec.dtype.bytes(),
            })
            .sum();
        Ok(KvCache { spec, layers, bytes })
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    pub fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }

    /// Bytes actually allocated for the pool.
    pub fn allocated_bytes(&self) -> usize {
        self.bytes
    }
}
