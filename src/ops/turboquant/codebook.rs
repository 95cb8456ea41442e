//! Lloyd-Max scalar codebooks for one coordinate of a rotated unit vector.
//!
//! A uniformly random rotation maps a unit vector of dimension d to a uniform point on the
//! sphere, whose every coordinate t has the density f(t) ~ (1 - t^2)^((d-3)/2) on [-1, 1]
//! (variance 1/d; N(0, 1/d) in the large-d limit). The codebook is the b-bit quantizer with
//! the least mean squared error for that law, found by Lloyd's iteration on a fine grid.

/// Grid intervals over the positive half of the support (in units of 1/sqrt(d)).
const GRID: usize = 1 << 16;

/// The b-bit Lloyd-Max quantizer of one coordinate in dimension d.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    bits: u8,
    /// 2^b reconstruction values, ascending, in coordinate units (not scaled by sqrt(d)).
    centroids: Vec<f32>,
    /// 2^b - 1 cell boundaries, ascending: a value's index is the number of boundaries below it.
    boundaries: Vec<f32>,
    /// Expected squared error for a unit vector: d * E[(t - Q(t))^2].
    distortion: f64,
}

/// Cumulative integrals of the coordinate law on a grid over [0, zmax], z = t sqrt(d):
/// mass, first and second moments, each normalised to the positive half's mass.
struct Law {
    h: f64,
    m0: Vec<f64>,
    m1: Vec<f64>,
    m2: Vec<f64>,
}

impl Law {
    /// The density of z = t sqrt(d) is (1 - z^2/d)^((d-3)/2) on |z| < sqrt(d); `None` for
    /// the Gaussian limit. Integrated by the trapezoid rule (plenty at 2^16 intervals).
    fn new(dim: Option<usize>) -> Self {
        let zmax = match dim {
            Some(d) => (d as f64).sqrt().min(14.0),
            None => 14.0,
        };
        let h = zmax / GRID as f64;
        let density = |z: f64| match dim {
            Some(d) => {
                let d = d as f64;
                (1.0 - z * z / d).max(0.0).powf((d - 3.0) / 2.0)
            }
            None => (-z * z / 2.0).exp(),
        };
        let (mut m0, mut m1, mut m2) = (vec![0.0; GRID + 1], vec![0.0; GRID + 1], vec![0.0; GRID + 1]);
        let mut prev = density(0.0);
        for i in 1..=GRID {
            let (z0, z1) = ((i - 1) as f64 * h, i as f64 * h);
            let f = density(z1);
            m0[i] = m0[i - 1] + 0.5 * h * (prev + f);
            m1[i] = m1[i - 1] + 0.5 * h * (z0 * prev + z1 * f);
            m2[i] = m2[i - 1] + 0.5 * h * (z0 * z0 * prev + z1 * z1 * f);
            prev = f;
        }
        let total = m0[GRID];
        for m in [&mut m0, &mut m1, &mut m2] {
            m.iter_mut().for_each(|x| *x /= total);
        }
        Law { h, m0, m1, m2 }
    }

    fn zmax(&self) -> f64 {
        self.h * GRID as f64
    }

    /// Cumulative value of `m` at z, linearly interpolated between grid points.
    fn at(&self, m: &[f64], z: f64) -> f64 {
        let x = (z / self.h).clamp(0.0, GRID as f64);
        let i = (x as usize).min(GRID - 1);
        m[i] + (x - i as f64) * (m[i + 1] - m[i])
    }

    /// (mass, first moment, second moment) of the interval [a, b] within the positive half.
    fn moments(&self, a: f64, b: f64) -> (f64, f64, f64) {
        let d = |m: &[f64]| self.at(m, b) - self.at(m, a);
        (d(&self.m0), d(&self.m1), d(&self.m2))
    }
}

impl Codebook {
    /// The codebook for dimension `dim` (>= 3) and `bits` in 1..=4.
    pub fn lloyd_max(dim: usize, bits: u8) -> Self {
        assert!(dim >= 3, "the coordinate law needs d >= 3");
        Self::solve(Some(dim), dim, bits)
    }

    /// The large-d limit: the Lloyd-Max quantizer of N(0, 1), scaled to dimension `dim`.
    pub fn gaussian_limit(dim: usize, bits: u8) -> Self {
        Self::solve(None, dim, bits)
    }

