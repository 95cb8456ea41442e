//! The mixture-of-experts kernels (routing, experts) against their CPU reference. Compiled only with `--features cuda`;
//! run on a GPU machine by scripts/gpu-check.sh (IRIS_REQUIRE_GPU=1 turns a missing GPU into a
//! failure instead of a skip).
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::cuda::{gpu, max_rel_err, random};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

fn moe_config(c: &MoeCase) -> iris::config::MoeConfig {
    iris::config::MoeConfig {
        scoring: iris::config::MoeScoring::SigmoidGrouped,
        shared_intermediate_size: c.inter * c.shared,
        shared_expert_gate: false,
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
    use iris::config::Activation;
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
