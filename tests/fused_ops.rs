//! The CPU references of the fused GPU ops (ops/qkv_rope.rs, gated_act.rs, add_rms_norm.rs,
//! argmax.rs) against the op-by-op computation the layers do on the CPU, so that
//! tests/cuda_ops.rs, which compares each CUDA kernel with its reference, checks the real thing.

use candle_core::{DType, Device, Tensor};
use iris::ops::add_rms_norm::AddRmsNorm;
use iris::ops::argmax::Argmax;
use iris::ops::gated_act::GatedAct;
use iris::ops::qkv_rope::QkvRope;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.flatten_all().unwrap(), b.flatten_all().unwrap());
    let diff = (&a - &b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    diff / b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap().max(1e-12)
}

#[test]
fn qkv_rope_reference_is_the_layer_path() {
    let mut rng = StdRng::seed_from_u64(4);
    for (hq, hkv, d, bias, norm, interleaved) in
        [(28, 4, 128, true, false, false), (8, 2, 80, false, true, true), (4, 1, 32, true, true, false)]
    {
        let (t, half, eps) = (9, d / 2, 1e-6);
        let w = (hq + 2 * hkv) * d;
        let (y, b) = (random(&mut rng, &[t, w]), random(&mut rng, &[w]));
        let (cos, sin) = (random(&mut rng, &[t, 1, half]), random(&mut rng, &[t, 1, half]));
        let (qn, kn) = (random(&mut rng, &[d]), random(&mut rng, &[d]));
        let got = QkvRope {
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            bias: bias.then_some(&b),
            cos: &cos,
            sin: &sin,
            qk_norm: norm.then_some((&qn, &kn, eps)),
            interleaved,
        }
        .forward(&y)
        .unwrap();
        // As layers/attention.rs computes it op by op.
        let yb = if bias { y.broadcast_add(&b).unwrap() } else { y.clone() };
        let head = |from: usize, n: usize| {
            yb.narrow(1, from * d, n * d).unwrap().contiguous().unwrap().reshape((t, n, d)).unwrap()
        };
        let rope = |x: &Tensor, nw: &Tensor| {
            let x = if norm { candle_nn::ops::rms_norm(x, nw, eps).unwrap() } else { x.clone() };
            let x4 = x.reshape((t, x.dim(1).unwrap(), 1, d)).unwrap();
            let r = if interleaved {
                candle_nn::rotary_emb::rope_i(&x4, &cos, &sin)
            } else {
                candle_nn::rotary_emb::rope(&x4, &cos, &sin)
            };
            r.unwrap().reshape(x.dims()).unwrap()
        };
        let want = [rope(&head(0, hq), &qn), rope(&head(hq, hkv), &kn), head(hq + hkv, hkv)];
        for (name, (got, want)) in ["q", "k", "v"].iter().zip([&got.0, &got.1, &got.2].into_iter().zip(&want)) {
            let e = max_rel_err(got, want);
            assert!(e <= 1e-5, "{name} ({hq}x{hkv}x{d}): rel err {e}");
        }
    }
}

#[test]
fn gated_act_reference_is_act_times_up() {
    let mut rng = StdRng::seed_from_u64(5);
    let y = random(&mut rng, &[7, 2 * 48]);
    let (g, up) = (y.narrow(1, 0, 48).unwrap(), y.narrow(1, 48, 48).unwrap());
    let silu = (candle_nn::ops::silu(&g).unwrap() * &up).unwrap();
    assert!(max_rel_err(&GatedAct { gelu: false, interleaved: false }.forward(&y).unwrap(), &silu) <= 1e-6);
    let gelu = (g.gelu().unwrap() * &up).unwrap();
    assert!(max_rel_err(&GatedAct { gelu: true, interleaved: false }.forward(&y).unwrap(), &gelu) <= 1e-5);
    // The same columns as (gate i, up i) pairs give the same result.
    let pairs = Tensor::stack(&[&g, &up], 2).unwrap().reshape((7, 2 * 48)).unwrap();
    assert!(max_rel_err(&GatedAct { gelu: false, interleaved: true }.forward(&pairs).unwrap(), &silu) <= 1e-6);
}

#[test]
fn add_rms_norm_reference_is_add_then_norm() {
    let mut rng = StdRng::seed_from_u64(6);
    let (x, delta, w) = (random(&mut rng, &[5, 96]), random(&mut rng, &[5, 96]), random(&mut rng, &[96]));
    let (h, y) = AddRmsNorm { eps: 1e-6 }.forward(&x, &delta, &w).unwrap();
    let h2 = (&x + &delta).unwrap();
    assert!(max_rel_err(&h, &h2) <= 1e-6);
    assert!(max_rel_err(&y, &candle_nn::ops::rms_norm(&h2, &w, 1e-6).unwrap()) <= 1e-5);
}

#[test]
fn argmax_takes_the_lowest_id_among_ties_and_skips_non_finite() {
    let l = Tensor::new(
        &[[1.0f32, 3.0, 3.0, 2.0], [f32::NAN, f32::INFINITY, -1.0, -2.0], [f32::NEG_INFINITY; 4]],
        &Device::Cpu,
    )
    .unwrap();
    let ids: Vec<u32> = Argmax::forward(&l).unwrap().to_vec1().unwrap();
    assert_eq!(ids, [1, 2, 0]);
    assert_eq!(Argmax::forward(&l.to_dtype(DType::F32).unwrap()).unwrap().dims(), [3]);
}
