use candle_core::{Result, Tensor};

use crate::ops::add_rms_norm::{self, AddRmsNorm};
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

    /// A norm without a learned scale (`x / rms(x)`).
    pub fn unit(dim: usize, eps: f64, dtype: candle_core::DType, device: &candle_core::Device) -> Result<Self> {
        Ok(RmsNorm { scale: Tensor::ones(dim, dtype, device)?, eps: eps as f32 })
    }

    pub fn weight(&self) -> &Tensor {
        &self.scale
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// `(h, norm(h))` with `h = x + delta` (`[T, dim]` each): the residual add and the norm
    /// that reads it, in one pass on CUDA.
    pub fn forward_residual(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        if x.device().is_cuda() && x.rank() == 2 && add_rms_norm::supports(x.dim(1)?) {
            return AddRmsNorm { eps: self.eps }.forward(x, delta, &self.scale);
        }
        let h = (x + delta)?;
        let y = self.forward(&h)?;
        Ok((h, y))
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

    /// In two passes (the mean, then the squares about it), as PyTorch computes it: candle's
    /// fused op takes the variance as E[x^2] - E[x]^2, which loses the digits of a row whose
    /// mean is large beside its spread (raw pixels of a smooth image: 1e-4 of relative error in
    /// the unified Gemma 4 embedder, against 2e-7 this way).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(candle_core::DType::F32)?;
        let centred = x.broadcast_sub(&x.mean_keepdim(candle_core::D::Minus1)?)?;
        let var = centred.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps as f64)?.sqrt()?)?.to_dtype(dtype)?;
        normed.broadcast_mul(&self.weight)?.broadcast_add(&self.bias)
    }
}
