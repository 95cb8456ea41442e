//! Each CUDA kernel against its CPU reference op, on the same inputs. Compiled only with
//! `--features cuda`; run on a GPU machine by scripts/gpu-check.sh (IRIS_REQUIRE_GPU=1 turns a
//! missing GPU into a failure instead of a skip).
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::cuda::{gpu, max_rel_err, meta, random};
use iris::batch::{AttentionMeta, SeqSlice};
use iris::ops::kv_write::KvWrite;
use iris::ops::paged_attention::PagedAttention;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[test]
fn kv_write_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(1);
    for (cache_dt, new_dt) in
        [(DType::F32, DType::F32), (DType::BF16, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F16)]
    {
        let (hkv, d, bs) = (3, 80, 16);
        let (mut m, slots) = meta(&mut rng, &[(40, 40), (300, 1), (17, 5)], bs);
        let new = random(&mut rng, &[m.num_rows(), hkv, d]).to_dtype(new_dt).unwrap();
        // Poisoned (non-zero) caches: every written slot must be overwritten, the rest kept.
        let init = random(&mut rng, &[slots, hkv, d]).to_dtype(cache_dt).unwrap();
        let cpu = init.copy().unwrap();
        cpu.inplace_op2(&new.to_dtype(DType::F32).unwrap(), &KvWrite::step(&m)).unwrap();
        m.upload(&dev).unwrap();
        let gpu = init.to_device(&dev).unwrap();
        gpu.inplace_op2(&new.to_device(&dev).unwrap(), &KvWrite::step(&m)).unwrap();
        let e = max_rel_err(&gpu, &cpu);
        assert_eq!(e, 0.0, "kv-write cache {cache_dt:?} new {new_dt:?}: rel err {e}");
    }
}

struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Each prompt chunk's middle half is an image whose rows see each other both ways.
    bidi: bool,
}

/// Decodes (one of them a first token, some past one chunk of 256 keys), a whole prompt, and
/// prompt chunks over a cached prefix, all in one launch. The chunks over 1,000-2,100 cached
/// positions split their keys over several blocks (`batch::prefill_splits`: 8 and 6 blocks,
/// fewer with a window), the others do not.
const SEQS: [(usize, usize); 10] =
    [(1, 1), (17, 1), (256, 1), (257, 1), (700, 1), (40, 40), (300, 45), (33, 7), (2100, 40), (1200, 150)];
/// Few rows (rows x kv heads < 128): with f32 queries or caches, one head per block, the
/// lane-split kernel (`paged_decode`); 16-bit rows take `gqa_decode` at any row count.
const FEW_ROWS: [(usize, usize); 7] = [(1, 1), (17, 1), (256, 1), (257, 1), (700, 1), (2000, 1), (33, 7)];

fn check_attention(dev: &Device, c: &Case, q_dt: DType, cache_dt: DType, tol: f32) {
    check_attention_on(dev, &SEQS, c, q_dt, cache_dt, tol);
    check_attention_on(dev, &FEW_ROWS, c, q_dt, cache_dt, tol);
}

fn check_attention_on(dev: &Device, seqs: &[(usize, usize)], c: &Case, q_dt: DType, cache_dt: DType, tol: f32) {
    let mut rng = StdRng::seed_from_u64((c.heads * 1000 + c.head_dim) as u64);
    let bs = 16;
    let (mut m, slots) = meta(&mut rng, seqs, bs);
    if c.bidi {
        let spans = m
            .seqs
            .iter()
            .map(|s| {
                let (a, b) = (s.first_position() + s.q_len / 4, s.context_len - s.q_len / 4);
                if s.q_len > 1 && b > a + 1 {
                    vec![(a, b)]
                } else {
                    vec![]
                }
            })
            .collect();
        m.set_bidirectional(spans).unwrap();
    }
    let d = c.head_dim;
    let q = random(&mut rng, &[m.num_rows(), c.heads, d]).to_dtype(q_dt).unwrap();
    let k = random(&mut rng, &[slots, c.kv_heads, d]).to_dtype(cache_dt).unwrap();
    let v = random(&mut rng, &[slots, c.kv_heads, d]).to_dtype(cache_dt).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let cpu = PagedAttention {
        meta: &m,
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        head_dim: d,
        scale,
        window: c.window,
        softcap: c.softcap,
        isa: iris::simd::Isa::active(),
        bidirectional: c.bidi,
    }
    .forward(&q.to_dtype(DType::F32).unwrap(), &k, &v)
    .unwrap();
    m.upload(dev).unwrap();
    let op = PagedAttention {
        meta: &m,
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        head_dim: d,
        scale,
        window: c.window,
        softcap: c.softcap,
        isa: iris::simd::Isa::active(),
        bidirectional: c.bidi,
    };
    let gpu = op.forward(&q.to_device(dev).unwrap(), &k.to_device(dev).unwrap(), &v.to_device(dev).unwrap()).unwrap();
    assert_eq!(gpu.dtype(), q_dt);
    assert_eq!(gpu.dims(), cpu.dims());
    let e = max_rel_err(&gpu, &cpu);
    assert!(
        e <= tol,
        "paged attention {}x{}x{d} window {:?} softcap {:?} bidirectional {}, q {q_dt:?} cache {cache_dt:?}, {} rows: rel err {e}",
        c.heads,
        c.kv_heads,
        c.window,
        c.softcap,
        c.bidi,
        m.num_rows()
    );
}

