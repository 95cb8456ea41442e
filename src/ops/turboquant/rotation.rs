//! Seeded random rotations of head vectors.
//!
//! Power-of-two dimensions use two rounds of a randomized Hadamard transform,
//! R = (H D2)(H D1) / d with H the Walsh-Hadamard matrix and D1, D2 random sign diagonals:
//! O(d log d) per vector, and two rounds make even a one-hot vector's coordinates spread like
//! N(0, 1/d) (one round maps it to +-1/sqrt(d) everywhere, a poor fit for the codebook). Other
//! dimensions use a Haar-random orthogonal matrix (Gram-Schmidt of a Gaussian matrix).

/// SplitMix64: a small, stable generator, so that a seed names the same rotation forever.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn gaussian(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn sign(&mut self) -> f32 {
        if self.next() >> 63 == 0 {
            1.0
        } else {
            -1.0
        }
    }
}

#[derive(Debug, Clone)]
pub enum Rotation {
    Hadamard {
        signs1: Vec<f32>,
        signs2: Vec<f32>,
    },
    /// Row-major d x d orthogonal matrix.
    Dense {
        dim: usize,
        m: Vec<f32>,
    },
}

/// In place, unnormalised Walsh-Hadamard transform (length a power of two).
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, t) = (*u + *v, *u - *v);
                *u = s;
                *v = t;
            }
        }
        h *= 2;
    }
}

impl Rotation {
    pub fn seeded(dim: usize, seed: u64) -> Self {
        let mut rng = SplitMix64(seed);
        if dim.is_power_of_two() {
            let signs1 = (0..dim).map(|_| rng.sign()).collect();
            let signs2 = (0..dim).map(|_| rng.sign()).collect();
            return Rotation::Hadamard { signs1, signs2 };
        }
        // Modified Gram-Schmidt on the rows of a Gaussian matrix, in f64: the result is the Q
        // of a QR decomposition with a positive diagonal in R, which is Haar distributed.
        let mut rows: Vec<Vec<f64>> = (0..dim).map(|_| (0..dim).map(|_| rng.gaussian()).collect()).collect();
        for i in 0..dim {
            let (done, rest) = rows.split_at_mut(i);
            let r = &mut rest[0];
            for q in done.iter() {
                let p: f64 = q.iter().zip(r.iter()).map(|(a, b)| a * b).sum();
                r.iter_mut().zip(q).for_each(|(x, y)| *x -= p * y);
            }
            let n = r.iter().map(|x| x * x).sum::<f64>().sqrt();
            r.iter_mut().for_each(|x| *x /= n);
        }
        Rotation::Dense { dim, m: rows.into_iter().flatten().map(|x| x as f32).collect() }
    }

    /// A dense matrix (not a randomized Hadamard transform).
    pub fn is_dense(&self) -> bool {
        matches!(self, Rotation::Dense { .. })
    }

    pub fn dim(&self) -> usize {
        match self {
            Rotation::Hadamard { signs1, .. } => signs1.len(),
            Rotation::Dense { dim, .. } => *dim,
        }
    }

    /// `out = R x`.
    pub fn apply(&self, x: &[f32], out: &mut [f32]) {
        match self {
            Rotation::Hadamard { signs1, signs2 } => {
                let inv = 1.0 / x.len() as f32;
                out.iter_mut().zip(x).zip(signs1).for_each(|((o, a), s)| *o = a * s);
                fwht(out);
                out.iter_mut().zip(signs2).for_each(|(o, s)| *o *= s);
                fwht(out);
                out.iter_mut().for_each(|o| *o *= inv);
            }
            Rotation::Dense { dim, m } => {
                for (o, row) in out.iter_mut().zip(m.chunks_exact(*dim)) {
                    *o = crate::simd::dot_f32(row, x);
                }
            }
        }
    }

    /// `out = R^T x` (the inverse).
    pub fn apply_inverse(&self, x: &[f32], out: &mut [f32]) {
        match self {
            Rotation::Hadamard { signs1, signs2 } => {
                let inv = 1.0 / x.len() as f32;
                out.copy_from_slice(x);
                fwht(out);
                out.iter_mut().zip(signs2).for_each(|(o, s)| *o *= s);
                fwht(out);
                out.iter_mut().zip(signs1).for_each(|(o, s)| *o *= s * inv);
            }
            Rotation::Dense { dim, m } => {
                out.iter_mut().for_each(|o| *o = 0.0);
                for (row, &xi) in m.chunks_exact(*dim).zip(x) {
                    crate::simd::axpy_f32(out, xi, row);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_orthogonal(dim: usize) {
        let r = Rotation::seeded(dim, 42);
        let mut rng = SplitMix64(7);
        let x: Vec<f32> = (0..dim).map(|_| rng.gaussian() as f32).collect();
        let (mut y, mut back) = (vec![0f32; dim], vec![0f32; dim]);
        r.apply(&x, &mut y);
        r.apply_inverse(&y, &mut back);
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        assert!((norm(&x) - norm(&y)).abs() < 1e-4 * norm(&x), "d={dim}: norm not kept");
        let err = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "d={dim}: R^T R x differs from x by {err}");
        assert!(x.iter().zip(&y).any(|(a, b)| (a - b).abs() > 1e-3), "d={dim}: not a rotation at all");
    }

    #[test]
    fn rotations_are_orthogonal_for_every_head_dim() {
        for dim in [16, 32, 64, 80, 96, 128, 256] {
            check_orthogonal(dim);
        }
    }

    #[test]
    fn seeds_name_rotations() {
        let (a, b, c) = (Rotation::seeded(64, 1), Rotation::seeded(64, 1), Rotation::seeded(64, 2));
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.3).sin()).collect();
        let (mut ya, mut yb, mut yc) = (vec![0f32; 64], vec![0f32; 64], vec![0f32; 64]);
        a.apply(&x, &mut ya);
        b.apply(&x, &mut yb);
        c.apply(&x, &mut yc);
        assert_eq!(ya, yb);
        assert_ne!(ya, yc);
    }

    /// Two Hadamard rounds spread a one-hot vector like a Gaussian, not as +-1/sqrt(d).
    #[test]
    fn one_hot_vectors_spread_out() {
        let d = 128;
        let r = Rotation::seeded(d, 3);
        let mut x = vec![0f32; d];
        x[5] = 1.0;
        let mut y = vec![0f32; d];
        r.apply(&x, &mut y);
        let distinct = {
            let mut v: Vec<i64> = y.iter().map(|a| (a.abs() * 1e5).round() as i64).collect();
            v.sort();
            v.dedup();
            v.len()
        };
        assert!(distinct > 4, "coordinates take only {distinct} magnitudes");
    }
}
