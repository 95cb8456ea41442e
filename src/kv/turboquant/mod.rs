//! TurboQuant-MSE codes for KV caches (Zandieh et al., 2025): each head vector is stored as
//! its norm and the b-bit Lloyd-Max codes of its randomly rotated direction. Attention reads
//! the codes directly (`ops::tq_attention`).

pub mod codebook;
pub mod codec;
pub mod pack;
pub mod rotation;

pub use codebook::Codebook;
pub use codec::{DeviceCodecs, LayerCodecs, TqCodec};
