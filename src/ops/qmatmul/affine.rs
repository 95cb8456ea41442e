//! MLX affine-quantized matrices (mlx-lm and mlx-vlm conversions).
//!
//! A module quantized by MLX stores `weight` as u32 words, each row one little-endian
//! bitstream of `bits`-bit codes (element j in bits `j·bits .. (j+1)·bits`, low bit first, so
//! 3-, 5- and 6-bit codes cross word boundaries), and per group of `group` consecutive weights
//! of a row a `scale` and a `bias` in the checkpoint's float dtype: `w = scale · q + bias`.
//! Scales may be negative (mlx ≥ 0.30 puts the larger-magnitude edge at code 0).

use candle_core::{Device, Tensor};

/// Bits and group size of one affine-quantized module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffineParams {
    pub bits: u32,
    pub group: usize,
}

impl AffineParams {
    pub const BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
    pub const GROUPS: [usize; 3] = [32, 64, 128];

    /// The parameters a stored module implies: `packed` u32 words and `groups` scales per row
    /// of `cols` weights. None when no valid pair fits.
    pub fn from_shapes(cols: usize, packed: usize, groups: usize) -> Option<Self> {
        if cols == 0 || groups == 0 || cols % groups != 0 || (packed * 32) % cols != 0 {
            return None;
        }
        let p = AffineParams { bits: (packed * 32 / cols) as u32, group: cols / groups };
        p.is_valid().then_some(p)
    }

    pub fn is_valid(self) -> bool {
        Self::BITS.contains(&self.bits) && Self::GROUPS.contains(&self.group)
    }

    /// u32 words per row of `cols` weights.
    pub fn packed_words(self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }
}

/// An affine-quantized `[rows, cols]` matrix (an MoE's stacked experts are `rows = E · out`),
/// its scales and biases widened to f32 (exact).
#[derive(Debug, Clone)]
pub struct AffineMatrix {
    pub rows: usize,
    pub cols: usize,
    pub params: AffineParams,
    /// `rows · params.packed_words(cols)` words, row by row.
    pub codes: Vec<u32>,
    /// `rows · cols / group` each, row by row.
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

impl AffineMatrix {
    fn words_per_row(&self) -> usize {
        self.params.packed_words(self.cols)
    }

    fn groups_per_row(&self) -> usize {
        self.cols / self.params.group
    }

    /// The codes of row `r`, one per weight, by a 64-bit window over the row's bitstream.
    pub fn row_codes(&self, r: usize) -> impl Fn(usize) -> u8 + '_ {
        let wpr = self.words_per_row();
        let row = &self.codes[r * wpr..(r + 1) * wpr];
        let (bits, mask) = (self.params.bits as usize, (1u64 << self.params.bits) - 1);
        move |j: usize| {
            let p = j * bits;
            let w = p / 32;
            let lo = u64::from(row[w]);
            let hi = row.get(w + 1).map_or(0, |&x| u64::from(x));
            (((lo | hi << 32) >> (p % 32)) & mask) as u8
        }
    }

    /// Scale and bias of group `g` of row `r`.
    pub fn group_affine(&self, r: usize, g: usize) -> (f32, f32) {
        let i = r * self.groups_per_row() + g;
        (self.scales[i], self.biases[i])
    }

