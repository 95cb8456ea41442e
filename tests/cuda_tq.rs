//! The TurboQuant kernels (write, attention on codes) against their CPU ops. Compiled only with `--features cuda`;
//! run on a GPU machine by scripts/gpu-check.sh (IRIS_REQUIRE_GPU=1 turns a missing GPU into a
//! failure instead of a skip).
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::cuda::{gpu, max_rel_err, meta, random};
use iris::ops::paged_attention::PagedAttention;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A layer's TurboQuant codecs for head dim `d` (rotations seeded by the layer, as served),
/// with key scales (positive, unequal per channel) when `scaled`.
fn tq_codecs(d: usize, hkv: usize, bits: (u8, u8), scaled: bool) -> iris::ops::turboquant::LayerCodecs {
    use iris::ops::turboquant::{Codebook, LayerCodecs};
    use std::sync::Arc;
    let cb = |b| Arc::new(Codebook::lloyd_max(d, b));
    let mut c = LayerCodecs::for_layer(5, d, &cb(bits.0), &cb(bits.1));
    if scaled {
        c.key_scale = Some((0..hkv * d).map(|i| 0.4 + (i as f32 * 0.61).sin().abs() * 1.7).collect());
    }
    c
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// The write kernel stores the CPU codec's exact bytes (codes and f32 norm) for power-of-two
/// head dims (randomized Hadamard rotations): keys with key scales and values, 2-4 bits, f32
/// and bf16 inputs, rows of several sequences in shuffled blocks, padding rows (NO_SLOT)
/// skipped. Every other slot keeps its (random) bytes. Dense rotations (d = 80, 96) sum their
/// products in another order than the CPU's vectorised dot product: there the norms must be
/// identical and a code may differ by one cell only, in at most 1 in 1,000 coordinates.
#[test]
fn tq_write_matches_cpu_codes() {
    use iris::batch::{DeviceAttentionMeta, NO_SLOT};
    use iris::ops::tq_write::{TqWrite, TqWriteDevice};
    use iris::ops::turboquant::pack::code_at;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    let hkv = 3;
    let mut cases = Vec::new();
    for d in [64, 128, 256] {
        for kb in 2..=4u8 {
            for vb in 2..=4u8 {
                cases.push((d, (kb, vb), DType::F32));
            }
        }
    }
    cases.extend([
        (128, (3, 4), DType::BF16),
        (256, (4, 2), DType::F16),
        (80, (3, 4), DType::F32),
        (96, (4, 3), DType::F32),
    ]);
    for (d, bits, new_dt) in cases {
        let codecs = tq_codecs(d, hkv, bits, true);
        let on_gpu = codecs.upload(&dev).unwrap();
        let (m, n_slots) = meta(&mut rng, &[(40, 40), (300, 1), (17, 5), (1, 1)], 16);
        // Every third row is padding on the GPU; the CPU op writes only the others.
        let gpu_slots: Vec<u32> =
            m.slot_mapping.iter().enumerate().map(|(i, &s)| if i % 3 == 1 { NO_SLOT } else { s }).collect();
        let kept: Vec<usize> = (0..gpu_slots.len()).filter(|&i| gpu_slots[i] != NO_SLOT).collect();
        let cpu_slots: Vec<u32> = kept.iter().map(|&i| gpu_slots[i]).collect();
        let dm = DeviceAttentionMeta::slots(&gpu_slots, &dev).unwrap();
        // Inputs of varied size (norms from ~0.1 to ~100) in the input type.
        let new = random(&mut rng, &[gpu_slots.len(), hkv, d]);
        let sizes: Vec<f32> = (0..gpu_slots.len()).map(|i| 0.1 * 10f32.powf((i % 4) as f32)).collect();
        let new = new.broadcast_mul(&Tensor::from_vec(sizes, (gpu_slots.len(), 1, 1), &Device::Cpu).unwrap()).unwrap();
        let new = new.to_dtype(new_dt).unwrap();
        let cpu_new = new
            .to_dtype(DType::F32)
            .unwrap()
            .index_select(
                &Tensor::new(kept.iter().map(|&i| i as u32).collect::<Vec<_>>().as_slice(), &Device::Cpu).unwrap(),
                0,
            )
            .unwrap();
        for (name, codec, scale, table, dscale) in [
            ("keys", &codecs.key, codecs.key_scale.as_deref(), &on_gpu.key, on_gpu.key_scale.as_ref()),
            ("values", &codecs.value, None, &on_gpu.value, None),
        ] {
            let row = codec.row_bytes();
            let init: Vec<u8> = (0..n_slots * hkv * row).map(|_| rng.random()).collect();
            let cpu = Tensor::from_vec(init.clone(), (n_slots, hkv, row), &Device::Cpu).unwrap();
            cpu.inplace_op2(&cpu_new, &TqWrite { slot_mapping: &cpu_slots, codec, scale, device: None }).unwrap();
            let gpu = Tensor::from_vec(init, (n_slots, hkv, row), &dev).unwrap();
            let device = Some(TqWriteDevice { meta: &dm, table, scale: dscale });
            gpu.inplace_op2(&new.to_device(&dev).unwrap(), &TqWrite { slot_mapping: &gpu_slots, codec, scale, device })
                .unwrap();
            let (want, got) = (bytes(&cpu), bytes(&gpu));
            let what = format!("tq-write {name} d={d} bits={bits:?} input {new_dt:?}");
            if d.is_power_of_two() {
                let differ: Vec<usize> = (0..want.len()).filter(|&i| want[i] != got[i]).collect();
                assert!(
                    differ.is_empty(),
                    "{what}: {} of {} bytes differ, first at slot {} head {} byte {} (cpu {} gpu {})",
                    differ.len(),
                    want.len(),
                    differ[0] / (hkv * row),
                    differ[0] / row % hkv,
                    differ[0] % row,
                    want[differ[0]],
                    got[differ[0]]
                );
                continue;
            }
            let (cb, b) = (codec.code_bytes(), codec.bits());
            let mut flipped = 0;
            for (w, g) in want.chunks_exact(row).zip(got.chunks_exact(row)) {
                assert_eq!(w[cb..], g[cb..], "{what}: norms differ");
                for i in 0..d {
                    let (x, y) = (code_at(&w[..cb], b, i), code_at(&g[..cb], b, i));
                    assert!(x.abs_diff(y) <= 1, "{what}: coordinate {i} codes {x} vs {y}");
                    flipped += (x != y) as usize;
                }
            }
            assert!(flipped * 1000 <= want.len() / row * d, "{what}: {flipped} codes differ");
        }
    }
}

/// The projection kernel encoding k and v into a TurboQuant cache (`forward_into_tq_cache`, one
/// launch) leaves the same bytes as the kernel followed by the two cache writes above, returns
/// the same q (and for a cache with a float window the same k and v, a row without a slot's
/// included), and skips rows without a slot: 1-D and interleaved rotary, q/k norms, key scales,
/// Hadamard (d = 64, 128, 256) and dense (d = 80) rotations, f32 and bf16.
#[test]
fn qkv_rope_into_tq_cache_equals_separate_writes() {
    use common::cuda::QkvInputs;
    use iris::batch::NO_SLOT;
    use iris::ops::tq_write::TqWrite;
    use iris::ops::turboquant::{FloatWindow, TqLayerCache};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(43);
    let cases = [
        (28, 4, 128, (3, 4), true, false, false, DType::BF16),
        (28, 4, 128, (4, 4), false, false, false, DType::F32),
        (8, 2, 64, (2, 3), true, true, true, DType::F32),
        (4, 1, 256, (4, 2), true, true, false, DType::BF16),
        (8, 2, 80, (3, 4), true, false, false, DType::F32),
    ];
    for ((hq, hkv, d, bits, scaled, norm, interleaved, dt), windowed) in
        cases.into_iter().flat_map(|c| [(c, false), (c, true)])
    {
        let (mut m, n_slots) = meta(&mut rng, &[(40, 40), (300, 1), (17, 5)], 16);
        let skipped = m.slot_mapping[3] as usize;
        m.slot_mapping[3] = NO_SLOT;
        m.upload(&dev).unwrap();
        let t = m.num_rows();
        let inputs = QkvInputs::random(&mut rng, &dev, dt, t, (hq, hkv, d));
        let (y, op) = (&inputs.y, inputs.op((hq, hkv, d), norm, interleaved));
        let codecs = tq_codecs(d, hkv, bits, scaled);
        let cache = || {
            let init = |row: usize| {
                let v: Vec<u8> = (0..n_slots * hkv * row).map(|i| (i * 37 % 251) as u8).collect();
                Tensor::from_vec(v, (n_slots, hkv, row), &dev).unwrap()
            };
            TqLayerCache {
                k: init(codecs.key.row_bytes()),
                v: init(codecs.value.row_bytes()),
                codecs: codecs.clone(),
                // Only its presence matters here: k and v come back too.
                window: windowed.then(|| FloatWindow {
                    len: 4,
                    k: Tensor::zeros((4, hkv, d), dt, &dev).unwrap(),
                    v: Tensor::zeros((4, hkv, d), dt, &dev).unwrap(),
                }),
                device: Some(codecs.upload(&dev).unwrap()),
            }
        };
        let (separate, fused) = (cache(), cache());
        let (q, k, v) = op.forward(y).unwrap();
        let dm = m.device.as_ref();
        separate.k.inplace_op2(&k.contiguous().unwrap(), &TqWrite::keys(&separate, &m.slot_mapping, dm)).unwrap();
        separate.v.inplace_op2(&v.contiguous().unwrap(), &TqWrite::values(&separate, &m.slot_mapping, dm)).unwrap();
        let (qf, fresh) = op.forward_into_tq_cache(y, &fused, &m).unwrap();
        let what = format!("qkv-rope into a tq cache {hq}x{hkv}x{d} bits {bits:?} {dt:?} window {windowed}");
        assert_eq!(max_rel_err(&qf, &q), 0.0, "{what}: q differs");
        match fresh {
            Some((kf, vf)) => {
                assert!(windowed, "{what}: k and v returned without a float window");
                assert_eq!(max_rel_err(&kf, &k), 0.0, "{what}: k differs");
                assert_eq!(max_rel_err(&vf, &v), 0.0, "{what}: v differs");
            }
            None => assert!(!windowed, "{what}: a float window needs k and v back"),
        }
        for (name, a, b) in [("keys", &fused.k, &separate.k), ("values", &fused.v, &separate.v)] {
            let (a, b) = (bytes(a), bytes(b));
            let differ = (0..a.len()).filter(|&i| a[i] != b[i]).count();
            assert_eq!(differ, 0, "{what}: {differ} of {} {name} bytes differ", a.len());
        }
        // The row without a slot left its would-be slot as it was.
        let untouched = cache();
        for (a, b) in [(&fused.k, &untouched.k), (&fused.v, &untouched.v)] {
            assert_eq!(bytes(&a.get(skipped).unwrap()), bytes(&b.get(skipped).unwrap()), "{what}: a NO_SLOT row wrote");
        }
    }
}

struct TqCase {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bits: (u8, u8),
    window: Option<usize>,
    softcap: Option<f32>,
    float_window: usize,
    scaled: bool,
}

/// Attention on codes on the GPU against the CPU op over the same codes (written by the CPU
/// codec and copied), for one launch mixing decodes (short, and past several splits), a whole
/// prompt and prompt chunks over a cached prefix (with 16-bit queries, those of 16 rows or more
/// run in tensor-core tiles of 64 rows: one, part of one, three; the other rows' kernels then
/// run over the span from the first decode to the last, here past the first prompt and
/// around a chunk); f32 queries within 1e-4, bf16 within bf16.
fn check_tq_attention(dev: &Device, c: &TqCase, q_dt: DType, ring_dt: DType, tol: f32) {
    use iris::ops::tq_attention::TqAttention;
    use iris::ops::tq_write::TqWrite;
    let mut rng = StdRng::seed_from_u64((c.heads * 1000 + c.head_dim + c.float_window) as u64);
    let (bs, d, hkv) = (16, c.head_dim, c.kv_heads);
    let seqs = [(40, 40), (1, 1), (17, 1), (700, 1), (3000, 1), (300, 45), (33, 7), (200, 130)];
    let (mut m, slots) = meta(&mut rng, &seqs, bs);
    if c.float_window > 0 {
        // Sequence i in ring n - 1 - i (the batch invariance check below gives it the same).
        m.set_float_window(c.float_window, (0..seqs.len() as u32).rev().collect()).unwrap();
    }
    let codecs = tq_codecs(d, hkv, c.bits, c.scaled);
    let all: Vec<u32> = (0..slots as u32).collect();
    let write = |codec: &iris::ops::turboquant::TqCodec, scale: Option<&[f32]>| {
        let x = random(&mut StdRng::seed_from_u64(codec.bits() as u64 * 7 + d as u64), &[slots, hkv, d]);
        let t = Tensor::zeros((slots, hkv, codec.row_bytes()), DType::U8, &Device::Cpu).unwrap();
        t.inplace_op2(&x, &TqWrite { slot_mapping: &all, codec, scale, device: None }).unwrap();
        t
    };
    let (kc, vc) = (write(&codecs.key, codecs.key_scale.as_deref()), write(&codecs.value, None));
    let rows = m.num_rows();
    let q = random(&mut rng, &[rows, c.heads, d]).to_dtype(q_dt).unwrap().to_dtype(DType::F32).unwrap();
    let fw = c.float_window;
    // This step's rows in q's type (the model's), read as f32 by the reference.
    let mut step_rows = || random(&mut rng, &[rows, hkv, d]).to_dtype(q_dt).unwrap().to_dtype(DType::F32).unwrap();
    let (new_k, new_v) = (step_rows(), step_rows());
    let ring_rows = seqs.len() * fw.max(1);
    let ring_k = random(&mut rng, &[ring_rows, hkv, d]).to_dtype(ring_dt).unwrap();
    let ring_v = random(&mut rng, &[ring_rows, hkv, d]).to_dtype(ring_dt).unwrap();
    let paged = |m| PagedAttention {
        meta: m,
        num_heads: c.heads,
        num_kv_heads: hkv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: c.window,
        softcap: c.softcap,
        isa: iris::simd::Isa::active(),
        bidirectional: false,
    };
    // The op over a step's metadata, float window inputs and device codecs.
    let op = |m, float, device| TqAttention {
        attn: paged(m),
        key: &codecs.key,
        value: &codecs.value,
        key_scale: codecs.key_scale.as_deref(),
        float,
        device,
    };
    let cpu = op(&m, float_inputs(fw, [&ring_k, &ring_v, &new_k, &new_v]), None).forward(&q, &kc, &vc).unwrap();
    let mut mg = m.clone();
    mg.upload(dev).unwrap();
    let g = |t: &Tensor| t.to_device(dev).unwrap();
    let gq = |t: &Tensor| t.to_dtype(q_dt).unwrap().to_device(dev).unwrap();
    let on_gpu = codecs.upload(dev).unwrap();
    let (gnk, gnv, grk, grv) = (gq(&new_k), gq(&new_v), g(&ring_k), g(&ring_v));
    let gpu_op = op(&mg, float_inputs(fw, [&grk, &grv, &gnk, &gnv]), Some(&on_gpu));
    let (gpu_q, gpu_k, gpu_v) = (gq(&q), g(&kc), g(&vc));
    let gpu = gpu_op.forward(&gpu_q, &gpu_k, &gpu_v).unwrap();
    // No atomics in the kernels' sums: the same launch gives the same bits.
    let again = gpu_op.forward(&gpu_q, &gpu_k, &gpu_v).unwrap();
    let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(bits(&gpu), bits(&again), "tq attention differs between two identical launches");
    assert_eq!(gpu.dtype(), q_dt);
    assert_eq!(gpu.dims(), cpu.dims());
    let e = max_rel_err(&gpu, &cpu);
    assert!(
        e <= tol,
        "tq attention {}x{hkv}x{d} bits {:?} window {:?} softcap {:?} float window {fw} key scales {}, q {q_dt:?} rings {ring_dt:?}: rel err {e}",
        c.heads,
        c.bits,
        c.window,
        c.softcap,
        c.scaled
    );
    if q_dt == DType::F32 || !iris::ops::cuda::PREFILL_HEAD_DIMS.contains(&d) {
        return;
    }
    // Batch invariance: with 16-bit queries and a head dim the tensor-core tiles take, this
    // step has few rows outside them (11, times at most 4 blocks per row in these cases: within
    // the 64 blocks up to which every row takes 64 splits), so every sequence (decode, short
    // chunk, prompt, chunk over a prefix; float window too) gets the same bits alone as within
    // it. (Steps of many rows outside the tiles take fewer splits per row, see
    // tq_decode_attention_is_batch_invariant.)
    for (i, s) in m.seqs.iter().enumerate() {
        let solo = iris::batch::SeqSlice { q_start: 0, ..s.clone() };
        let mut one = iris::batch::AttentionMeta::new(bs, vec![solo]);
        if fw > 0 {
            one.set_float_window(fw, vec![(seqs.len() - 1 - i) as u32]).unwrap();
        }
        one.upload(dev).unwrap();
        let rows_of = |t: &Tensor| t.narrow(0, s.q_start, s.q_len).unwrap();
        let (sq, snk, snv) = (rows_of(&gpu_q), rows_of(&gnk), rows_of(&gnv));
        let alone = TqAttention {
            attn: PagedAttention { meta: &one, ..paged(&m) },
            key: &codecs.key,
            value: &codecs.value,
            key_scale: codecs.key_scale.as_deref(),
            float: float_inputs(fw, [&grk, &grv, &snk, &snv]),
            device: Some(&on_gpu),
        }
        .forward(&sq, &gpu_k, &gpu_v);
        assert_eq!(
            bits(&alone.unwrap()),
            bits(&rows_of(&gpu)),
            "tq attention {}x{hkv}x{d} float window {fw}: sequence of {} rows at {} positions differs alone",
            c.heads,
            s.q_len,
            s.context_len
        );
    }
}

/// A float window of `len` positions (None for 0): rings, this step's rows, ring indices.
fn float_inputs<'t>(
    len: usize,
    [ring_k, ring_v, new_k, new_v]: [&'t Tensor; 4],
) -> Option<iris::ops::tq_attention::FloatInputs<'t>> {
    (len > 0).then_some(iris::ops::tq_attention::FloatInputs { len, ring_k, ring_v, new_k, new_v })
}

