//! Per-channel key scales for a TurboQuant cache, measured once per model.
//!
//! q.k = (q / t).(k t) for any positive per-channel t, so keys may be quantized as k t with the
//! query divided by t, exactly. TurboQuant's error is spread evenly over a rotated vector's
//! coordinates, so the error of a score q.k is smallest when the channels' energies are
//! balanced against the queries': t = (E[q_c^2] / E[k_c^2])^(1/4) minimises
//! E|k t|^2 E|q / t|^2 over diagonal t. Some models' keys put much of their energy in channels
//! that queries barely read: on Gemma-3-270M this cuts the perplexity cost of 4-bit keys four
//! times; on SmolLM2-135M, whose query and key energies are proportional, it changes nothing
//! measurable (docs/kv-quant.md).
//!
//! The moments come from a fixed text run through the model once at start (a float cache
//! whose layers also record their queries' and keys' squares), so the scales are fixed per
//! model: every request and batch sees the same ones. The two channels rotary embeddings turn
//! together get one scale: their summed energy does not depend on the position, while each
//! channel's own does (for the slowly turning pairs), so scales fitted per channel on the
//! calibration text's positions are far off at others (measured: docs/kv-quant.md).

use std::sync::Mutex;

use candle_core::{Result, Tensor};

use crate::config::RopeLayout;

/// The least energy a rotary pair is taken to have, relative to the head's mean pair: bounds
/// the ratio of two scales by (head_dim / (2 ENERGY_FLOOR))^(1/2). On SmolLM2 every pair is
/// above it; on Gemma-3 a few per layer are below, most of them channels the model zeroes.
const ENERGY_FLOOR: f64 = 1e-3;

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
            let pair = |e: &[f64], c: usize| e[c] + e[rotary_partner(c, d, layout)];
            // A pair's energy counts as at least ENERGY_FLOOR of the head's mean: a channel
            // the calibration queries never read would otherwise get a tiny t, and a query
            // that does read it at serving time would be multiplied by 1 / t.
            let floor = |e: &[f64]| (e.iter().sum::<f64>() * 2.0 / d as f64 * ENERGY_FLOOR).max(1e-30);
            let (fq, fk) = (floor(qh), floor(kh));
            let t: Vec<f64> = (0..d).map(|c| (pair(qh, c).max(fq) / pair(kh, c).max(fk)).powf(0.25)).collect();
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

    #[test]
    fn a_pair_the_queries_never_read_gets_a_bounded_scale() {
        let dev = Device::Cpu;
        let d = 4;
        // Interleaved pairs (0, 1) and (2, 3); queries never read pair (2, 3).
        let k = Tensor::new(&[[[1f32, 1.0, 1.0, 1.0]]; 2], &dev).unwrap();
        let q = Tensor::new(&[[[1f32, 1.0, 0.0, 0.0]]; 2], &dev).unwrap();
        let c = CalibrationCache::new(k.clone(), k.clone());
        c.record(&q, &k).unwrap();
        let s = c.key_scales(d, RopeLayout::Interleaved);
        assert_eq!(s.len(), d);
        // Pair energies q: (4, 0) -> floored to 2e-3 of the mean pair energy (2); k: (4, 4).
        let want = (4.0f64 / (2.0 * ENERGY_FLOOR)).powf(0.25) as f32;
        assert!((s[0] / s[2] - want).abs() < 1e-3 * want, "{s:?}");
        assert!(s.iter().all(|x| x.is_finite() && *x > 0.0));
    }
}
