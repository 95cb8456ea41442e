//! Rotary position embeddings with per-token positions: 1-D, and M-RoPE (Qwen2-VL, GLM-4.xV),
//! where each token has a temporal, height and width position and each frequency follows one
//! of them. Partial rotary turns only a head's leading `rotary_dim` dimensions.

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::{AttentionMeta, Positions};
use crate::config::{RopeConfig, RopeLayout, RopeScaling};

/// Most positions a device table holds (a longer context rotates op by op, with uploaded angles).
pub const MAX_TABLE_POSITIONS: usize = 1 << 20;

/// Inverse frequencies of one rotary configuration, computed in f32 as transformers does.
#[derive(Debug, Clone)]
pub struct Rotary {
    inv_freq: Vec<f32>,
    layout: RopeLayout,
    /// M-RoPE: the position axis (0 = t, 1 = h, 2 = w) of each frequency.
    axis_of_freq: Option<Vec<usize>>,
    /// cos/sin of every 1-D position up to a limit, `[positions, head_dim / 2]`, kept on a GPU:
    /// a step looks its rows up there instead of uploading angles (which a CUDA graph cannot
    /// replay).
    table: Option<(Tensor, Tensor)>,
}

impl Rotary {
    /// `rotary_dim`: the head dimensions that rotate (the head dimension without partial rotary).
    pub fn new(cfg: &RopeConfig, rotary_dim: usize, layout: RopeLayout) -> Self {
        let base = cfg.theta as f32;
        let mut inv_freq: Vec<f32> =
            (0..rotary_dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / rotary_dim as f32)).collect();
        match cfg.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Proportional { fraction, factor } => {
                // transformers: `int(fraction * head_dim // 2)` turning pairs, then zeros.
                let turning = (fraction * rotary_dim as f64 / 2.0) as usize;
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    *f = if i < turning { *f / factor as f32 } else { 0.0 };
                }
            }
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
        let axis_of_freq = cfg.mrope_section.as_ref().map(|s| mrope_axes(s, inv_freq.len(), cfg.mrope_interleaved));
        Rotary { inv_freq, layout, axis_of_freq, table: None }
    }

    /// On a GPU, precomputes the angles of positions `[0, max_positions)` there (the same f32
    /// values `angles` computes). Nothing to do on the CPU.
    pub fn on_device(mut self, device: &Device, dtype: DType, max_positions: usize) -> Result<Self> {
        if device.is_cpu() {
            return Ok(self);
        }
        let positions: Vec<u32> = (0..max_positions.min(MAX_TABLE_POSITIONS) as u32).collect();
        let a = self.angles(&positions, device, dtype)?;
        let half = self.inv_freq.len();
        self.table = Some((a.cos.reshape((positions.len(), half))?, a.sin.reshape((positions.len(), half))?));
        Ok(self)
    }

    /// cos/sin for the given positions, `[T, 1, rotary_dim / 2]` each.
    pub fn angles(&self, positions: &[u32], device: &Device, dtype: DType) -> Result<RotaryAngles> {
        let mut angles = Vec::with_capacity(positions.len() * self.inv_freq.len());
        for &p in positions {
            angles.extend(self.inv_freq.iter().map(|&f| p as f32 * f));
        }
        RotaryAngles::from_angles(&angles, positions.len(), self.layout, device, dtype)
    }

    /// cos/sin for a batch's positions. Three-axis positions need M-RoPE sections; with equal
    /// axes (text tokens) M-RoPE is plain 1-D rotary, so 1-D positions work either way.
    /// 1-D positions are looked up in the device table when the step's metadata is on the
    /// device and every position is inside the table; otherwise angles are computed here and
    /// uploaded.
    pub fn angles_for(
        &self,
        positions: &Positions,
        meta: &AttentionMeta,
        device: &Device,
        dtype: DType,
    ) -> Result<RotaryAngles> {
        match positions {
            Positions::Flat(p) => {
                if let (Some((cos, sin)), Some(dm)) = (&self.table, &meta.device) {
                    let limit = cos.dim(0)?;
                    if dm.layout.rows == p.len() && p.iter().all(|&p| (p as usize) < limit) {
                        let idx = dm.positions()?;
                        let (t, half) = (p.len(), self.inv_freq.len());
                        return Ok(RotaryAngles {
                            cos: cos.index_select(&idx, 0)?.reshape((t, 1, half))?,
                            sin: sin.index_select(&idx, 0)?.reshape((t, 1, half))?,
                            layout: self.layout,
                        });
                    }
                }
                self.angles(p, device, dtype)
            }
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

/// The position axis (0 = t, 1 = h, 2 = w) each of `freqs` frequencies follows.
fn mrope_axes(sections: &[usize], freqs: usize, interleaved: bool) -> Vec<usize> {
    let section = |a: usize| sections.get(a).copied().unwrap_or(0);
    if interleaved {
        // transformers' Qwen3.5 `recomposition_frequencies`: t everywhere, then h on
        // `[1 : 3 * s_h : 3]` and w on `[2 : 3 * s_w : 3]`.
        (0..freqs)
            .map(|j| match j % 3 {
                1 if j < 3 * section(1) => 1,
                2 if j < 3 * section(2) => 2,
                _ => 0,
            })
            .collect()
    } else {
        // Frequency j follows axis a while j is inside section a (sections laid end to end).
        sections.iter().enumerate().flat_map(|(axis, &n)| std::iter::repeat_n(axis, n)).collect()
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

    /// cos and sin, `[T, 1, rotary_dim / 2]` each, and the pairing of the rotated elements.
    /// The angles of rows `rows` (`[n]` u32 indices) only.
    pub fn rows(&self, rows: &Tensor) -> Result<Self> {
        Ok(RotaryAngles {
            cos: self.cos.index_select(rows, 0)?,
            sin: self.sin.index_select(rows, 0)?,
            layout: self.layout,
        })
    }

    pub fn parts(&self) -> (&Tensor, &Tensor, RopeLayout) {
        (&self.cos, &self.sin, self.layout)
    }

    /// How many leading dimensions of each head these angles rotate.
    pub fn rotated_dims(&self) -> Result<usize> {
        Ok(2 * self.cos.dim(candle_core::D::Minus1)?)
    }

    /// Rotates `x` (`[T, heads, head_dim]`): its leading `2 * angles per row` dimensions, the
    /// rest pass through (partial rotary). Each row is its own "batch" of one token, so every
    /// row gets its own position.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, h, d) = x.dims3()?;
        let r = self.rotated_dims()?;
        if r > d {
            candle_core::bail!("{r} rotary dimensions for heads of {d}");
        }
        let turned = if r == d { x.contiguous()? } else { x.narrow(2, 0, r)?.contiguous()? };
        let x4 = turned.reshape((t, h, 1, r))?;
        let y = match self.layout {
            RopeLayout::Half => candle_nn::rotary_emb::rope(&x4, &self.cos, &self.sin)?,
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(&x4, &self.cos, &self.sin)?,
        }
        .reshape((t, h, r))?;
        if r == d {
            return Ok(y);
        }
        Tensor::cat(&[&y, &x.narrow(2, r, d - r)?], 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;

    /// Qwen3.5's interleaved M-RoPE for a prompt with two images: the cos/sin at transformers'
    /// positions are transformers' (tests/fixtures/qwen35_mrope.json,
    /// scripts/make_qwen35_mrope_fixture.py; `models::mrope`'s tests check the positions).
    #[test]
    fn interleaved_mrope_is_transformers_qwen35() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen35_mrope.json");
        let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let get = |k: &str| f[k].clone();
        let want: Vec<[u32; 3]> = serde_json::from_value(get("positions")).unwrap();
        assert!(want.iter().any(|[t, h, w]| t != h || h != w), "a case where the axes differ");

        let sections: Vec<usize> = serde_json::from_value(get("mrope_section")).unwrap();
        let rotary_dim = (get("head_dim").as_f64().unwrap() * get("partial_rotary_factor").as_f64().unwrap()) as usize;
        let cfg = RopeConfig {
            theta: get("rope_theta").as_f64().unwrap(),
            scaling: RopeScaling::None,
            mrope_section: Some(sections),
            mrope_interleaved: true,
        };
        let dev = Device::Cpu;
        let meta = AttentionMeta::new(16, Vec::new());
        let angles = |cfg: &RopeConfig| {
            let a = Rotary::new(cfg, rotary_dim, RopeLayout::Half)
                .angles_for(&Positions::MRope(want.clone()), &meta, &dev, DType::F32)
                .unwrap();
            let (cos, sin, _) = a.parts();
            (cos.squeeze(1).unwrap().to_vec2::<f32>().unwrap(), sin.squeeze(1).unwrap().to_vec2::<f32>().unwrap())
        };
        let max_diff = |a: &[Vec<f32>], b: &serde_json::Value| -> f32 {
            let b: Vec<Vec<f32>> = serde_json::from_value(b.clone()).unwrap();
            assert_eq!((a.len(), a[0].len()), (b.len(), b[0].len()));
            a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
        };
        let (cos, sin) = angles(&cfg);
        assert!(max_diff(&cos, &get("cos")) < 1e-6 && max_diff(&sin, &get("sin")) < 1e-6);
        // The chunked (Qwen2-VL) layout of the same sections is a different rotation here.
        let (cos, _) = angles(&RopeConfig { mrope_interleaved: false, ..cfg });
        assert!(max_diff(&cos, &get("cos")) > 1e-2);
    }

    #[test]
    fn partial_rotary_turns_the_leading_dimensions_only() {
        let cfg =
            RopeConfig { theta: 10_000.0, scaling: RopeScaling::None, mrope_section: None, mrope_interleaved: false };
        let dev = Device::Cpu;
        let x = Tensor::arange(0f32, 2.0 * 3.0 * 8.0, &dev).unwrap().reshape((2, 3, 8)).unwrap();
        for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
            let partial = Rotary::new(&cfg, 4, layout).angles(&[5, 9], &dev, DType::F32).unwrap().apply(&x).unwrap();
            let full4 = Rotary::new(&cfg, 4, layout)
                .angles(&[5, 9], &dev, DType::F32)
                .unwrap()
                .apply(&x.narrow(2, 0, 4).unwrap())
                .unwrap();
            let diff = |a: &Tensor, b: &Tensor| -> f32 {
                (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
            };
            assert_eq!(diff(&partial.narrow(2, 0, 4).unwrap(), &full4), 0.0);
            assert_eq!(diff(&partial.narrow(2, 4, 4).unwrap(), &x.narrow(2, 4, 4).unwrap()), 0.0);
            assert!(diff(&full4, &x.narrow(2, 0, 4).unwrap()) > 0.1, "the rotation does something");
        }
    }
}