fn tq_cases() -> Vec<TqCase> {
    let c = |heads, kv_heads, head_dim, bits| TqCase {
        heads,
        kv_heads,
        head_dim,
        bits,
        window: None,
        softcap: None,
        float_window: 0,
        scaled: false,
    };
    vec![
        c(9, 3, 64, (3, 4)),
        TqCase { scaled: true, ..c(28, 4, 128, (4, 4)) },
        TqCase { float_window: 64, scaled: true, ..c(28, 4, 128, (3, 4)) },
        TqCase { float_window: 5, ..c(4, 1, 256, (2, 3)) },
        TqCase { scaled: true, float_window: 9, ..c(16, 2, 256, (4, 2)) },
        TqCase { scaled: true, ..c(8, 2, 80, (3, 3)) },
        TqCase { float_window: 3, ..c(12, 4, 96, (4, 4)) },
        TqCase { window: Some(300), softcap: Some(30.0), float_window: 16, scaled: true, ..c(4, 2, 64, (2, 4)) },
        TqCase { window: Some(7), ..c(32, 2, 32, (3, 4)) },
        // A sliding window shorter than the cached prefixes: prompt chunks' codes start past 0.
        TqCase { window: Some(64), float_window: 8, scaled: true, ..c(8, 2, 128, (3, 4)) },
        TqCase { float_window: 600, ..c(6, 2, 16, (4, 3)) },
        // Key rows of 10 and 34 bytes ahead of 4-bit values (4-aligned loads).
        c(4, 2, 16, (3, 4)),
        TqCase { scaled: true, ..c(8, 2, 80, (3, 4)) },
    ]
}

