//! Rotary position embeddings with per-token positions.

use candle_core::{DType, Device, Result, Tensor};

use crate::models::config::{RopeConfig, RopeLayout, RopeScaling};

/// Inverse frequencies of one rotary configuration, computed in f32 as transformers does.
#[derive(Debug, Clone)]
pub struct Rotary {
    inv_freq: Vec<f32>,
    layout: RopeLayout,
}

impl Rotary {
    pub fn new(cfg: &RopeConfig, head_dim: usize, layout: RopeLayout) -> Self {
        let base = cfg.theta as f32;
        let mut inv_freq: Vec<f32> =
            (0..head_dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32)).collect();
        match cfg.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let (factor, lo, hi, old) =
                    (factor as f32, low_freq_factor as f32, high_freq_factor as f32, original_max_position as f32);
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    *f = if wavelen < high_wavelen {
                        *f
                    } else if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * *f / factor + smooth * *f
                    };
                }
            }
        }
        Rotary { inv_freq, layout }
    }

    /// cos/sin for the given positions, `[T, 1, head_dim / 2]` each.
    pub fn angles(&self, positions: &[u32], device: &Device, dtype: DType) -> Result<RotaryAngles> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let shape = (positions.len(), 1, half);
        Ok(RotaryAngles {
            cos: Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?,
            layout: self.layout,
        })
    }
}

/// One step's rotation, shared by all layers with the same rotary configuration.
pub struct RotaryAngles {
    cos: Tensor,
    sin: Tensor,
    layout: RopeLayout,
}

impl RotaryAngles {
    /// Rotates `x` (`[T, heads, head_dim]`). Each row is its own "batch" of one token, so every
    /// row gets its own position.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, h, d) = x.dims3()?;
        let x4 = x.contiguous()?.reshape((t, h, 1, d))?;
        let y = match self.layout {
            RopeLayout::Half => candle_nn::rotary_emb::rope(&x4, &self.cos, &self.sin)?,
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(&x4, &self.cos, &self.sin)?,
        };
        y.reshape((t, h, d))
    }
}
