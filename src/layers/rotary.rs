//! Rotary position embeddings with per-token positions: 1-D, and M-RoPE (Qwen2-VL), where
//! each token has a temporal, height and width position and each frequency follows one of them.

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::Positions;
use crate::models::config::{RopeConfig, RopeLayout, RopeScaling};

/// Inverse frequencies of one rotary configuration, computed in f32 as transformers does.
#[derive(Debug, Clone)]
pub struct Rotary {
    inv_freq: Vec<f32>,
    layout: RopeLayout,
    /// M-RoPE: the position axis (0 = t, 1 = h, 2 = w) of each frequency.
    axis_of_freq: Option<Vec<usize>>,
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
        // Frequency j follows axis a while j is inside section a (sections laid end to end).
        let axis_of_freq = cfg
            .mrope_section
            .as_ref()
            .map(|sections| sections.iter().enumerate().flat_map(|(axis, &n)| std::iter::repeat_n(axis, n)).collect());
        Rotary { inv_freq, layout, axis_of_freq }
    }

    /// cos/sin for the given positions, `[T, 1, head_dim / 2]` each.
    pub fn angles(&self, positions: &[u32], device: &Device, dtype: DType) -> Result<RotaryAngles> {
        let mut angles = Vec::with_capacity(positions.len() * self.inv_freq.len());
        for &p in positions {
            angles.extend(self.inv_freq.iter().map(|&f| p as f32 * f));
        }
        RotaryAngles::from_angles(&angles, positions.len(), self.layout, device, dtype)
    }

    /// cos/sin for a batch's positions. Three-axis positions need M-RoPE sections; with equal
    /// axes (text tokens) M-RoPE is plain 1-D rotary, so 1-D positions work either way.
    pub fn angles_for(&self, positions: &Positions, device: &Device, dtype: DType) -> Result<RotaryAngles> {
        match positions {
            Positions::Flat(p) => self.angles(p, device, dtype),
            Positions::MRope(p) => {
                let Some(axes) = &self.axis_of_freq else {
                    candle_core::bail!("three-axis positions given to a model without M-RoPE sections")
                };
                let mut angles = Vec::with_capacity(p.len() * self.inv_freq.len());
                for pos in p {
                    angles.extend(self.inv_freq.iter().zip(axes).map(|(&f, &a)| pos[a] as f32 * f));
                }
                RotaryAngles::from_angles(&angles, p.len(), self.layout, device, dtype)
            }
        }
    }
}

/// One step's rotation, shared by all layers with the same rotary configuration.
pub struct RotaryAngles {
    cos: Tensor,
    sin: Tensor,
    layout: RopeLayout,
}

impl RotaryAngles {
    /// From rotation angles `[rows, half]` (row-major), each the angle of one rotary pair.
    pub fn from_angles(angles: &[f32], rows: usize, layout: RopeLayout, device: &Device, dtype: DType) -> Result<Self> {
        let half = angles.len().checked_div(rows).unwrap_or(0);
        let shape = (rows, 1, half);
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        Ok(RotaryAngles {
            cos: Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?,
            layout,
        })
    }

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