#[test]
fn tq_attention_f32_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for c in tq_cases() {
        check_tq_attention(&dev, &c, DType::F32, DType::F32, 1e-4);
        if c.float_window > 0 {
            // bf16 rings: the step's own rows are rounded to bf16 on both sides.
            check_tq_attention(&dev, &c, DType::F32, DType::BF16, 1e-4);
        }
    }
}

#[test]
fn tq_attention_bf16_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for c in tq_cases() {
        // The reference reads the same bf16 queries (and rows) as f32; the kernel rounds its output.
        check_tq_attention(&dev, &c, DType::BF16, DType::BF16, 8e-3);
    }
}

/// Batch invariance of attention on codes: in a step of few rows (here decodes of 1 to 3,000
/// tokens, with a prompt chunk among them), every decode row gives the same bits as when it is
/// decoded alone. The split of a row's positions must depend on the row alone for that (steps
/// of up to 64 blocks per split always take 64 splits).
#[test]
fn tq_decode_attention_is_batch_invariant() {
    use iris::batch::AttentionMeta;
    use iris::ops::tq_attention::TqAttention;
    use iris::ops::tq_write::TqWrite;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(12);
    let (hq, hkv, d, bs) = (28, 4, 128, 16);
    let (mut m, slots) = meta(&mut rng, &[(1, 1), (17, 1), (700, 1), (3000, 1), (33, 7)], bs);
    let codecs = tq_codecs(d, hkv, (3, 4), true);
    let all: Vec<u32> = (0..slots as u32).collect();
    let write = |codec: &iris::ops::turboquant::TqCodec, scale: Option<&[f32]>, seed: u64| {
        let x = random(&mut StdRng::seed_from_u64(seed), &[slots, hkv, d]);
        let t = Tensor::zeros((slots, hkv, codec.row_bytes()), DType::U8, &Device::Cpu).unwrap();
        t.inplace_op2(&x, &TqWrite { slot_mapping: &all, codec, scale, device: None }).unwrap();
        t.to_device(&dev).unwrap()
    };
    let (kc, vc) = (write(&codecs.key, codecs.key_scale.as_deref(), 1), write(&codecs.value, None, 2));
    let on_gpu = codecs.upload(&dev).unwrap();
    let q = random(&mut rng, &[m.num_rows(), hq, d]).to_dtype(DType::BF16).unwrap().to_device(&dev).unwrap();
    let attend = |m: &AttentionMeta, q: &Tensor| {
        let attn = PagedAttention {
            meta: m,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            window: None,
            softcap: None,
            isa: iris::simd::Isa::active(),
            bidirectional: false,
        };
        let op = TqAttention {
            attn,
            key: &codecs.key,
            value: &codecs.value,
            key_scale: codecs.key_scale.as_deref(),
            float: None,
            device: Some(&on_gpu),
        };
        op.forward(q, &kc, &vc).unwrap()
    };
    m.upload(&dev).unwrap();
    common::cuda::assert_decodes_batch_invariant(&dev, &m, &q, attend);
}