fn cases() -> Vec<Case> {
    let c = |heads, kv_heads, head_dim| Case { heads, kv_heads, head_dim, window: None, softcap: None, bidi: false };
    vec![
        c(4, 4, 64),
        c(8, 2, 80),
        c(12, 4, 96),
        c(28, 4, 128),
        c(32, 2, 256),
        c(9, 3, 64),
        // A group of 20 query heads: two tiles of the tensor-core decode kernel's 16 rows.
        c(40, 2, 64),
        c(4, 2, 16),
        Case { window: Some(7), softcap: Some(30.0), ..c(4, 1, 32) },
        Case { window: Some(300), ..c(14, 2, 64) },
        // Gemma 4's global layers, and its sliding layers over images seen whole.
        c(8, 2, 512),
        Case { bidi: true, ..c(8, 4, 256) },
        Case { window: Some(20), bidi: true, ..c(4, 2, 64) },
    ]
}

#[test]
fn paged_attention_f32_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for c in cases() {
        check_attention(&dev, &c, DType::F32, DType::F32, 2e-5);
        // The same bf16 / f16 cache values on both sides: only f32 rounding differs.
        check_attention(&dev, &c, DType::F32, DType::BF16, 2e-5);
        check_attention(&dev, &c, DType::F32, DType::F16, 2e-5);
    }
}

#[test]
fn paged_attention_bf16_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for c in cases() {
        // The reference reads the same bf16 queries as f32; the kernel rounds its output to bf16.
        check_attention(&dev, &c, DType::BF16, DType::BF16, 8e-3);
        check_attention(&dev, &c, DType::F16, DType::F16, 2e-3);
    }
}

/// Long contexts (the long-context issue's 32k and 128k): decodes at 32k and 128k positions and
/// prompt chunks over 32k cached ones (16 rows: the most key splits; 200 rows), in one launch
/// and each with a 7B model's heads, against the CPU reference.
#[test]
fn paged_attention_at_long_contexts_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let seqs = [(32_768, 1), (131_072, 1), (32_784, 16), (33_000, 200)];
    let c = Case { heads: 28, kv_heads: 4, head_dim: 128, window: None, softcap: None, bidi: false };
    check_attention_on(&dev, &seqs, &c, DType::BF16, DType::BF16, 8e-3);
    check_attention_on(&dev, &seqs, &Case { window: Some(4096), ..c }, DType::BF16, DType::BF16, 8e-3);
}

/// A decode row's attention does not depend on the rows beside it: alone it gives the same bits
/// as within a few-row mix (`gqa_decode` splits a row's keys by its own key count, not by the
/// batch), for contexts within one tile of keys and past several. Alone, a row's 4 x 32 blocks
/// fit an H200 at once and its last block merges the splits (arrival counters); the mix (13
/// rows) has more blocks than it holds, so the merge kernel does: equal bits here also mean the
/// two merges agree.
#[test]
fn decode_attention_is_batch_invariant() {
    let Some(dev) = gpu() else { return };
    check_batch_invariant(&dev, 11, &FEW_ROWS, &[None], |s| s.q_len == 1);
}

/// A prompt chunk's rows do not depend on the rest of the batch either: alone they give the bits
/// they give beside decodes and other chunks, split over blocks (`batch::prefill_splits`) or
/// not, with and without a window (which bounds the splits by the keys it leaves).
#[test]
fn prefill_attention_is_batch_invariant() {
    let Some(dev) = gpu() else { return };
    let seqs = [(700, 1), (2100, 40), (300, 45), (1200, 150), (5000, 600), (33, 7), (4000, 16)];
    check_batch_invariant(&dev, 12, &seqs, &[None, Some(1000)], |s| s.q_len >= iris::batch::PREFILL_MIN_ROWS);
}

/// The sequences `which` picks of a batch of `seqs` (context, rows), bf16 with a 7B model's
/// heads, give alone the bits they give within the batch, for each window.
fn check_batch_invariant(
    dev: &Device,
    seed: u64,
    seqs: &[(usize, usize)],
    windows: &[Option<usize>],
    which: impl Fn(&SeqSlice) -> bool + Copy,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (hq, hkv, d, bs) = (28, 4, 128, 16);
    let (mut m, slots) = meta(&mut rng, seqs, bs);
    let q = random(&mut rng, &[m.num_rows(), hq, d]).to_dtype(DType::BF16).unwrap().to_device(dev).unwrap();
    let k = random(&mut rng, &[slots, hkv, d]).to_dtype(DType::BF16).unwrap().to_device(dev).unwrap();
    let v = random(&mut rng, &[slots, hkv, d]).to_dtype(DType::BF16).unwrap().to_device(dev).unwrap();
    m.upload(dev).unwrap();
    for &window in windows {
        let attend = |m: &AttentionMeta, q: &Tensor| {
            let op = PagedAttention {
                meta: m,
                num_heads: hq,
                num_kv_heads: hkv,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                window,
                softcap: None,
                isa: iris::simd::Isa::active(),
                bidirectional: false,
            };
            op.forward(q, &k, &v).unwrap()
        };
        common::cuda::assert_batch_invariant(dev, &m, &q, which, attend);
    }
}

