//! Images for vision-language models: decoding with limits, resampling the way the reference
//! preprocessing (Pillow) does it, the patch processor of the Qwen2-VL and GLM-4.xV families,
//! and Gemma 4's.

pub mod decode;
pub mod gemma4_processor;
mod pixels;
pub mod processor;
pub mod remote;
pub mod resize;

pub use decode::{decode_image, DecodeLimits, ImageError};
pub use pixels::{PixelValues, RgbImage};
