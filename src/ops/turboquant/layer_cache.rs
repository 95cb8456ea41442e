//! One layer's keys and values as TurboQuant codes, and its float window: what the TurboQuant
//! ops (`tq_write`, `tq_attention`, `qkv_rope`) write and read. `kv::KvCache` allocates them,
//! one per quantized layer of the pool.

use candle_core::Tensor;

use super::codec::{DeviceCodecs, LayerCodecs};

/// A layer's keys and values as TurboQuant codes.
pub struct TqLayerCache {
    /// `[num_blocks * block_size, kv_heads, row]` u8, a row being a head vector's packed
    /// codes and f32 norm (`codecs.key.row_bytes()`, `codecs.value.row_bytes()`).
    pub k: Tensor,
    pub v: Tensor,
    pub codecs: LayerCodecs,
    pub window: Option<FloatWindow>,
    /// `codecs` in device memory, for a cache on a GPU (None on the CPU).
    pub device: Option<DeviceCodecs>,
}

/// The most recent `len` keys and values of each running sequence, unquantized: ring r holds
/// position j of its sequence at row `r * len + j % len` of `[rings * len, kv_heads, head_dim]`.
pub struct FloatWindow {
    pub len: usize,
    pub k: Tensor,
    pub v: Tensor,
}
