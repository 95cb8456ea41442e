//! Each CUDA kernel against its CPU reference op, on the same inputs. Compiled only with
//! `--features cuda`; run on a GPU machine by scripts/gpu-check.sh (IRIS_REQUIRE_GPU=1 turns a
//! missing GPU into a failure instead of a skip).
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use iris::batch::{AttentionMeta, SeqSlice};
use iris::ops::kv_write::KvWrite;
use iris::ops::paged_attention::PagedAttention;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn gpu() -> Option<Device> {
    match iris::device::open("cuda") {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("IRIS_REQUIRE_GPU").is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn random(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Sequences `(context_len, q_len)` over blocks handed out in shuffled order.
fn meta(rng: &mut StdRng, seqs: &[(usize, usize)], block_size: usize) -> (AttentionMeta, usize) {
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

fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let diff = (&a - &b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(diff.is_finite(), "non-finite output");
    diff / scale.max(1e-12)
}

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
}

/// Decodes (one of them a first token, some past one chunk of 256 keys), a whole prompt, and
/// prompt chunks over a cached prefix, all in one launch.
const SEQS: [(usize, usize); 8] = [(1, 1), (17, 1), (256, 1), (257, 1), (700, 1), (40, 40), (300, 45), (33, 7)];
/// Few rows (rows x kv heads < 128): one head per block, the lane-split kernel (`paged_decode`).
const FEW_ROWS: [(usize, usize); 7] = [(1, 1), (17, 1), (256, 1), (257, 1), (700, 1), (2000, 1), (33, 7)];

fn check_attention(dev: &Device, c: &Case, q_dt: DType, cache_dt: DType, tol: f32) {
    check_attention_on(dev, &SEQS, c, q_dt, cache_dt, tol);
    check_attention_on(dev, &FEW_ROWS, c, q_dt, cache_dt, tol);
}

fn check_attention_on(dev: &Device, seqs: &[(usize, usize)], c: &Case, q_dt: DType, cache_dt: DType, tol: f32) {
    let mut rng = StdRng::seed_from_u64((c.heads * 1000 + c.head_dim) as u64);
    let bs = 16;
    let (mut m, slots) = meta(&mut rng, seqs, bs);
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
    };
    let gpu = op.forward(&q.to_device(dev).unwrap(), &k.to_device(dev).unwrap(), &v.to_device(dev).unwrap()).unwrap();
    assert_eq!(gpu.dtype(), q_dt);
    assert_eq!(gpu.dims(), cpu.dims());
    let e = max_rel_err(&gpu, &cpu);
    assert!(
        e <= tol,
        "paged attention {}x{}x{d} window {:?} softcap {:?}, q {q_dt:?} cache {cache_dt:?}, {} rows: rel err {e}",
        c.heads,
        c.kv_heads,
        c.window,
        c.softcap,
        m.num_rows()
    );
}

fn cases() -> Vec<Case> {
    let c = |heads, kv_heads, head_dim| Case { heads, kv_heads, head_dim, window: None, softcap: None };
    vec![
        c(4, 4, 64),
        c(8, 2, 80),
        c(12, 4, 96),
        c(28, 4, 128),
        c(32, 2, 256),
        c(9, 3, 64),
        c(4, 2, 16),
        Case { window: Some(7), softcap: Some(30.0), ..c(4, 1, 32) },
        Case { window: Some(300), ..c(14, 2, 64) },
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

/// The device draw picks exactly the host reference's token (same u, same integer masses) for
/// temperatures, top-k (with ties at the cut-off), top-p, min-p and their mixes, over a real
/// vocabulary size and a small one, with coarse logits (many ties), masks and NaN.
#[test]
fn sample_matches_cpu_exactly() {
    use iris::ops::sample::{Draw, Sample, PARAMS_PER_ROW};
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
        let cpu: Vec<u32> = Sample::forward(&logits, &params).unwrap().to_vec1().unwrap();
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
    }
}

/// Seeded sampling requests give the same tokens on the GPU (drawn there, graphs included) as
/// on the CPU (drawn on the host), f32 models, several requests at once.
#[test]
fn seeded_sampling_gives_the_cpu_tokens() {
    use iris::engine::build::{build_engine, EngineOptions};
    let Some(dev) = gpu() else { return };
    let _gpu = common::gpu_lock();
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
                ((0..3 + 4 * i).map(|t| 5 + t * 3).collect::<Vec<u32>>(), p)
            })
            .collect();
        let arrivals = [0, 0, 1, 2, 2, 5];
        let run = |d: &Device| {
            let mut e = build_engine(&path, d, &EngineOptions::default()).unwrap().0;
            common::run_requests(&mut e, &reqs, &arrivals)
        };
        let (cpu, gpu) = (run(&Device::Cpu), run(&dev));
        assert_eq!(gpu, cpu, "{name}");
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
        for gelu in [false, true] {
            let op = GatedAct { gelu };
            let cpu = op.forward(&g(&y).to_dtype(DType::F32).unwrap()).unwrap();
            let gpu = op.forward(&g(&y).to_device(&dev).unwrap()).unwrap();
            let e = max_rel_err(&gpu, &cpu);
            assert!(e <= tol, "gated-act gelu={gelu} {dt:?}: rel err {e}");
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

/// Router logits that make ties common: rows on a coarse grid, rows of one repeated value, rows
/// of plain uniform values and rows far out in the sigmoid's tails (+-120).
fn router_logits(rng: &mut StdRng, rows: usize, experts: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * experts);
    for r in 0..rows {
        let same = rng.random_range(-3.0f32..3.0);
        for _ in 0..experts {
            v.push(match r % 4 {
                0 => rng.random_range(-4.0f32..4.0),
                1 => rng.random_range(-8i32..=8) as f32 * 0.5,
                2 => same,
                _ => rng.random_range(-120.0f32..120.0),
            });
        }
    }
    v
}

/// The routing kernel against the host definition on the same logits: the same experts (ties
/// included) and the same weights, over GLM-4.5V-like and other group / top-k settings.
#[test]
fn moe_routing_matches_cpu_exactly() {
    use iris::ops::moe_route::RouteConfig;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(6);
    let rc = |top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor| RouteConfig {
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
    };
    let cases = [
        (8, rc(2, 4, 2, true, 2.5)),
        (8, rc(8, 1, 1, false, 1.0)),
        (64, rc(6, 8, 4, true, 1.0)),
        (64, rc(4, 8, 8, false, 2.5)),
        (128, rc(8, 8, 4, true, 2.5)),
        (128, rc(32, 1, 1, true, 1.0)),
        (160, rc(6, 8, 3, false, 16.0)),
        (160, rc(8, 32, 4, true, 1.5)),
    ];
    let rows = 301;
    for (e, cfg) in cases {
        let logits = router_logits(&mut rng, rows, e);
        let biases = [
            vec![0.0f32; e],
            (0..e).map(|_| rng.random_range(-4i32..=4) as f32 * 0.125).collect::<Vec<_>>(),
            (0..e).map(|_| rng.random_range(-0.3f32..0.3)).collect(),
        ];
        for (bi, bias) in biases.iter().enumerate() {
            let l = Tensor::from_slice(&logits, (rows, e), &Device::Cpu).unwrap();
            let b = Tensor::from_slice(bias, e, &Device::Cpu).unwrap();
            let cpu = cfg.route(&l, &b).unwrap().to_host().unwrap();
            let routed = cfg.route(&l.to_device(&dev).unwrap(), &b.to_device(&dev).unwrap()).unwrap();
            assert!(routed.experts.device().is_cuda(), "the routing ran on the host");
            let gpu = routed.to_host().unwrap();
            let k = cfg.top_k;
            for r in 0..rows {
                let row = r * k..(r + 1) * k;
                let (ce, ge) = (&cpu.0[row.clone()], &gpu.0[row.clone()]);
                let (cw, gw) = (&cpu.1[row.clone()], &gpu.1[row]);
                let weights_close = cw.iter().zip(gw).all(|(c, g)| (c - g).abs() <= 1e-6 * c.abs());
                assert!(
                    ce == ge && weights_close,
                    "{e} experts {cfg:?} bias #{bi}, row {r}: cpu {ce:?} {cw:?}, gpu {ge:?} {gw:?}; logits {:?}",
                    &logits[r * e..(r + 1) * e]
                );
            }
        }
    }
}

/// A MoE layer's weights (`mlp.*`, f32) written to `dir/model.safetensors`.
fn write_moe_weights(rng: &mut StdRng, dir: &std::path::Path, h: usize, i: usize, e: usize, shared: usize) {
    let mut t = std::collections::HashMap::new();
    let scaled = |rng: &mut StdRng, shape: &[usize], s: f32| (random(rng, shape) * s as f64).unwrap();
    t.insert("mlp.gate.weight".to_string(), scaled(rng, &[e, h], 0.5));
    t.insert("mlp.gate.e_score_correction_bias".to_string(), scaled(rng, &[e], 0.1));
    let (wi, wo) = (1.0 / (h as f32).sqrt(), 1.0 / (i as f32).sqrt());
    for j in 0..e {
        t.insert(format!("mlp.experts.{j}.gate_proj.weight"), scaled(rng, &[i, h], wi));
        t.insert(format!("mlp.experts.{j}.up_proj.weight"), scaled(rng, &[i, h], wi));
        t.insert(format!("mlp.experts.{j}.down_proj.weight"), scaled(rng, &[h, i], wo));
    }
    if shared > 0 {
        let s = shared * i;
        t.insert("mlp.shared_experts.gate_proj.weight".to_string(), scaled(rng, &[s, h], wi));
        t.insert("mlp.shared_experts.up_proj.weight".to_string(), scaled(rng, &[s, h], wi));
        t.insert("mlp.shared_experts.down_proj.weight".to_string(), scaled(rng, &[h, s], wo));
    }
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
}

/// Where two `[T, H]` outputs differ most: "row r col c: got g, want w".
fn worst_place(got: &Tensor, want: &Tensor) -> String {
    let f = |t: &Tensor| -> Vec<Vec<f32>> {
        t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().to_vec2().unwrap()
    };
    let (g, w) = (f(got), f(want));
    let mut worst = (0, 0, -1.0f32);
    for (r, (gr, wr)) in g.iter().zip(&w).enumerate() {
        for (c, (a, b)) in gr.iter().zip(wr).enumerate() {
            let d = if (a - b).is_nan() { f32::INFINITY } else { (a - b).abs() };
            if d > worst.2 {
                worst = (r, c, d);
            }
        }
    }
    let (r, c, _) = worst;
    format!("row {r} col {c}: got {}, want {}", g[r][c], w[r][c])
}

struct MoeCase {
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    n_group: usize,
    topk_group: usize,
    shared: usize,
}

const MOE_CASES: [MoeCase; 3] = [
    // The tiny GLM-4.5V fixture's shape.
    MoeCase { hidden: 64, inter: 32, experts: 8, top_k: 2, n_group: 4, topk_group: 2, shared: 1 },
    MoeCase { hidden: 128, inter: 48, experts: 64, top_k: 6, n_group: 8, topk_group: 4, shared: 2 },
    // Widths that are not whole 16-byte vectors (the kernels' scalar loops).
    MoeCase { hidden: 50, inter: 14, experts: 16, top_k: 4, n_group: 1, topk_group: 1, shared: 0 },
];

fn moe_config(c: &MoeCase) -> iris::models::config::MoeConfig {
    iris::models::config::MoeConfig {
        num_experts: c.experts,
        top_k: c.top_k,
        n_group: c.n_group,
        topk_group: c.topk_group,
        intermediate_size: c.inter,
        n_shared_experts: c.shared,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
        first_k_dense_replace: 0,
    }
}

fn load_moe(c: &MoeCase, dir: &std::path::Path, dev: &Device, dt: DType) -> iris::layers::moe::Moe {
    use iris::models::config::Activation;
    use iris::weights::{SafetensorsDir, Weights};
    let cfg = moe_config(c);
    let w = Weights::from_safetensors(SafetensorsDir::open(dir).unwrap(), dev.clone(), dt);
    iris::layers::moe::Moe::load(&w, "mlp", c.hidden, &cfg, Activation::Silu).unwrap()
}

fn moe_dir(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("iris-cuda-ops-{}-{name}", std::process::id()))
}

/// The device expert kernel (stacked experts, grouping, projections, weighted sum on the GPU)
/// against the CPU layer (one GatedMlp per expert, rows grouped by expert on the host), with the
/// same routing (the CPU's, moved to the GPU), shared experts included: f32 to 1e-5, bf16 within
/// its rounding (the CPU layer run in bf16 on the same bf16 values). T = 300 is past
/// DEVICE_ROWS: the GPU groups on the host there, over slices of the stacked weights.
#[test]
fn moe_experts_match_the_cpu_layer() {
    use iris::layers::moe::{Routing, DEVICE_ROWS};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    assert!(DEVICE_ROWS < 300);
    for (ci, c) in MOE_CASES.iter().enumerate() {
        let dir = moe_dir(&format!("experts-{ci}"));
        write_moe_weights(&mut rng, &dir, c.hidden, c.inter, c.experts, c.shared);
        for dt in [DType::F32, DType::BF16] {
            let cpu_moe = load_moe(c, &dir, &Device::Cpu, dt);
            let gpu_moe = load_moe(c, &dir, &dev, dt);
            for t in [1, 3, 17, 64, 300] {
                let x = random(&mut rng, &[t, c.hidden]).to_dtype(dt).unwrap();
                let routing = cpu_moe.route(&x).unwrap();
                let cpu = cpu_moe.forward(&x, &routing).unwrap();
                let on_gpu = Routing {
                    experts: routing.experts.to_device(&dev).unwrap(),
                    weights: routing.weights.to_device(&dev).unwrap(),
                };
                let gpu = gpu_moe.forward(&x.to_device(&dev).unwrap(), &on_gpu).unwrap();
                assert_eq!((gpu.dims(), gpu.dtype()), (cpu.dims(), dt));
                let tol = if dt == DType::F32 { 1e-5 } else { 2e-2 };
                let e = max_rel_err(&gpu, &cpu);
                assert!(
                    e <= tol,
                    "moe experts case {ci} ({}x{}, {} experts top {}) {dt:?} T={t}: rel err {e}, worst at {}; \
                     routing {:?}",
                    c.hidden,
                    c.inter,
                    c.experts,
                    c.top_k,
                    worst_place(&gpu, &cpu),
                    routing.to_host().unwrap().0.chunks(c.top_k).take(4).collect::<Vec<_>>()
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The whole layer on the GPU (router matmul, routing kernel, experts kernel): its choices are
/// exactly the host definition's on the same router logits (the layer's f32 matmul, redone
/// here; the CPU's own matmul may round near-ties differently), and its output matches the CPU
/// layer's under that routing to 1e-5. And the experts kernel gives each row the same bits alone
/// as among 64 (with the same routing, and no shared expert: cuBLAS, which the router and
/// shared-expert matmuls use, may pick another kernel for another row count).
#[test]
fn moe_layer_on_the_gpu_matches_cpu_and_is_batch_invariant() {
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(8);
    for (ci, c) in MOE_CASES.iter().enumerate() {
        let dir = moe_dir(&format!("layer-{ci}"));
        write_moe_weights(&mut rng, &dir, c.hidden, c.inter, c.experts, c.shared);
        let cpu_moe = load_moe(c, &dir, &Device::Cpu, DType::F32);
        let gpu_moe = load_moe(c, &dir, &dev, DType::F32);
        let x = random(&mut rng, &[64, c.hidden]);
        let xg = x.to_device(&dev).unwrap();
        let gr = gpu_moe.route(&xg).unwrap();
        let stored = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        let router = stored["mlp.gate.weight"].to_device(&dev).unwrap();
        let logits = xg.matmul(&router.t().unwrap()).unwrap().to_device(&Device::Cpu).unwrap();
        let bias = &stored["mlp.gate.e_score_correction_bias"];
        let want = iris::ops::moe_route::RouteConfig::from(&moe_config(c)).route(&logits, bias).unwrap();
        let (we, ge) = (want.to_host().unwrap(), gr.to_host().unwrap());
        assert_eq!(ge.0, we.0, "case {ci}: experts chosen by the GPU layer vs the host definition");
        for (r, (g, w)) in ge.1.iter().zip(&we.1).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs(), "case {ci}: weight {r} of the GPU layer {g}, host {w}");
        }
        let cpu = cpu_moe.forward(&x, &want).unwrap();
        let gpu = gpu_moe.forward(&xg, &gr).unwrap();
        let e = max_rel_err(&gpu, &cpu);
        assert!(e <= 1e-5, "case {ci}: layer rel err {e}, worst at {}", worst_place(&gpu, &cpu));
        if c.shared == 0 {
            let all: Vec<Vec<f32>> = gpu.to_vec2().unwrap();
            for r in [0, 1, 31, 63] {
                let one = iris::layers::moe::Routing {
                    experts: gr.experts.narrow(0, r, 1).unwrap(),
                    weights: gr.weights.narrow(0, r, 1).unwrap(),
                };
                let alone: Vec<Vec<f32>> =
                    gpu_moe.forward(&xg.narrow(0, r, 1).unwrap(), &one).unwrap().to_vec2().unwrap();
                assert_eq!(alone[0], all[r], "case {ci}: row {r} alone differs from row {r} of 64");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The layer's decode-sized step captured as a CUDA graph (as engine/cuda_graph.rs captures a
/// decode step): capturing must succeed (no host copy inside), and replaying the graph on new
/// input rows must give what running the layer op by op gives for them, bit for bit.
#[test]
fn moe_layer_step_is_graph_capturable() {
    use candle_core::cuda_backend::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(9);
    let c = &MOE_CASES[1];
    let dir = moe_dir("graph");
    write_moe_weights(&mut rng, &dir, c.hidden, c.inter, c.experts, c.shared);
    let moe = load_moe(c, &dir, &dev, DType::F32);
    let t = 8;
    let (x1, x2) = (random(&mut rng, &[t, c.hidden]), random(&mut rng, &[t, c.hidden]));
    let input = x1.to_device(&dev).unwrap();
    let output = Tensor::zeros((t, c.hidden), DType::F32, &dev).unwrap();
    let pass = || -> candle_core::Result<()> {
        let y = moe.forward(&input, &moe.route(&input)?)?;
        output.slice_set(&y, 0, 0)
    };
    let cuda = dev.as_cuda_device().unwrap();
    let graph = {
        let _setup = iris::device::cuda_setup_lock();
        let _cache = cuda.enable_cuda_graph_htod_cache();
        pass().unwrap();
        let stream = cuda.cuda_stream();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
        let captured = pass();
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured.unwrap_or_else(|e| panic!("the MoE step failed while being captured: {e}"));
        graph.unwrap_or_else(|e| panic!("capturing the MoE step: {e:?}")).expect("a captured graph")
    };
    input.slice_set(&x2.to_device(&dev).unwrap(), 0, 0).unwrap();
    graph.launch().unwrap();
    let replayed: Vec<Vec<f32>> = output.to_vec2().unwrap();
    let xg = x2.to_device(&dev).unwrap();
    let direct: Vec<Vec<f32>> = moe.forward(&xg, &moe.route(&xg).unwrap()).unwrap().to_vec2().unwrap();
    assert_eq!(replayed, direct, "the replayed graph differs from the op-by-op layer on the same rows");
    std::fs::remove_dir_all(&dir).ok();
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

/// A layer's TurboQuant codecs for head dim `d` (rotations seeded by the layer, as served),
/// with key scales (positive, unequal per channel) when `scaled`.
fn tq_codecs(d: usize, hkv: usize, bits: (u8, u8), scaled: bool) -> iris::kv::turboquant::LayerCodecs {
    use iris::kv::turboquant::{Codebook, LayerCodecs};
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
    use iris::kv::turboquant::pack::code_at;
    use iris::ops::tq_write::{TqWrite, TqWriteDevice};
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
/// prompt and prompt chunks over a cached prefix; f32 queries within 1e-4, bf16 within bf16.
fn check_tq_attention(dev: &Device, c: &TqCase, q_dt: DType, ring_dt: DType, tol: f32) {
    use iris::ops::tq_attention::{FloatInputs, TqAttention};
    use iris::ops::tq_write::TqWrite;
    let mut rng = StdRng::seed_from_u64((c.heads * 1000 + c.head_dim + c.float_window) as u64);
    let (bs, d, hkv) = (16, c.head_dim, c.kv_heads);
    let seqs = [(1, 1), (17, 1), (700, 1), (3000, 1), (40, 40), (300, 45), (33, 7)];
    let (mut m, slots) = meta(&mut rng, &seqs, bs);
    m.window_rings = (0..seqs.len() as u32).rev().collect();
    let codecs = tq_codecs(d, hkv, c.bits, c.scaled);
    let all: Vec<u32> = (0..slots as u32).collect();
    let write = |codec: &iris::kv::turboquant::TqCodec, scale: Option<&[f32]>| {
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
    };
    let cpu = TqAttention {
        attn: paged(&m),
        key: &codecs.key,
        value: &codecs.value,
        key_scale: codecs.key_scale.as_deref(),
        float: (fw > 0).then_some(FloatInputs {
            len: fw,
            ring_k: &ring_k,
            ring_v: &ring_v,
            new_k: &new_k,
            new_v: &new_v,
            rings: None,
        }),
        device: None,
    }
    .forward(&q, &kc, &vc)
    .unwrap();
    let mut mg = m.clone();
    mg.upload(dev).unwrap();
    let g = |t: &Tensor| t.to_device(dev).unwrap();
    let gq = |t: &Tensor| t.to_dtype(q_dt).unwrap().to_device(dev).unwrap();
    let on_gpu = codecs.upload(dev).unwrap();
    let rings = Tensor::new(mg.window_rings.as_slice(), dev).unwrap();
    let (gnk, gnv, grk, grv) = (gq(&new_k), gq(&new_v), g(&ring_k), g(&ring_v));
    let gpu_op = TqAttention {
        attn: paged(&mg),
        key: &codecs.key,
        value: &codecs.value,
        key_scale: codecs.key_scale.as_deref(),
        float: (fw > 0).then_some(FloatInputs {
            len: fw,
            ring_k: &grk,
            ring_v: &grv,
            new_k: &gnk,
            new_v: &gnv,
            rings: Some(&rings),
        }),
        device: Some(&on_gpu),
    };
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
        TqCase { float_window: 600, ..c(6, 2, 16, (4, 3)) },
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
