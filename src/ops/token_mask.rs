//! Which tokens each row of logits may take (a grammar's mask, `engine::grammar::RowMasks`),
//! applied where the logits are: on the host before sampling, or on the device before the
//! device draws, so that a constrained row's whole-vocabulary logits never cross to the host.
//!
//! A mask is one bit per token (bit `t % 32` of word `t / 32`, set: allowed), as llguidance
//! keeps it; a disallowed logit becomes -inf, which the samplers read as "never drawn"
//! (`ops::argmax`, `ops::sample`: only finite logits count).

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::kv_elem::f32_slice;

/// Sets every logit of `logits` whose bit in `bits` is clear (or lies past `bits`) to -inf.
pub fn mask_row(bits: &[u32], logits: &mut [f32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let word = bits.get(w).copied().unwrap_or(0);
        if word == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if word & (1 << b) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// The masks of a batch's rows, packed for one upload: `table[r]` is row r's index among the
/// masks (`UNMASKED`: any token), then the masks, `words` u32s each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenMasks {
    index: Vec<u32>,
    masks: Vec<u32>,
    words: usize,
}

/// A row that may take any token.
const UNMASKED: u32 = u32::MAX;

impl TokenMasks {
    /// No rows yet, for a vocabulary of `vocab` tokens.
    pub fn new(vocab: usize) -> Self {
        TokenMasks { index: Vec::new(), masks: Vec::new(), words: vocab.div_ceil(32) }
    }

    /// Words of one mask (`vocab / 32`, rounded up).
    pub fn words(&self) -> usize {
        self.words
    }

    /// Appends the next row: `bits` (at most `words()` used; missing words forbid their
    /// tokens), or None for a row that may take any token.
    pub fn push(&mut self, bits: Option<&[u32]>) {
        match bits {
            None => self.index.push(UNMASKED),
            Some(bits) => {
                self.index.push((self.masks.len() / self.words) as u32);
                let n = bits.len().min(self.words);
                self.masks.extend_from_slice(&bits[..n]);
                self.masks.resize(self.masks.len() + self.words - n, 0);
            }
        }
    }

    /// Whether some row is masked.
    pub fn any(&self) -> bool {
        !self.masks.is_empty()
    }

    /// `logits` (`[rows, vocab]` f32, one row per pushed row) with each row's mask applied, on
    /// the logits' device.
    pub fn apply(&self, logits: &Tensor) -> Result<Tensor> {
        let table: Vec<u32> = self.index.iter().chain(&self.masks).copied().collect();
        let table = Tensor::from_vec(table, self.index.len() + self.masks.len(), logits.device())?;
        logits.apply_op2_no_bwd(&table, &MaskLogits { rows: self.index.len(), words: self.words })
    }
}

/// `[rows, vocab]` f32 logits and a `TokenMasks` table -> the logits, masked.
struct MaskLogits {
    rows: usize,
    words: usize,
}

impl MaskLogits {
    fn check(&self, l: &Layout, tl: &Layout) -> Result<(usize, usize)> {
        let (rows, vocab) = l.shape().dims2()?;
        let table = tl.shape().dims1()?;
        let masks = table.checked_sub(rows).filter(|m| m % self.words.max(1) == 0);
        if rows != self.rows || vocab.div_ceil(32) != self.words || masks.is_none() {
            candle_core::bail!(
                "mask_logits: {rows} x {vocab} logits against masks of {} rows, {} words",
                self.rows,
                self.words
            )
        }
        Ok((rows, vocab))
    }
}

impl CustomOp2 for MaskLogits {
    fn name(&self) -> &'static str {
        "mask_logits"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, ts: &CpuStorage, tl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = self.check(l, tl)?;
        let x = f32_slice(s, l, "mask_logits")?;
        let (CpuStorage::U32(table), Some((a, b))) = (ts, tl.contiguous_offsets()) else {
            candle_core::bail!("mask_logits: expected a contiguous u32 table")
        };
        let table = &table[a..b];
        let mut out = x.to_vec();
        for (r, row) in out.chunks_mut(vocab.max(1)).enumerate().take(rows) {
            if table[r] != UNMASKED {
                let at = rows + table[r] as usize * self.words;
                mask_row(&table[at..at + self.words], row);
            }
        }
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};

        let (rows, vocab) = self.check(l, tl)?;
        let (S::F32(x), Some((a, b)), S::U32(t), Some((ta, tb))) =
            (&s.slice, l.contiguous_offsets(), &ts.slice, tl.contiguous_offsets())
        else {
            candle_core::bail!("mask_logits: expected contiguous f32 logits and a u32 table")
        };
        let dev = s.device().clone();
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<f32>(rows * vocab)? };
        if rows > 0 && vocab > 0 {
            let func = super::cuda::SAMPLING.func(&dev, "mask_logits_f32")?;
            let blocks = vocab.div_ceil(1024).min(64) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, rows as u32, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            let (x, t) = (x.slice(a..b), t.slice(ta..tb));
            let (rows, vocab, words) = (rows as i32, vocab as i32, self.words as i32);
            let mut builder = func.builder();
            builder.arg(&x).arg(&t).arg(&out).arg(&rows).arg(&vocab).arg(&words);
            // SAFETY: argument types and counts match the kernel's signature.
            unsafe { builder.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn rows_take_their_own_mask_or_none() {
        let vocab = 70; // three words, the last partly used
        let mut masks = TokenMasks::new(vocab);
        let allow = |ids: &[usize]| {
            let mut bits = vec![0u32; 3];
            for &t in ids {
                bits[t / 32] |= 1 << (t % 32);
            }
            bits
        };
        masks.push(Some(&allow(&[0, 33, 69])));
        masks.push(None);
        masks.push(Some(&allow(&[5])[..1])); // a short mask forbids the words it lacks
        let x: Vec<f32> = (0..3 * vocab).map(|i| i as f32 * 0.25 - 7.0).collect();
        let logits = Tensor::from_vec(x.clone(), (3, vocab), &Device::Cpu).unwrap();
        let got = masks.apply(&logits).unwrap().to_vec2::<f32>().unwrap();
        for (t, &l) in got[0].iter().enumerate() {
            let want = if [0, 33, 69].contains(&t) { x[t] } else { f32::NEG_INFINITY };
            assert_eq!(l.to_bits(), want.to_bits(), "row 0, token {t}");
        }
        assert_eq!(got[1], x[vocab..2 * vocab]);
        for (t, &l) in got[2].iter().enumerate() {
            let want = if t == 5 { x[2 * vocab + t] } else { f32::NEG_INFINITY };
            assert_eq!(l.to_bits(), want.to_bits(), "row 2, token {t}");
        }
    }

    #[test]
    fn masks_of_the_wrong_shape_are_refused() {
        let mut masks = TokenMasks::new(64);
        masks.push(None);
        let logits = Tensor::zeros((2, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(masks.apply(&logits).is_err(), "two rows of logits, one row of masks");
        let logits = Tensor::zeros((1, 96), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(masks.apply(&logits).is_err(), "a vocabulary the masks were not made for");
    }
}