    fn solve(law_dim: Option<usize>, dim: usize, bits: u8) -> Self {
        assert!((1..=4).contains(&bits), "1 to 4 bits per coordinate");
        let law = Law::new(law_dim);
        // The law is symmetric: solve for the 2^(b-1) positive centroids, cell edges at 0
        // and the end of the support.
        let half = 1usize << (bits - 1);
        let mut c: Vec<f64> = (0..half).map(|k| (k as f64 + 0.5) * 3.0 / half as f64).collect();
        let edges = |c: &[f64]| -> Vec<f64> {
            let mut e = vec![0.0];
            e.extend(c.windows(2).map(|w| 0.5 * (w[0] + w[1])));
            e.push(law.zmax());
            e
        };
        for _ in 0..20_000 {
            let e = edges(&c);
            let next: Vec<f64> = (0..half)
                .map(|k| {
                    let (m0, m1, _) = law.moments(e[k], e[k + 1]);
                    if m0 > 0.0 {
                        m1 / m0
                    } else {
                        0.5 * (e[k] + e[k + 1])
                    }
                })
                .collect();
            let change = next.iter().zip(&c).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            c = next;
            if change < 1e-10 {
                break;
            }
        }
        let e = edges(&c);
        // Both halves contribute equally; the moments are normalised to one half's mass.
        let distortion: f64 = (0..half)
            .map(|k| {
                let (m0, m1, m2) = law.moments(e[k], e[k + 1]);
                m2 - 2.0 * c[k] * m1 + c[k] * c[k] * m0
            })
            .sum();
        let scale = 1.0 / (dim as f64).sqrt();
        let centroids: Vec<f32> =
            c.iter().rev().map(|x| (-x * scale) as f32).chain(c.iter().map(|x| (x * scale) as f32)).collect();
        let inner = &e[1..half];
        let boundaries: Vec<f32> = inner
            .iter()
            .rev()
            .map(|x| (-x * scale) as f32)
            .chain(std::iter::once(0.0))
            .chain(inner.iter().map(|x| (x * scale) as f32))
            .collect();
        Codebook { bits, centroids, boundaries, distortion }
    }

    pub fn bits(&self) -> u8 {
        self.bits
    }

    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }

    pub fn boundaries(&self) -> &[f32] {
        &self.boundaries
    }

    /// Expected squared error of quantizing a random unit vector: d * E[(t - Q(t))^2].
    pub fn distortion(&self) -> f64 {
        self.distortion
    }

    /// The code of one coordinate: how many boundaries lie below it.
    #[inline]
    pub fn index(&self, y: f32) -> u8 {
        self.boundaries.iter().map(|&b| (y > b) as u8).sum()
    }

    /// The centroids repeated to 16 entries (entry i holds centroid i mod 2^b): a lookup by
    /// the low 4 bits of a code then needs no masking of the bits above a code.
    pub fn table16(&self) -> [f32; 16] {
        std::array::from_fn(|i| self.centroids[i % self.centroids.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The N(0, 1) Lloyd-Max table of the TurboQuant notes (positive halves) and its MSE.
    const TABLE: [(u8, &[f64], &[f64], f64); 4] = [
        (1, &[0.7979], &[], 0.3634),
        (2, &[0.4528, 1.5104], &[0.9816], 0.1175),
        (3, &[0.2451, 0.7560, 1.3439, 2.1519], &[0.5005, 1.0500, 1.7479], 0.03455),
        (
            4,
            &[0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
            &[0.2582, 0.5224, 0.7995, 1.0993, 1.4371, 1.8435, 2.4008],
            0.00950,
        ),
    ];

    #[test]
    fn gaussian_limit_reproduces_the_published_table() {
        for (bits, cs, bs, mse) in TABLE {
            let cb = Codebook::gaussian_limit(1, bits);
            let half = cs.len();
            for (k, want) in cs.iter().enumerate() {
                let got = cb.centroids()[half + k] as f64;
                assert!((got - want).abs() < 1.5e-3, "b={bits} centroid {k}: {got} vs {want}");
            }
            for (k, want) in bs.iter().enumerate() {
                let got = cb.boundaries()[half + k] as f64;
                assert!((got - want).abs() < 1.5e-3, "b={bits} boundary {k}: {got} vs {want}");
            }
            assert!((cb.distortion() / mse - 1.0).abs() < 5e-3, "b={bits}: MSE {} vs {mse}", cb.distortion());
        }
    }

    #[test]
    fn exact_law_approaches_the_gaussian_limit_and_is_symmetric() {
        for bits in 1..=4 {
            let g = Codebook::gaussian_limit(4096, bits);
            let e = Codebook::lloyd_max(4096, bits);
            for (a, b) in e.centroids().iter().zip(g.centroids()) {
                assert!((a - b).abs() * 64.0 < 5e-3, "b={bits}: {a} vs {b}");
            }
            let n = e.centroids().len();
            for k in 0..n {
                assert_eq!(e.centroids()[k], -e.centroids()[n - 1 - k]);
            }
            assert!(e.centroids().windows(2).all(|w| w[0] < w[1]));
            assert!(e.boundaries().windows(2).all(|w| w[0] < w[1]));
            // Each boundary is the midpoint of its neighbours (Lloyd's optimality condition).
            for (k, b) in e.boundaries().iter().enumerate() {
                let mid = 0.5 * (e.centroids()[k] + e.centroids()[k + 1]);
                assert!((b - mid).abs() < 1e-6, "b={bits}: boundary {k}");
            }
        }
    }

    #[test]
    fn index_counts_boundaries_below() {
        let cb = Codebook::lloyd_max(64, 2);
        let b = cb.boundaries().to_vec();
        assert_eq!(cb.index(-1.0), 0);
        assert_eq!(cb.index(b[0] + 1e-4), 1);
        assert_eq!(cb.index(1e-4), 2);
        assert_eq!(cb.index(1.0), 3);
        let t = cb.table16();
        assert_eq!(t[5], cb.centroids()[1]);
    }
}