#[test]
fn paged_attention_rejects_short_block_tables() {
    let Some(dev) = gpu() else { return };
    let mut m =
        AttentionMeta::new(4, vec![SeqSlice { q_start: 0, q_len: 1, context_len: 9, block_table: vec![0, 1, 2] }]);
    m.seqs[0].block_table.pop();
    m.upload(&dev).unwrap();
    let q = Tensor::zeros((1, 2, 64), DType::F32, &dev).unwrap();
    let kv = Tensor::zeros((16, 1, 64), DType::F32, &dev).unwrap();
    let op = PagedAttention {
        meta: &m,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        scale: 1.0,
        window: None,
        softcap: None,
        isa: iris::simd::Isa::active(),
        bidirectional: false,
    };
    let err = op.forward(&q, &kv, &kv).unwrap_err().to_string();
    assert!(err.contains("block table does not cover 9 tokens"), "{err}");
}

#[test]
fn argmax_matches_cpu_including_ties_and_non_finite_rows() {
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, vocab) = (5, 152_064);
    let mut v: Vec<f32> = (0..rows * vocab).map(|_| (rng.random_range(-8.0f32..8.0) * 4.0).round() / 4.0).collect();
    // Row 1: a tie between two ids far apart; row 2: NaN and +inf never win; row 3: nothing finite.
    v[vocab + 100_000] = 50.0;
    v[vocab + 7] = 50.0;
    v[2 * vocab + 3] = f32::NAN;
    v[2 * vocab + 4] = f32::INFINITY;
    v[3 * vocab..4 * vocab].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
    let t = Tensor::from_vec(v, (rows, vocab), &Device::Cpu).unwrap();
    let cpu: Vec<u32> = iris::ops::argmax::Argmax::forward(&t).unwrap().to_vec1().unwrap();
    let gpu: Vec<u32> = iris::ops::argmax::Argmax::forward(&t.to_device(&dev).unwrap()).unwrap().to_vec1().unwrap();
    assert_eq!(cpu[1], 7);
    assert_eq!(cpu[3], 0);
    assert_eq!(gpu, cpu);
}

/// Grammar masks applied on the device equal the host's, bit for bit: masked rows, unmasked
/// rows and a mask shorter than the vocabulary (whose missing words forbid their tokens), over a
/// real vocabulary size.
#[test]
fn token_masks_match_cpu() {
    use iris::ops::token_mask::TokenMasks;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (rows, vocab) = (6, 152_064);
    let v: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-8.0f32..8.0)).collect();
    let mut masks = TokenMasks::new(vocab);
    for r in 0..rows {
        let bits: Vec<u32> = (0..masks.words()).map(|_| rng.random::<u32>() & rng.random::<u32>()).collect();
        match r % 3 {
            0 => masks.push(Some(&bits)),
            1 => masks.push(None),
            _ => masks.push(Some(&bits[..bits.len() / 2])),
        }
    }
    let t = Tensor::from_vec(v, (rows, vocab), &Device::Cpu).unwrap();
    let cpu: Vec<f32> = masks.apply(&t).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let gpu: Vec<f32> = masks.apply(&t.to_device(&dev).unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(cpu.iter().any(|l| l.is_infinite()) && cpu.iter().any(|l| l.is_finite()));
    assert_eq!(
        cpu.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        gpu.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
    );
}