    /// Row `r` dequantized: `scale · q + bias` in f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let q = self.row_codes(r);
        for (j, o) in out.iter_mut().enumerate().take(self.cols) {
            let (s, b) = self.group_affine(r, j / self.params.group);
            *o = s * f32::from(q(j)) + b;
        }
    }

    /// The whole matrix dequantized, `[rows, cols]` f32 on `device`.
    pub fn dequantize(&self, device: &Device) -> candle_core::Result<Tensor> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, row);
        }
        Tensor::from_vec(out, (self.rows, self.cols), device)
    }

    /// Rows `r0..r1` as a matrix of their own (one expert of a stacked MoE tensor).
    pub fn rows(&self, r0: usize, r1: usize) -> AffineMatrix {
        let (w, g) = (self.words_per_row(), self.groups_per_row());
        AffineMatrix {
            rows: r1 - r0,
            cols: self.cols,
            params: self.params,
            codes: self.codes[r0 * w..r1 * w].to_vec(),
            scales: self.scales[r0 * g..r1 * g].to_vec(),
            biases: self.biases[r0 * g..r1 * g].to_vec(),
        }
    }

    /// Columns `c0..c1` of every row as a matrix of their own (a row-parallel rank's part), when
    /// both lie on group boundaries (a group's codes then fill whole words: groups are at least
    /// 32 weights).
    pub fn columns(&self, c0: usize, c1: usize) -> Option<AffineMatrix> {
        let group = self.params.group;
        if c0 % group != 0 || c1 % group != 0 || c0 >= c1 || c1 > self.cols {
            return None;
        }
        let (w, g) = (self.words_per_row(), self.groups_per_row());
        let (w0, w1) = (self.params.packed_words(c0), self.params.packed_words(c1));
        let (g0, g1) = (c0 / group, c1 / group);
        let (codes, scales, biases) = (Vec::new(), Vec::new(), Vec::new());
        let mut m = AffineMatrix { rows: self.rows, cols: c1 - c0, params: self.params, codes, scales, biases };
        for r in 0..self.rows {
            m.codes.extend_from_slice(&self.codes[r * w + w0..r * w + w1]);
            m.scales.extend_from_slice(&self.scales[r * g + g0..r * g + g1]);
            m.biases.extend_from_slice(&self.biases[r * g + g0..r * g + g1]);
        }
        Some(m)
    }

    /// The rows of `parts` one after another, when all have the same width and parameters.
    pub fn concat_rows(parts: &[&AffineMatrix]) -> Option<AffineMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.cols != first.cols || p.params != first.params) {
            return None;
        }
        let mut m = AffineMatrix {
            rows: 0,
            cols: first.cols,
            params: first.params,
            codes: Vec::new(),
            scales: Vec::new(),
            biases: Vec::new(),
        };
        for p in parts {
            m.rows += p.rows;
            m.codes.extend_from_slice(&p.codes);
            m.scales.extend_from_slice(&p.scales);
            m.biases.extend_from_slice(&p.biases);
        }
        Some(m)
    }

    /// Bytes as stored in the checkpoint, with scales and biases of `scale_bytes` each.
    pub fn stored_bytes(&self, scale_bytes: usize) -> usize {
        4 * self.codes.len() + scale_bytes * (self.scales.len() + self.biases.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs codes the way MLX does (the row a little-endian bitstream), independently of the
    /// reader: bit by bit.
    fn pack(codes: &[u8], bits: u32) -> Vec<u32> {
        let mut words = vec![0u32; codes.len() * bits as usize / 32];
        for (j, &c) in codes.iter().enumerate() {
            for b in 0..bits as usize {
                let p = j * bits as usize + b;
                words[p / 32] |= u32::from(c >> b & 1) << (p % 32);
            }
        }
        words
    }

    #[test]
    fn codes_round_trip_for_every_width_across_word_boundaries() {
        for bits in AffineParams::BITS {
            for cols in [32usize, 96, 160] {
                let codes: Vec<u8> = (0..2 * cols).map(|i| ((i * 7 + i / 3) % (1 << bits)) as u8).collect();
                let m = AffineMatrix {
                    rows: 2,
                    cols,
                    params: AffineParams { bits, group: 32 },
                    codes: pack(&codes, bits),
                    scales: vec![1.0; 2 * cols / 32],
                    biases: vec![0.0; 2 * cols / 32],
                };
                for r in 0..2 {
                    let q = m.row_codes(r);
                    for j in 0..cols {
                        assert_eq!(q(j), codes[r * cols + j], "bits {bits} cols {cols} ({r},{j})");
                    }
                }
            }
        }
    }

    /// A run of whole groups taken out of every row dequantizes to the same columns of the
    /// whole matrix, for every width (3-, 5- and 6-bit groups end on word boundaries too);
    /// cuts inside a group are refused.
    #[test]
    fn columns_on_group_boundaries_are_the_matrix_columns() {
        for bits in AffineParams::BITS {
            let (rows, cols) = (3, 128);
            let codes: Vec<u8> = (0..rows * cols).map(|i| ((i * 5 + i / 7) % (1 << bits)) as u8).collect();
            let groups = rows * cols / 32;
            let m = AffineMatrix {
                rows,
                cols,
                params: AffineParams { bits, group: 32 },
                codes: pack(&codes, bits),
                scales: (0..groups).map(|g| 0.5 + g as f32).collect(),
                biases: (0..groups).map(|g| -(g as f32)).collect(),
            };
            let whole = m.dequantize(&Device::Cpu).unwrap();
            let part = m.columns(32, 96).unwrap().dequantize(&Device::Cpu).unwrap();
            let want = whole.narrow(1, 32, 64).unwrap();
            assert_eq!(part.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap(), "bits {bits}");
            assert!(m.columns(16, 80).is_none() && m.columns(32, 80).is_none() && m.columns(64, 160).is_none());
        }
    }

    #[test]
    fn parameters_follow_from_the_shapes() {
        assert_eq!(AffineParams::from_shapes(256, 32, 4), Some(AffineParams { bits: 4, group: 64 }));
        assert_eq!(AffineParams::from_shapes(96, 9, 3), Some(AffineParams { bits: 3, group: 32 }));
        assert_eq!(AffineParams::from_shapes(128, 24, 1), Some(AffineParams { bits: 6, group: 128 }));
        // 7 bits and group 16 are not MLX affine formats.
        assert_eq!(AffineParams::from_shapes(64, 14, 2), None);
        assert_eq!(AffineParams::from_shapes(64, 8, 4), None);
    }
}
