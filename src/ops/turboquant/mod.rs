//! TurboQuant-MSE codes for KV caches (Zandieh et al., 2025): each head vector is stored as
//! its norm and the b-bit Lloyd-Max codes of its randomly rotated direction. The codec is the
//! CPU reference of the ops that write the codes (`tq_write`, `qkv_rope`) and attend over them
//! (`tq_attention`), which is why it sits with the ops, below `kv`; `TqLayerCache` is the
//! storage those ops take.

pub mod codebook;
pub mod codec;
pub mod layer_cache;
pub mod pack;
pub mod rotation;

pub use codebook::Codebook;
pub use codec::{DeviceCodecs, LayerCodecs, TqCodec};
pub use layer_cache::{FloatWindow, TqLayerCache};
