//! Helpers for the tests of CUDA kernels against their CPU ops (tests/cuda_*.rs).

use candle_core::{DType, Device, Tensor};
use iris::batch::{AttentionMeta, SeqSlice};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

pub fn gpu() -> Option<Device> {
    match iris::device::open("cuda") {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("IRIS_REQUIRE_GPU").is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

pub fn random(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Sequences `(context_len, q_len)` over blocks handed out in shuffled order.
pub fn meta(rng: &mut StdRng, seqs: &[(usize, usize)], block_size: usize) -> (AttentionMeta, usize) {
    let n_blocks = seqs.iter().map(|s| s.0.div_ceil(block_size)).sum::<usize>() + 3;
    let mut free: Vec<u32> = (0..n_blocks as u32).collect();
    free.shuffle(rng);
    let mut q_start = 0;
    let slices = seqs
        .iter()
        .map(|&(context_len, q_len)| {
            let table = free.split_off(free.len() - context_len.div_ceil(block_size));
            let s = SeqSlice { q_start, q_len, context_len, block_table: table };
            q_start += q_len;
            s
        })
        .collect();
    (AttentionMeta::new(block_size, slices), n_blocks * block_size)
}

pub fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let diff = (&a - &b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(diff.is_finite(), "non-finite output");
    diff / scale.max(1e-12)
}

/// Random inputs of the fused q/k/v projection split (`QkvRope`) for `t` rows, in `dt` on `dev`.
pub struct QkvInputs {
    pub y: Tensor,
    pub bias: Tensor,
    pub cos: Tensor,
    pub sin: Tensor,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
}

impl QkvInputs {
    pub fn random(rng: &mut StdRng, dev: &Device, dt: DType, t: usize, (hq, hkv, d): (usize, usize, usize)) -> Self {
        let mut g = |shape: &[usize]| random(rng, shape).to_dtype(dt).unwrap().to_device(dev).unwrap();
        let w = (hq + 2 * hkv) * d;
        QkvInputs {
            y: g(&[t, w]),
            bias: g(&[w]),
            cos: g(&[t, d / 2]),
            sin: g(&[t, d / 2]),
            q_norm: g(&[d]),
            k_norm: g(&[d]),
        }
    }

    /// The op over these inputs (with the bias; with the q/k norms when `norm`).
    pub fn op(
        &self,
        (hq, hkv, d): (usize, usize, usize),
        norm: bool,
        interleaved: bool,
    ) -> iris::ops::qkv_rope::QkvRope<'_> {
        iris::ops::qkv_rope::QkvRope {
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            bias: Some(&self.bias),
            cos: &self.cos,
            sin: &self.sin,
            qk_norm: norm.then_some((&self.q_norm, &self.k_norm, 1e-6)),
            interleaved,
        }
    }
}

/// Every decode row (q_len 1) of the step `m` (uploaded to `dev`) gets the same bits from
/// `attend` alone as within the step: `attend(meta, q)` runs an attention op over a step's
/// metadata and queries.
pub fn assert_decodes_batch_invariant(
    dev: &Device,
    m: &AttentionMeta,
    q: &Tensor,
    attend: impl Fn(&AttentionMeta, &Tensor) -> Tensor,
) {
    assert_batch_invariant(dev, m, q, |s| s.q_len == 1, attend);
}

/// Each sequence of `m` that `which` picks, attended alone, gives the bits it gives within `m`.
pub fn assert_batch_invariant(
    dev: &Device,
    m: &AttentionMeta,
    q: &Tensor,
    which: impl Fn(&SeqSlice) -> bool,
    attend: impl Fn(&AttentionMeta, &Tensor) -> Tensor,
) {
    let mixed = attend(m, q);
    for s in m.seqs.iter().filter(|s| which(s)) {
        let solo =
            SeqSlice { q_start: 0, q_len: s.q_len, context_len: s.context_len, block_table: s.block_table.clone() };
        let mut one = AttentionMeta::new(m.block_size, vec![solo]);
        one.upload(dev).unwrap();
        let alone = attend(&one, &q.narrow(0, s.q_start, s.q_len).unwrap());
        let e = max_rel_err(&alone, &mixed.narrow(0, s.q_start, s.q_len).unwrap());
        assert_eq!(e, 0.0, "{} rows over a context of {}: alone differs from within the batch", s.q_len, s.context_len);
    }
}
