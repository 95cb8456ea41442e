//! GGUF weights regrouped per row into 32-element blocks for the fused kernels: first the
//! per-block 32-bit words (scales as f32, then any other per-block word), then the codes.
//!
//! In the file's layout each block starts with f16 scales between the codes; converting them
//! and broadcasting them costs more than decoding the codes. Stored as f32 (an exact widening)
//! in their own arrays, each block's scale is one broadcast load. That is 4 more bytes per
//! Q4_1 block, yet measured faster even where the weights stream from DRAM (Q4_1, one
//! thread, cycles per block: 4.1 vs 5.6 in the file's layout from L2, 10.5 vs 13.8 on a 70 MB
//! matrix); keeping f16 scales in the side arrays and widening 16 at a time was in between.
//!
//! The k-quants (256-weight super-blocks with 6-bit sub-block scales) are repacked into the
//! same 32-weight forms. Each sub-block's scale and minimum are multiplied out once here, as
//! the scalar dequantizer multiplies them (`d * sc`, `dmin * m`, f32), so a weight comes out
//! of the kernels with the dequantizer's bits: Q4_K's `d1 * q - m1` is Q4_1's `q * d + m` with
//! `m = -m1` (negation is exact), Q5_K likewise Q5_1's, and Q6_K's and Q3_K's
//! `(d * sc) * q` for small signed `q` is `Q6`'s and `Q3`'s.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::affine::AffineMatrix;

/// The packed block formats, each with a fused kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    Q4_0,
    /// `q * d + m`, q in 0..16 (Q4_1, Q4_K).
    Q4_1,
    Q5_0,
    /// `q * d + m`, q in 0..32 (Q5_1, Q5_K).
    Q5_1,
    Q8_0,
    /// `(q - 32) * s`, q in 0..64, a scale per 16 weights (Q6_K). Words: the two scales, then
    /// the two high bits of each code, weights 0..16 and 16..32 in a word each.
    Q6,
    /// `(q - 4) * s`, q in 0..8, a scale per 16 weights (Q3_K), no code bytes. Words: the two
    /// scales, the low two bits of each code as Q6's high bits, then the third bits, bit i
    /// for weight i.
    Q3,
    /// `q * d + m`, q in 0..256, a byte per code (MLX affine 6- and 8-bit).
    A8,
}

impl BlockFormat {
    /// The packed format for weights stored as `dt` in a GGUF file, if any.
    pub fn for_ggml(dt: GgmlDType) -> Option<Self> {
        Some(match dt {
            GgmlDType::Q4_0 => BlockFormat::Q4_0,
            GgmlDType::Q4_1 | GgmlDType::Q4K => BlockFormat::Q4_1,
            GgmlDType::Q5_0 => BlockFormat::Q5_0,
            GgmlDType::Q5_1 | GgmlDType::Q5K => BlockFormat::Q5_1,
            GgmlDType::Q8_0 => BlockFormat::Q8_0,
            GgmlDType::Q6K => BlockFormat::Q6,
            GgmlDType::Q3K => BlockFormat::Q3,
            _ => return None,
        })
    }

    /// 32-bit words before the codes, per block.
    pub const fn words(self) -> usize {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q8_0 => 1,
            BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::A8 => 2,
            BlockFormat::Q5_1 => 3,
            BlockFormat::Q6 => 4,
            BlockFormat::Q3 => 5,
        }
    }

    /// Code bytes per block.
    pub const fn code_bytes(self) -> usize {
        match self {
            BlockFormat::Q8_0 | BlockFormat::A8 => 32,
            BlockFormat::Q3 => 0,
            _ => 16,
        }
    }

    /// Bytes of one block once packed.
    pub const fn packed_bytes(self) -> usize {
        4 * self.words() + self.code_bytes()
    }
}

/// A `[rows, cols]` matrix of one block format, packed row by row.
pub struct PackedRows {
    pub format: BlockFormat,
    pub row_bytes: usize,
    data: Vec<u8>,
}

/// One packed 32-weight block on its way into a row.
#[derive(Default)]
struct Block {
    words: [u32; 5],
    codes: [u8; 32],
}

impl Block {
    /// Codes as 4-bit pairs: byte i holds weight i (low nibble) and weight 16 + i (high).
    fn nibbles(&mut self, q: impl Fn(usize) -> u8) {
        for i in 0..16 {
            self.codes[i] = (q(i) & 15) | (q(16 + i) & 15) << 4;
        }
    }