/// The device draw picks exactly the host reference's token (same u, same integer masses) for
/// temperatures, top-k (with ties at the cut-off), top-p, min-p and their mixes, over a real
/// vocabulary size and a small one, with coarse logits (many ties), masks and NaN.
#[test]
fn sample_matches_cpu_exactly() {
    use iris::ops::sample::{DraftCheck, Draw, Sample, PARAMS_PER_ROW};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    for (vocab, coarse) in [(152_064usize, false), (152_064, true), (1000, true), (49_152, false)] {
        let mut draws = Vec::new();
        for t in [0.0f32, 0.3, 1.0, 1.7] {
            for k in [0u32, 1, 2, 40, 5000, vocab as u32 + 3] {
                for p in [1.0f32, 0.95, 0.5, 0.05] {
                    for mp in [0.0f32, 0.02] {
                        let inv = if t == 0.0 { 0.0 } else { 1.0 / t };
                        draws.push(Draw {
                            inv_temperature: inv,
                            top_k: k,
                            top_p: p,
                            min_p: mp,
                            u: rng.random::<f32>(),
                            draft: None,
                        });
                    }
                }
            }
        }
        let rows = draws.len();
        let mut v: Vec<f32> = (0..rows * vocab)
            .map(|_| {
                let x = rng.random_range(-6.0f32..6.0);
                if coarse {
                    (x * 2.0).round() / 2.0
                } else {
                    x
                }
            })
            .collect();
        // A masked vocabulary part, a NaN, an infinity.
        v[..vocab / 3].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
        v[vocab + 5] = f32::NAN;
        v[2 * vocab + 9] = f32::INFINITY;
        let logits = Tensor::from_vec(v, (rows, vocab), &Device::Cpu).unwrap();
        let params: Vec<f32> = draws.iter().flat_map(|d| d.to_params()).collect();
        let params = Tensor::from_vec(params, (rows, PARAMS_PER_ROW), &Device::Cpu).unwrap();
        let plain: Vec<u32> = Sample::forward(&logits, &params).unwrap().to_vec1().unwrap();
        // Then every row judges a draft (speculative verification): its own plain draw (often
        // accepted), a random id, or a masked one (never accepted).
        let judged: Vec<Draw> = draws
            .iter()
            .enumerate()
            .map(|(r, d)| {
                let token = match r % 3 {
                    0 => plain[r],
                    1 => rng.random_range(0..vocab as u32),
                    _ => rng.random_range(0..vocab as u32 / 3),
                };
                Draw { draft: Some(DraftCheck { token, u_residual: rng.random::<f32>() }), ..*d }
            })
            .collect();
        let judged_params: Vec<f32> = judged.iter().flat_map(|d| d.to_params()).collect();
        let judged_params = Tensor::from_vec(judged_params, (rows, PARAMS_PER_ROW), &Device::Cpu).unwrap();
        let mut cpu_judged = Vec::new();
        for (draws, params) in [(&draws, &params), (&judged, &judged_params)] {
            let cpu: Vec<u32> = Sample::forward(&logits, params).unwrap().to_vec1().unwrap();
            let gpu: Vec<u32> = Sample::forward(&logits.to_device(&dev).unwrap(), &params.to_device(&dev).unwrap())
                .unwrap()
                .to_vec1()
                .unwrap();
            let differ: Vec<usize> = (0..rows).filter(|&r| cpu[r] != gpu[r]).collect();
            assert!(
                differ.is_empty(),
                "vocab {vocab} coarse {coarse}: rows {differ:?} differ, e.g. {:?}",
                differ.first().map(|&r| (draws[r], cpu[r], gpu[r]))
            );
            cpu_judged = cpu;
        }
        let sampled = |r: &usize| judged[*r].inv_temperature > 0.0;
        let accepted = (0..rows).filter(sampled).filter(|&r| cpu_judged[r] == judged[r].draft.unwrap().token).count();
        let rejected = (0..rows).filter(sampled).count() - accepted;
        assert!(accepted > 0 && rejected > 0, "vocab {vocab}: {accepted} drafts accepted, {rejected} rejected");
    }
}

/// Seeded sampling requests give the same tokens on the GPU (drawn there, graphs included) as
/// on the CPU (drawn on the host), f32 models, several requests at once.
#[test]
fn seeded_sampling_gives_the_cpu_tokens() {
    use iris::engine::build::{build_engine, EngineOptions};
    use iris::engine::SpeculativeConfig;
    let Some(dev) = gpu() else { return };
    let _gpu = common::gpu_lock();
    // Plain, then with n-gram drafts: their rows are judged on the device (rejection sampling)
    // with the numbers the host takes, so the tokens are the host's.
    let speculative = SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false };
    for spec in [None, Some(speculative)] {
        for name in common::TINY_MODELS {
            let path = common::fixture(name);
            let reqs: Vec<_> = (0..6u32)
                .map(|i| {
                    let mut p = common::greedy(24);
                    p.temperature = [0.0, 0.7, 1.0, 1.3, 0.9, 0.5][i as usize];
                    p.top_k = [0, 0, 20, 0, 5, 0][i as usize];
                    p.top_p = [1.0, 0.9, 1.0, 0.8, 0.95, 1.0][i as usize];
                    p.min_p = [0.0, 0.0, 0.0, 0.05, 0.0, 0.1][i as usize];
                    p.seed = Some(77 + i as u64);
                    if spec.is_some() {
                        p.temperature *= 0.4; // these random models then repeat enough to be drafted
                    }
                    // Prompts that repeat a unit, so prompt lookup finds drafts.
                    ((0..3 + 4 * i).map(|t| 5 + t % (2 + i) * 3).collect::<Vec<u32>>(), p)
                })
                .collect();
            let arrivals = [0, 0, 1, 2, 2, 5];
            let opts = EngineOptions { speculative: spec, ..Default::default() };
            let run = |d: &Device| {
                let mut e = build_engine(&path, d, &opts).unwrap().0;
                let out = common::run_requests(&mut e, &reqs, &arrivals);
                (out, e.stats.spec.num_draft_tokens, e.stats.spec.num_accepted_tokens)
            };
            let ((cpu, ..), (gpu, drafted, accepted)) = (run(&Device::Cpu), run(&dev));
            assert_eq!(gpu, cpu, "{name}, speculation {spec:?}");
            if spec.is_some() {
                assert!(0 < accepted && accepted < drafted, "{name}: {accepted} of {drafted} drafts accepted");
            }
        }
    }
}

