//! Per-channel key scales for a TurboQuant cache, measured once per model.
//!
//! q.k = (q / t).(k t) for any positive per-channel t, so keys may be quantized as k t with the
//! query divided by t, exactly. TurboQuant's error is spread evenly over a rotated vector's
//! coordinates, so the error of a score q.k is smallest when the channels' energies are
//! balanced against the queries': t = (E[q_c^2] / E[k_c^2])^(1/4) minimises
//! E|k t|^2 E|q / t|^2 over diagonal t. Many models' keys put most of their energy in a few
//! channels that queries barely read (measured on SmolLM2 and Gemma-3: see docs/kv-quant.md),
//! where this cuts the perplexity cost of 3- and 4-bit keys several times.
//!
//! The moments come from a fixed text run through the model once at start (a float cache
//! whose layers also record their queries' and keys' squares), so the scales are fixed per
//! model: every request and batch sees the same ones. Channels that rotary embeddings rotate
//! together get one scale, so the scaling commutes with rotary at any position.

use std::sync::Mutex;

use candle_core::{Result, Tensor};

use crate::models::config::RopeLayout;

/// Sums of squares of one layer's queries (over the query heads of each kv head) and keys,
/// per kv head and channel.
#[derive(Debug, Default)]
pub struct Moments {
    q2: Vec<f64>,
    k2: Vec<f64>,
    rows: usize,
}

/// A layer's float cache during calibration, recording what attention sees.
pub struct CalibrationCache {
    /// `[slots, kv_heads, head_dim]` f32, used like a dense cache.
    pub k: Tensor,
    pub v: Tensor,
    moments: Mutex<Moments>,
}

impl CalibrationCache {
    pub fn new(k: Tensor, v: Tensor) -> Self {
        CalibrationCache { k, v, moments: Mutex::new(Moments::default()) }
    }

    /// Adds a step's queries `[T, heads, d]` and keys `[T, kv_heads, d]` (after rotary).
    pub fn record(&self, q: &Tensor, k: &Tensor) -> Result<()> {
        let (t, hq, d) = q.dims3()?;
        let hkv = k.dim(1)?;
        let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
        let kv: Vec<f32> = k.flatten_all()?.to_vec1()?;
        let mut m = self.moments.lock().unwrap_or_else(|p| p.into_inner());
        if m.q2.is_empty() {
            m.q2 = vec![0.0; hkv * d];
            m.k2 = vec![0.0; hkv * d];
        }
        let group = hq / hkv;
        for row in 0..t {
            for h in 0..hq {
                let dst = (h / group) * d;
                for (c, x) in qv[(row * hq + h) * d..][..d].iter().enumerate() {
                    m.q2[dst + c] += (*x as f64).powi(2) / group as f64;
                }
            }
            for (i, x) in kv[row * hkv * d..][..hkv * d].iter().enumerate() {
                m.k2[i] += (*x as f64).powi(2);
            }
        }
        m.rows += t;
        Ok(())
    }

    /// The layer's key scales `[kv_heads * head_dim]`, normalised to a mean square of 1 per
    /// head (TurboQuant keeps each vector's norm, so only ratios matter).
    pub fn key_scales(&self, d: usize, layout: RopeLayout) -> Vec<f32> {
        let m = self.moments.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::with_capacity(m.k2.len());
        for (qh, kh) in m.q2.chunks_exact(d).zip(m.k2.chunks_exact(d)) {
            let t: Vec<f64> = (0..d)
                .map(|c| {
                    let p = rotary_partner(c, d, layout);
                    let (q, k) = (qh[c] + qh[p], kh[c] + kh[p]);
                    (q.max(1e-12) / k.max(1e-12)).powf(0.25)
                })
                .collect();
            let rms = (t.iter().map(|x| x * x).sum::<f64>() / d as f64).sqrt();
            out.extend(t.iter().map(|x| (x / rms) as f32));
        }
        out
    }
}

/// The channel rotary embeddings pair with channel `c`.
fn rotary_partner(c: usize, d: usize, layout: RopeLayout) -> usize {
    match layout {
        RopeLayout::Half => (c + d / 2) % d,
        RopeLayout::Interleaved => c ^ 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn scales_balance_query_and_key_energy_per_rotary_pair() {
        let dev = Device::Cpu;
        let (d, hq, t) = (4, 2, 3);
        // Keys: channel pair (0, 2) 100x the energy of pair (1, 3); queries uniform.
        let k = Tensor::new(&[[[10f32, 1.0, 10.0, 1.0]]; 3], &dev).unwrap();
        let q = Tensor::ones((t, hq, d), candle_core::DType::F32, &dev).unwrap();
        let c = CalibrationCache::new(k.clone(), k.clone());
        c.record(&q, &k).unwrap();
        let s = c.key_scales(d, RopeLayout::Half);
        assert_eq!(s.len(), 4);
        // t ~ k^(-1/2): the loud pair is scaled down 10^(1/2) times relative to the quiet one.
        assert!((s[1] / s[0] - 10f32.sqrt()).abs() < 1e-4, "{s:?}");
        assert_eq!(s[0], s[2]);
        assert_eq!(s[1], s[3]);
        let ms: f32 = s.iter().map(|x| x * x).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-5);
    }
}