    /// Bit `at` of 32 codes, bit i for weight i (Q5_0's and Q5_1's fifth bits).
    fn bits(at: u32, q: impl Fn(usize) -> u8) -> u32 {
        (0..32).map(|i| u32::from(q(i) >> at & 1) << i).sum()
    }

    /// Bits `at` and `at + 1` of 32 codes, two per weight: weights 0..16 in the first word,
    /// 16..32 in the second.
    fn pairs(at: u32, q: impl Fn(usize) -> u8) -> [u32; 2] {
        [0, 16].map(|base| (0..16).map(|i| u32::from(q(base + i) >> at & 3) << (2 * i)).sum())
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block `j` (0..8) from their 12 bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    };
    (f32::from(sc), f32::from(m))
}

/// Q3_K's sixteen 6-bit scales (stored offset by 32) from their 12 bytes.
fn scales_q3k(s: &[u8]) -> [f32; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        f32::from(low | high << 4) - 32.0
    })
}

/// Calls `out` with the packed 32-weight blocks of one source block of `dt` (32 or 256
/// weights, in order).
fn unpack(dt: GgmlDType, src: &[u8], mut out: impl FnMut(Block)) {
    let f = |x: f32| x.to_bits();
    match dt {
        GgmlDType::Q4_0 | GgmlDType::Q8_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 => {
            let mut b = Block::default();
            b.words[0] = f(half(src, 0));
            let codes = match dt {
                GgmlDType::Q4_0 | GgmlDType::Q8_0 => 2,
                GgmlDType::Q4_1 => {
                    b.words[1] = f(half(src, 2));
                    4
                }
                GgmlDType::Q5_0 => {
                    b.words[1] = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
                    6
                }
                _ => {
                    b.words[1] = f(half(src, 2));
                    b.words[2] = u32::from_le_bytes([src[4], src[5], src[6], src[7]]);
                    8
                }
            };
            let n = if dt == GgmlDType::Q8_0 { 32 } else { 16 };
            b.codes[..n].copy_from_slice(&src[codes..codes + n]);
            out(b)
        }
        GgmlDType::Q4K | GgmlDType::Q5K => {
            // d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of fifth bits,) then the low
            // nibbles: 32 bytes per 64 weights, sub-block 2c in the low and 2c + 1 in the
            // high nibbles of chunk c.
            let (d, dmin, scales) = (half(src, 0), half(src, 2), &src[4..16]);
            let (qh, qs) =
                if dt == GgmlDType::Q5K { (Some(&src[16..48]), &src[48..176]) } else { (None, &src[16..144]) };
            for s in 0..8 {
                let (sc, m) = scale_min_k4(s, scales);
                let q = |i: usize| {
                    let low = qs[32 * (s / 2) + i] >> (4 * (s % 2)) & 15;
                    low | qh.map_or(0, |h| (h[i] >> s & 1) << 4)
                };
                let mut b = Block::default();
                b.words[0] = f(d * sc);
                b.words[1] = f(-(dmin * m));
                if qh.is_some() {
                    b.words[2] = Block::bits(4, q);
                }
                b.nibbles(q);
                out(b)
            }
        }
        GgmlDType::Q6K => {
            // 128 bytes of low nibbles, 64 of high pairs, 16 scales (i8), d. Weight
            // e = 128 n + 32 t + l takes nibble t / 2 of ql[64 n + 32 (t % 2) + l] and bits
            // 2t.. of qh[32 n + l]; its scale is the (e / 16)-th.
            let (ql, qh, sc, d) = (&src[..128], &src[128..192], &src[192..208], half(src, 208));
            for blk in 0..8 {
                let q = |i: usize| {
                    let (n, t, l) = (blk / 4, blk % 4, i);
                    let low = ql[64 * n + 32 * (t % 2) + l] >> (4 * (t / 2)) & 15;
                    low | (qh[32 * n + l] >> (2 * t) & 3) << 4
                };
                emit_q6(d * f32::from(sc[2 * blk] as i8), d * f32::from(sc[2 * blk + 1] as i8), q, &mut out);
            }
        }
        GgmlDType::Q3K => {
            // 32 bytes of high bits, 64 of 2-bit codes, 12 of scales, d. Weight
            // e = 128 n + 32 j + p takes bits 2j.. of qs[32 n + p], and loses 4 unless bit
            // 4n + j of hmask[p] is set.
            let (hmask, qs, scales, d) = (&src[..32], &src[32..96], scales_q3k(&src[96..108]), half(src, 108));
            for blk in 0..8 {
                // The value is v - 4 + 4 * keep: code v | keep << 2, offset 4.
                let q = |p: usize| {
                    let (n, j) = (blk / 4, blk % 4);
                    (qs[32 * n + p] >> (2 * j) & 3) | (hmask[p] >> (4 * n + j) & 1) << 2
                };
                let [l0, l1] = Block::pairs(0, q);
                let (s0, s1) = (d * scales[2 * blk], d * scales[2 * blk + 1]);
                out(Block { words: [s0.to_bits(), s1.to_bits(), l0, l1, Block::bits(2, q)], codes: [0; 32] })
            }
        }
        _ => unreachable!("{dt:?} has no packed format (BlockFormat::for_ggml)"),
    }
}