/// The fused projection split against its CPU reference (tests/fused_ops.rs checks the reference
/// against the op-by-op layer path).
#[test]
fn qkv_rope_matches_cpu() {
    use iris::ops::qkv_rope::QkvRope;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(4);
    for (hq, hkv, d, bias, norm, interleaved) in [
        (28, 4, 128, true, false, false),
        (8, 2, 80, false, true, true),
        (4, 1, 256, true, true, false),
        (4, 2, 16, false, false, true),
    ] {
        let (t, half) = (37, d / 2);
        let w = (hq + 2 * hkv) * d;
        let y = random(&mut rng, &[t, w]);
        let b = random(&mut rng, &[w]);
        let cos = random(&mut rng, &[t, 1, half]);
        let sin = random(&mut rng, &[t, 1, half]);
        let (qn, kn) = (random(&mut rng, &[d]), random(&mut rng, &[d]));
        let eps = 1e-6;
        let run = |y: &Tensor, b: &Tensor, cos: &Tensor, sin: &Tensor, qn: &Tensor, kn: &Tensor| {
            QkvRope {
                num_heads: hq,
                num_kv_heads: hkv,
                head_dim: d,
                bias: bias.then_some(b),
                cos,
                sin,
                qk_norm: norm.then_some((qn, kn, eps)),
                interleaved,
            }
            .forward(y)
            .unwrap()
        };
        for dt in [DType::F32, DType::BF16] {
            let g = |x: &Tensor| x.to_dtype(dt).unwrap().to_device(&dev).unwrap();
            let gpu = run(&g(&y), &g(&b), &g(&cos), &g(&sin), &g(&qn), &g(&kn));
            // In bf16 the reference reads the same rounded inputs; the kernel rounds where the ops do.
            let tol = if dt == DType::F32 { 1e-5 } else { 2e-2 };
            let cpu_in = |x: &Tensor| x.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
            let cpu = run(&cpu_in(&y), &cpu_in(&b), &cpu_in(&cos), &cpu_in(&sin), &cpu_in(&qn), &cpu_in(&kn));
            for (name, (got, want)) in
                ["q", "k", "v"].iter().zip([&gpu.0, &gpu.1, &gpu.2].into_iter().zip([&cpu.0, &cpu.1, &cpu.2]))
            {
                let e = max_rel_err(got, want);
                assert!(e <= tol, "qkv-rope {dt:?} {name} ({hq}x{hkv}x{d}): rel err {e}");
            }
        }
    }
}

/// The fused kernel storing k and v in their cache slots leaves the same bits as the kernel
/// followed by the cache write, and skips rows without a slot.
#[test]
fn qkv_rope_into_cache_equals_separate_write() {
    use iris::batch::NO_SLOT;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(41);
    let (hq, hkv, d, bs) = (28, 4, 128, 16);
    let (mut m, slots) = meta(&mut rng, &[(40, 40), (300, 1), (17, 5)], bs);
    let skipped = m.slot_mapping[3] as usize;
    m.slot_mapping[3] = NO_SLOT;
    m.upload(&dev).unwrap();
    let t = m.num_rows();
    for dt in [DType::F32, DType::BF16] {
        let g = |x: Tensor| x.to_dtype(dt).unwrap().to_device(&dev).unwrap();
        let inputs = common::cuda::QkvInputs::random(&mut rng, &dev, dt, t, (hq, hkv, d));
        let (y, op) = (&inputs.y, inputs.op((hq, hkv, d), false, false));
        let init = g(random(&mut rng, &[slots, hkv, d]));
        let (kc, vc) = (init.copy().unwrap(), init.copy().unwrap());
        let (q, k, v) = op.forward(y).unwrap();
        kc.inplace_op2(&k, &KvWrite::step(&m)).unwrap();
        vc.inplace_op2(&v, &KvWrite::step(&m)).unwrap();
        let (kf, vf) = (init.copy().unwrap(), init.copy().unwrap());
        let qf = op.forward_into_cache(y, &kf, &vf, &m).unwrap();
        for (name, a, b) in [("q", &qf, &q), ("k cache", &kf, &kc), ("v cache", &vf, &vc)] {
            let e = max_rel_err(a, b);
            assert_eq!(e, 0.0, "qkv-rope into cache {dt:?}: {name} differs (rel err {e})");
        }
        // The row without a slot left its would-be slot as it was.
        for c in [&kf, &vf] {
            assert_eq!(max_rel_err(&c.get(skipped).unwrap(), &init.get(skipped).unwrap()), 0.0, "a NO_SLOT row wrote");
        }
    }
}

#[test]
fn gated_act_and_add_rms_norm_match_cpu() {
    use iris::ops::add_rms_norm::AddRmsNorm;
    use iris::ops::gated_act::GatedAct;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (t, inter, dim) = (19, 1536, 3584);
    let y = random(&mut rng, &[t, 2 * inter]);
    let (x, delta, w) = (random(&mut rng, &[t, dim]), random(&mut rng, &[t, dim]), random(&mut rng, &[dim]));
    for dt in [DType::F32, DType::BF16] {
        let (tol, g) = (if dt == DType::F32 { 1e-5 } else { 1e-2 }, |x: &Tensor| x.to_dtype(dt).unwrap());
        for (gelu, interleaved) in [(false, false), (true, false), (false, true), (true, true)] {
            let op = GatedAct { gelu, interleaved };
            let cpu = op.forward(&g(&y).to_dtype(DType::F32).unwrap()).unwrap();
            let gpu = op.forward(&g(&y).to_device(&dev).unwrap()).unwrap();
            let e = max_rel_err(&gpu, &cpu);
            assert!(e <= tol, "gated-act gelu={gelu} interleaved={interleaved} {dt:?}: rel err {e}");
        }
        let op = AddRmsNorm { eps: 1e-6 };
        let f = |x: &Tensor| g(x).to_dtype(DType::F32).unwrap();
        let cpu = op.forward(&f(&x), &f(&delta), &f(&w)).unwrap();
        let d = |x: &Tensor| g(x).to_device(&dev).unwrap();
        let gpu = op.forward(&d(&x), &d(&delta), &d(&w)).unwrap();
        for (name, a, b) in [("h", &gpu.0, &cpu.0), ("y", &gpu.1, &cpu.1)] {
            let e = max_rel_err(a, b);
            assert!(e <= tol, "add-rms-norm {name} {dt:?}: rel err {e}");
        }
    }
}

