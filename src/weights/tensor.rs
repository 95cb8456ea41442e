use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::Tensor;

/// One tensor as stored: dense values, or a quantized matrix kept quantized.
pub enum StoredTensor {
    Dense(Tensor),
    Quantized(Arc<QTensor>),
}
