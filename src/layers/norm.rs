use candle_core::{Result, Tensor};

use crate::weights::{Weights, WeightsError};

/// Which RMSNorm convention the checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormStyle {
    /// `x / rms(x) * w`
    Plain,
    /// `x / rms(x) * (1 + w)` (Gemma); `1 + w` is folded in at load time.
    OnePlus,
}

pub struct RmsNorm {
    scale: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn load(
        w: &Weights,
        name: &str,
        dim: usize,
        eps: f64,
        style: NormStyle,
    ) -> std::result::Result<Self, WeightsError> {
        let mut scale = w.dense_f32(name, &[dim])?;
        if style == NormStyle::OnePlus {
            scale = (scale + 1.0)?;
        }
        Ok(RmsNorm { scale: scale.to_dtype(w.dtype())?, eps: eps as f32 })
    }

    /// Normalises over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.scale, self.eps)
    }
}

/// `(x - mean(x)) / sqrt(var(x) + eps) * w + b` over the last dimension (vision towers).
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    pub fn load(w: &Weights, prefix: &str, dim: usize, eps: f64) -> std::result::Result<Self, WeightsError> {
        Ok(LayerNorm {
            weight: w.dense(&format!("{prefix}.weight"), &[dim])?,
            bias: w.dense(&format!("{prefix}.bias"), &[dim])?,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm(&x.contiguous()?, &self.weight, &self.bias, self.eps)
    }
}