/// The tiny models in bf16 on the GPU against transformers' f32 logits: bf16 tolerance.
#[test]
fn bf16_models_stay_close_to_the_f32_reference() {
    use iris::batch::Batch;
    use iris::kv::{KvCache, KvCacheSpec, KvDtype};
    let Some(dev) = gpu() else { return };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"] {
        let r = candle_core::safetensors::load(root.join(name).join("reference.safetensors"), &Device::Cpu).unwrap();
        let ids: Vec<u32> = r["text.input_ids"]
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as u32)
            .collect();
        let loaded = iris::loader::load(&root.join(name), &dev, DType::BF16).unwrap();
        let cfg = loaded.config().clone();
        let spec = KvCacheSpec { block_size: 4, num_blocks: ids.len().div_ceil(4) + 1, dtype: KvDtype::Bf16 };
        let kv = KvCache::new(&cfg, spec, &dev).unwrap();
        let seq = SeqSlice {
            q_start: 0,
            q_len: ids.len(),
            context_len: ids.len(),
            block_table: (0..spec.num_blocks as u32).collect(),
        };
        let mut batch = Batch::from_tokens(&Device::Cpu, 4, vec![seq], &ids).unwrap();
        batch.to_device(&dev).unwrap();
        let logits = loaded.model.logits(&loaded.model.forward(&batch, &kv, None).unwrap()).unwrap();
        let e = max_rel_err(&logits, &r["text.logits"]);
        eprintln!("{name} bf16 logits: rel err {e}");
        assert!(e <= 5e-2, "{name} bf16 logits: rel err {e}");
    }
}

#[test]
fn gemv_matches_cpu() {
    use iris::ops::gemv::{max_rows, Gemv, MAX_ROWS};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    // K: one vector short of an unrolled pass, several passes plus a tail, a 7B's widths; N
    // and K such that 1, 2, 4 and 8 warps share a row.
    for (n, k) in [(1, 64), (7, 120), (300, 1000), (3584, 3584), (130, 18944)] {
        for m in 1..=MAX_ROWS {
            let x = random(&mut rng, &[m, k]);
            let w = random(&mut rng, &[n, k]);
            for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
                // The same rounded inputs on both sides; the reference sums in f32.
                let (x, w) = (x.to_dtype(dt).unwrap(), w.to_dtype(dt).unwrap());
                let (xg, wg) = (x.to_device(&dev).unwrap(), w.to_device(&dev).unwrap());
                if k % (16 / dt.size_in_bytes()) != 0 {
                    assert!(!Gemv::applies(&xg, &wg));
                    continue;
                }
                assert_eq!(Gemv::applies(&xg, &wg), m <= max_rows(), "m {m} k {k} {dt:?}");
                let gpu = Gemv::forward(&xg, &wg).unwrap();
                let cpu = Gemv::forward(&x.to_dtype(DType::F32).unwrap(), &w.to_dtype(DType::F32).unwrap()).unwrap();
                let e = max_rel_err(&gpu, &cpu);
                assert!(e < tol, "gemv {m}x{k} by {n}x{k} {dt:?}: rel err {e}");
                // A row's output does not depend on how many rows share the call.
                let solo = Gemv::forward(&xg.narrow(0, m - 1, 1).unwrap(), &wg).unwrap();
                let last = gpu.narrow(0, m - 1, 1).unwrap();
                assert_eq!(max_rel_err(&solo, &last), 0.0, "gemv row {m} of {m} differs from the row alone ({dt:?})");
            }
        }
    }
    // More rows than the kernel takes, or another device, go to the general matmul.
    let x = random(&mut rng, &[max_rows() + 1, 64]).to_device(&dev).unwrap();
    assert!(!Gemv::applies(&x, &random(&mut rng, &[8, 64]).to_device(&dev).unwrap()));
    assert!(!Gemv::applies(&random(&mut rng, &[1, 64]), &random(&mut rng, &[8, 64])));
}

/// The product of paired (gate, up) rows with the activation applied as it writes gives the
/// bits of the plain product followed by the interleaved gated activation, and the CPU
/// reference's values.
#[test]
fn gemv_gated_equals_product_then_activation() {
    use iris::ops::gated_act::GatedAct;
    use iris::ops::gemv::Gemv;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(8);
    // 2 I rows by K: 1, 2 and 4 warps per row (wider splits put a pair in two blocks).
    for (n, k) in [(37888, 3584), (3072, 576), (512, 1024)] {
        for m in 1..=2 {
            let (x, w) = (random(&mut rng, &[m, k]), random(&mut rng, &[n, k]));
            for (dt, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2)] {
                let (x, w) = (x.to_dtype(dt).unwrap(), w.to_dtype(dt).unwrap());
                let (xg, wg) = (x.to_device(&dev).unwrap(), w.to_device(&dev).unwrap());
                assert!(Gemv::applies_gated(&xg, &wg), "{n}x{k}");
                for gelu in [false, true] {
                    let fused = Gemv::forward_gated(&xg, &wg, gelu).unwrap();
                    let act = GatedAct { gelu, interleaved: true };
                    let apart = act.forward(&Gemv::forward(&xg, &wg).unwrap()).unwrap();
                    assert_eq!(max_rel_err(&fused, &apart), 0.0, "gated gemv {m}x{k} by {n}x{k} {dt:?} gelu={gelu}");
                    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                    let cpu = Gemv::forward_gated(&f32(&x), &f32(&w), gelu).unwrap();
                    let e = max_rel_err(&fused, &cpu);
                    assert!(e < tol, "gated gemv {m}x{k} by {n}x{k} {dt:?} gelu={gelu}: rel err {e}");
                }
            }
        }
    }
}

