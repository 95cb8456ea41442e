use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::Tensor;

use crate::ops::qmatmul::AffineMatrix;

/// One tensor as stored: dense values, or a quantized matrix kept quantized.
pub enum StoredTensor {
    Dense(Tensor),
    /// GGUF block-quantized.
    Quantized(Arc<QTensor>),
    /// MLX affine-quantized (on the CPU; other devices get it dequantized).
    Affine(AffineMatrix),
}