/// A `Q6` block of codes `q` with the scales of its two halves.
fn emit_q6(s0: f32, s1: f32, q: impl Fn(usize) -> u8, out: &mut impl FnMut(Block)) {
    let mut b = Block::default();
    let [h0, h1] = Block::pairs(4, &q);
    b.words = [s0.to_bits(), s1.to_bits(), h0, h1, 0];
    b.nibbles(q);
    out(b)
}

impl PackedRows {
    /// Repacks `ggml`, whole rows of `cols` weights of `dt` in the file's layout, into
    /// `format` (`BlockFormat::for_ggml(dt)`).
    pub fn from_ggml(dt: GgmlDType, format: BlockFormat, ggml: &[u8], rows: usize, cols: usize) -> Self {
        debug_assert_eq!(BlockFormat::for_ggml(dt), Some(format));
        let nb = cols / 32;
        let row_bytes = nb * format.packed_bytes();
        let src_row = cols / dt.block_size() * dt.type_size();
        let mut packed = PackedRows { format, row_bytes, data: crate::ops::host_memory::zeroed(rows * row_bytes) };
        for (r, src) in ggml.chunks_exact(src_row).enumerate() {
            let mut b = 0;
            for blk in src.chunks_exact(dt.type_size()) {
                unpack(dt, blk, |block| {
                    packed.put(r, b, nb, &block);
                    b += 1;
                });
            }
        }
        packed
    }

    /// Repacks an MLX affine matrix: 2- to 4-bit codes as Q4_1's nibbles, 5-bit as Q5_1's,
    /// 6- and 8-bit as A8's bytes, each 32-weight block with its group's scale and bias, so
    /// each weight is `q * scale + bias` as MLX computes it.
    pub fn from_affine(m: &AffineMatrix) -> Self {
        let format = match m.params.bits {
            2..=4 => BlockFormat::Q4_1,
            5 => BlockFormat::Q5_1,
            _ => BlockFormat::A8,
        };
        let nb = m.cols / 32;
        let row_bytes = nb * format.packed_bytes();
        let mut packed = PackedRows { format, row_bytes, data: crate::ops::host_memory::zeroed(m.rows * row_bytes) };
        for r in 0..m.rows {
            let codes = m.row_codes(r);
            for b in 0..nb {
                let q = |i: usize| codes(32 * b + i);
                let (scale, bias) = m.group_affine(r, 32 * b / m.params.group);
                let mut block = Block::default();
                block.words[0] = scale.to_bits();
                block.words[1] = bias.to_bits();
                match format {
                    BlockFormat::A8 => block.codes = std::array::from_fn(q),
                    BlockFormat::Q5_1 => {
                        block.words[2] = Block::bits(4, q);
                        block.nibbles(q);
                    }
                    _ => block.nibbles(q),
                }
                packed.put(r, b, nb, &block);
            }
        }
        packed
    }

    /// Writes `block` as block `b` of row `r` (`nb` blocks per row).
    fn put(&mut self, r: usize, b: usize, nb: usize, block: &Block) {
        let (words, code_bytes) = (self.format.words(), self.format.code_bytes());
        let row = &mut self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
        let (heads, codes) = row.split_at_mut(4 * words * nb);
        for (w, word) in block.words[..words].iter().enumerate() {
            heads[4 * (w * nb + b)..4 * (w * nb + b) + 4].copy_from_slice(&word.to_le_bytes());
        }
        codes[b * code_bytes..(b + 1) * code_bytes].copy_from_slice(&block.codes[..code_bytes]);
    }

    pub fn data(&self) -> &[u8] {
        &self.data
    }
}