/// The batch-invariant tensor-core product: every row of y has the bits it has when computed
/// alone, for row counts that take the streaming kernel (1 to 64, in tiles of 16) and the tiled
/// one (65 and up), for K cut into 8, 4, 2 and 1 slots; within bf16/f16 rounding of the CPU's
/// f32 sums; the gated form gives the bits of the product followed by the activation.
#[test]
fn invariant_matmul_rows_do_not_depend_on_the_batch() {
    use iris::ops::gated_act::GatedAct;
    use iris::ops::invariant_matmul::{slots, InvariantMatmul};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(9);
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    // (N, K): 8 slots over a 7B's width and its MLP's, 4 slots, 2, 1; N not a multiple of a tile.
    for (n, k) in [(3584, 3584), (200, 18944), (130, 64), (96, 1056), (32, 48), (1030, 896)] {
        let all = random(&mut rng, &[300, k]);
        let w = random(&mut rng, &[n, k]);
        for (dt, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let (all, w) = (all.to_dtype(dt).unwrap(), w.to_dtype(dt).unwrap());
            let (ag, wg) = (all.to_device(&dev).unwrap(), w.to_device(&dev).unwrap());
            let solo: Vec<Tensor> =
                (0..300).map(|r| InvariantMatmul::forward(&ag.narrow(0, r, 1).unwrap(), &wg).unwrap()).collect();
            for m in [1, 2, 3, 7, 16, 17, 33, 64, 65, 128, 129, 300] {
                let y = InvariantMatmul::forward(&ag.narrow(0, 0, m).unwrap(), &wg).unwrap();
                if [1, 17, 65, 300].contains(&m) {
                    let cpu = InvariantMatmul::forward(&f32(&all.narrow(0, 0, m).unwrap()), &f32(&w)).unwrap();
                    let e = max_rel_err(&y, &cpu);
                    assert!(e < tol, "{m}x{k} by {n}x{k} {dt:?} ({} slots): rel err {e}", slots(k));
                }
                for (r, s) in solo.iter().enumerate().take(m) {
                    let row = y.narrow(0, r, 1).unwrap();
                    assert_eq!(max_rel_err(&row, s), 0.0, "row {r} of {m} ({n}x{k} {dt:?}) differs from the row alone");
                }
            }
            // The gated activation's kernel takes pairs in whole vectors (GatedAct::supports).
            if n % 16 == 0 {
                for m in [1, 5, 64, 65, 200] {
                    let x = ag.narrow(0, 0, m).unwrap();
                    for gelu in [false, true] {
                        let fused = InvariantMatmul::forward_gated(&x, &wg, gelu).unwrap();
                        let act = GatedAct { gelu, interleaved: true };
                        let apart = act.forward(&InvariantMatmul::forward(&x, &wg).unwrap()).unwrap();
                        assert_eq!(max_rel_err(&fused, &apart), 0.0, "gated {m}x{k} by {n}x{k} {dt:?} gelu={gelu}");
                    }
                }
            }
        }
    }
    // Without --batch-invariant (this binary never sets it): up to `default_rows()` rows; never
    // f32, or K not a multiple of 16 (tests/cuda_batch_invariant.rs has the mode's side).
    use iris::ops::invariant_matmul::default_rows;
    let on_gpu = |t: Tensor, dt: DType| t.to_dtype(dt).unwrap().to_device(&dev).unwrap();
    let (w, w40) = (random(&mut rng, &[8, 64]), random(&mut rng, &[8, 40]));
    let (x, x40) = (random(&mut rng, &[1, 64]), random(&mut rng, &[1, 40]));
    let many = random(&mut rng, &[default_rows() + 1, 64]);
    let bf16 = |x: &Tensor, w: &Tensor| {
        InvariantMatmul::applies(&on_gpu(x.clone(), DType::BF16), &on_gpu(w.clone(), DType::BF16))
    };
    assert_eq!(bf16(&x, &w), default_rows() >= 1);
    assert!(!bf16(&many, &w));
    assert!(!bf16(&x40, &w40));
    assert!(!InvariantMatmul::applies(&on_gpu(x, DType::F32), &on_gpu(w, DType::F32)));
}

/// The Gated DeltaNet step (conv with its state, then the delta rule with its state) against
/// the CPU reference, sequence by sequence: fresh sequences (their slot's old state ignored),
/// continuing ones (decodes and chunks), a graph's padding sequence (NO_SLOT: zero rows, no
/// state touched), slots in shuffled order and a slot no sequence holds (kept); key head dims
/// below, at and above one warp's 32 rows, value dims not a multiple of 32.
#[test]
fn gated_delta_matches_cpu() {
    use iris::config::LinearAttnConfig;
    use iris::ops::gated_delta::{run_sequence, DeltaParams};
    use iris::ops::gated_delta_cuda::{run_step, DeviceDeltaParams};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    for (hk, hv, dk, dv) in [(2, 4, 16, 16), (2, 6, 128, 128), (1, 3, 48, 40)] {
        let dims = LinearAttnConfig {
            num_key_heads: hk,
            num_value_heads: hv,
            key_head_dim: dk,
            value_head_dim: dv,
            conv_kernel: 4,
        };
        let (c, (cl, sl)) = (dims.conv_dim(), dims.state_len());
        // (context_len, q_len): a fresh prompt, a fresh one-token prompt, chunks and decodes
        // after earlier rows, a decode at position 1, and the padding sequence (last).
        let seqs = [(9, 9), (1, 1), (40, 3), (7, 1), (2, 1), (70, 70), (200, 66), (4, 4)];
        let (mut m, _) = meta(&mut rng, &seqs, 16);
        let slots_total = seqs.len() + 1;
        let mut perm: Vec<u32> = (0..slots_total as u32).collect();
        use rand::seq::SliceRandom;
        perm.shuffle(&mut rng);
        let mut slots: Vec<u32> = perm[..seqs.len()].to_vec();
        *slots.last_mut().unwrap() = iris::batch::NO_SLOT;
        m.set_state_slots(slots.clone()).unwrap();
        let t = m.num_rows();
        let host =
            |rng: &mut StdRng, n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let (qkv, a, b) = (host(&mut rng, t * c), host(&mut rng, t * hv), host(&mut rng, t * hv));
        let conv_w = host(&mut rng, c * 4);
        let neg_a: Vec<f32> = host(&mut rng, hv).iter().map(|x| -(x.exp())).collect();
        let dt_bias = host(&mut rng, hv);
        // Poisoned states: a fresh sequence must ignore its slot's old values.
        let (conv0, ssm0) = (host(&mut rng, slots_total * cl), host(&mut rng, slots_total * sl));
        // The reference.
        let p = DeltaParams { conv_weight: &conv_w, neg_a: &neg_a, dt_bias: &dt_bias };
        let (mut conv_ref, mut ssm_ref) = (conv0.clone(), ssm0.clone());
        let mut o_ref = vec![0f32; t * hv * dv];
        for (s, &slot) in m.seqs.iter().zip(&slots).filter(|(_, &slot)| slot != iris::batch::NO_SLOT) {
            let (slot, rows) = (slot as usize, s.q_start..s.q_start + s.q_len);
            let (cs, ss) = (&mut conv_ref[slot * cl..(slot + 1) * cl], &mut ssm_ref[slot * sl..(slot + 1) * sl]);
            if s.first_position() == 0 {
                cs.fill(0.0);
                ss.fill(0.0);
            }
            let out = run_sequence(
                &dims,
                &p,
                cs,
                ss,
                &qkv[rows.start * c..rows.end * c],
                &a[rows.start * hv..rows.end * hv],
                &b[rows.start * hv..rows.end * hv],
            );
            o_ref[rows.start * hv * dv..rows.end * hv * dv].copy_from_slice(&out);
        }
        // The device.
        m.upload(&dev).unwrap();
        let on = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &dev).unwrap();
        let params = DeviceDeltaParams {
            conv_weight: on(&conv_w, &[c, 4]),
            neg_a: on(&neg_a, &[hv]),
            dt_bias: on(&dt_bias, &[hv]),
        };
        let conv = on(&conv0, &[slots_total, 3, c]);
        let ssm = on(&ssm0, &[slots_total, hv, dk, dv]);
        let dm = m.device.as_ref().unwrap();
        let o = run_step(&dims, &params, &conv, &ssm, dm, &on(&qkv, &[t, c]), &on(&a, &[t, hv]), &on(&b, &[t, hv]))
            .unwrap();
        let cpu = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
        let what = format!("Hk {hk} Hv {hv} Dk {dk} Dv {dv}");
        let e = max_rel_err(&o, &cpu(&o_ref, &[t, hv * dv]));
        assert!(e < 1e-4, "{what}: output rel err {e}");
        let pad = m.seqs.last().unwrap();
        let o_host: Vec<f32> = o.flatten_all().unwrap().to_vec1().unwrap();
        assert!(o_host[pad.q_start * hv * dv..].iter().all(|&x| x == 0.0), "{what}: padding rows are zero");
        let e = max_rel_err(&conv, &cpu(&conv_ref, &[slots_total, 3, c]));
        assert!(e < 1e-6, "{what}: conv state rel err {e}");
        let e = max_rel_err(&ssm, &cpu(&ssm_ref, &[slots_total, hv, dk, dv]));
        assert!(e < 1e-4, "{what}: delta state rel err {e}");
        // The unheld slot and the padding's kept their poison exactly.
        let free = perm[seqs.len()] as usize;
        let ssm_host: Vec<f32> = ssm.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(
            &ssm_host[free * sl..(free + 1) * sl],
            &ssm0[free * sl..(free + 1) * sl],
            "{what}: a free slot is kept"
        );
    }
}
