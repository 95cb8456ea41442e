//! Automatic prefix caching never changes what a request gets: for every text fixture family
//! (Gemma 3's sliding-window layers included), dense f32 and TurboQuant caches, with n-gram
//! speculation, and for the vision-language fixtures with shared and with different images,
//! each request's greedy tokens and their logprobs are the same with the cache as without it,
//! in mixed batches with chunked prefill and preemption, in a pool too small for what is
//! cached (eviction), with cancellations. Each case also checks that the cache was used
//! (cached tokens > 0, and exact counts where the schedule is sequential) so it cannot pass
//! vacuously, and that every block's reference count is back at zero at the end.
//!
//! Hybrid models (Qwen3.5) and TurboQuant float windows cannot be served exactly from shared
//! blocks: the builder refuses `--enable-prefix-caching` for them and turns it off by default.

mod common;

use common::*;
use iris::engine::build::{build_engine, EngineOptions};
use iris::engine::prefix::MIN_COMPUTED;
use iris::engine::{Engine, ImageInput, Request, Sampled, SamplingParams, SpeculativeConfig};
use iris::kv::{KvCacheSpec, KvDtype, TqBits, TqSpec};

const BS: usize = 4;

/// One request: its prompt, params, images, the step it arrives at, and the step it is
/// cancelled at (None: runs to the end).
#[derive(Clone)]
struct Req {
    prompt: Vec<u32>,
    params: SamplingParams,
    images: Vec<ImageInput>,
    arrives: usize,
    cancel: Option<usize>,
}

impl Req {
    fn text(prompt: Vec<u32>, max_tokens: usize, arrives: usize) -> Self {
        let params = SamplingParams { logprobs: Some(3), ..greedy(max_tokens) };
        Req { prompt, params, images: Vec::new(), arrives, cancel: None }
    }
}

/// What each request got: its tokens with their logprobs, and its cached prompt tokens.
#[derive(Debug)]
struct Got {
    tokens: Vec<Vec<Sampled>>,
    cached: Vec<usize>,
    prompt_logprobs: Vec<Vec<Sampled>>,
}

fn run(engine: &mut Engine, reqs: &[Req]) -> Got {
    let n = reqs.len();
    let mut ids = vec![None; n];
    let mut got = Got { tokens: vec![Vec::new(); n], cached: vec![0; n], prompt_logprobs: vec![Vec::new(); n] };
    let mut done = vec![false; n];
    let mut step = 0;
    while done.iter().any(|d| !d) {
        for (i, r) in reqs.iter().enumerate() {
            if ids[i].is_none() && r.arrives <= step {
                let req = Request { prompt_tokens: r.prompt.clone(), params: r.params.clone() };
                ids[i] = Some(engine.add_request_with_images(req, r.images.clone()).unwrap());
            }
            if let (Some(id), Some(at)) = (ids[i], r.cancel) {
                if at == step && !done[i] {
                    assert!(engine.abort(id), "request {i} should still be live at step {at}");
                    done[i] = true;
                }
            }
        }
        for u in engine.step().unwrap() {
            let i = ids.iter().position(|x| *x == Some(u.id)).unwrap();
            got.cached[i] = u.num_cached_tokens;
            if let Some(p) = u.prompt_logprobs {
                got.prompt_logprobs[i] = p;
            }
            got.tokens[i].extend(u.token);
            done[i] |= u.finish.is_some();
        }
        step += 1;
        assert!(step < 100_000, "engine did not finish");
        if ids.iter().all(Option::is_some) && !engine.has_work() {
            assert!(done.iter().all(|d| *d), "the engine is idle with requests unfinished");
        }
    }
    let a = &engine.scheduler().allocator;
    assert_eq!(a.total_refs(), 0, "a block is still referenced after every request ended");
    assert_eq!(a.num_free(), a.num_blocks(), "a block leaked");
    got
}

/// How close two runs' logprobs must be.
#[derive(Clone, Copy, Debug)]
enum Exact {
    /// The same bits: the rows that differ between the runs were computed in steps of the same
    /// kind (a prompt's rows, several at a time).
    Bits,
    /// Within `LOGPROB_TOL`: some keys were computed in steps of other sizes in the two runs (a
    /// decode step's one row against a prompt chunk's many, chunks cut elsewhere in a mixed
    /// batch). A CPU matmul rounds a row among fewer than ~5 rows differently, so their last
    /// bits may differ, as they do without the cache between a sequence preempted (its output
    /// recomputed as a prompt) and one that was not. A wrong key (another image, position or
    /// prefix) moves logprobs by far more.
    Close,
}

/// The runs here differ by at most 6e-6 (logprobs of magnitude 1-6), 2.0e-5 for Gemma 4's
/// fixtures; a wrong key moves them by 1e-2 and more.
const LOGPROB_TOL: f32 = 4e-5;

/// Tokens (always exactly) and their logprobs (as `exact(i)` says) of requests with and
/// without the cache.
fn assert_same(what: &str, with: &Got, without: &Got, reqs: &[Req], exact: impl Fn(usize) -> Exact) {
    let mut worst = 0f32;
    for (i, r) in reqs.iter().enumerate() {
        if r.cancel.is_some() {
            continue;
        }
        let (a, b) = (&with.tokens[i], &without.tokens[i]);
        let ids = |s: &[Sampled]| s.iter().map(|t| t.token).collect::<Vec<_>>();
        assert_eq!(ids(a), ids(b), "{what}: request {i} gives other tokens with the prefix cache");
        // On a GPU, cuBLAS rounds a row by the shape of its step (the tokens stay equal), so
        // what is exact on the CPU is close there.
        let exact_here = |i: usize| if on_gpu() { Exact::Close } else { exact(i) };
        let mut close = |x: f32, y: f32, at: &str| match exact_here(i) {
            Exact::Bits => assert_eq!(x.to_bits(), y.to_bits(), "{what}: request {i} {at}: {x} against {y}"),
            Exact::Close => {
                worst = worst.max((x - y).abs());
                assert!((x - y).abs() <= LOGPROB_TOL, "{what}: request {i} {at}: {x} against {y}");
            }
        };
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            close(x.logprob, y.logprob, &format!("token {k}"));
            let top = |s: &Sampled| s.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(top(x), top(y), "{what}: request {i} token {k}: top tokens");
            for ((_, p), (_, q)) in x.top_logprobs.iter().zip(&y.top_logprobs) {
                close(*p, *q, &format!("token {k}, top logprob"));
            }
        }
        let (p, q) = (&with.prompt_logprobs[i], &without.prompt_logprobs[i]);
        assert_eq!(p.len(), q.len(), "{what}: request {i}: prompt logprobs");
        for (k, (x, y)) in p.iter().zip(q).enumerate() {
            assert_eq!(x.token, y.token);
            close(x.logprob, y.logprob, &format!("prompt token {k}"));
        }
    }
    eprintln!("{what}: largest logprob difference {worst:e}");
}

fn rng(seed: u64, vocab: u32) -> impl FnMut() -> u32 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % (vocab as u64 - 10)) as u32 + 5
    }
}

/// Prompts that share prefixes in every way the cache must handle: a 37-token system prefix
/// (9 full blocks and one token) behind different questions, a prompt repeated whole, one of
/// exactly 9 blocks (its last token must still be computed), one sharing only part of the
/// prefix, a second turn holding the first turn's answer, an unrelated one, and one that asks
/// for prompt logprobs (which must compute its whole prompt). `first_answer` is request 0's
/// output without the cache (for the second turn).
fn text_requests(vocab: u32, first_answer: &[u32]) -> Vec<Req> {
    let mut next = rng(0x9e3779b97f4a7c15, vocab);
    let mut take = |n: usize| (0..n).map(|_| next()).collect::<Vec<u32>>();
    // Repeats (a unit of 9 tokens) give the n-gram drafter matches to propose.
    let unit = take(9);
    let sys: Vec<u32> = unit.iter().copied().cycle().take(37).collect();
    let q: Vec<Vec<u32>> = (0..4).map(|i| take(3 + 4 * i)).collect();
    let cat = |a: &[u32], b: &[u32]| [a, b].concat();
    let r0 = cat(&sys, &q[0]);
    let turn2 = cat(&cat(&r0, first_answer), &q[2]);
    let mut with_prompt_logprobs = Req::text(cat(&sys, &q[1]), 6, 0);
    with_prompt_logprobs.params.prompt_logprobs = Some(2);
    // Request 0's prompt and answer end on a block boundary (40 + 8): the answer's last token
    // is never computed, so the block holding it must not be published.
    vec![
        Req::text(r0.clone(), 8, 0),
        Req::text(cat(&sys, &q[1]), 12, 0),
        Req::text(r0, 8, 0),
        Req::text(sys[..36].to_vec(), 9, 0),
        Req::text(cat(&sys[..21], &q[3]), 7, 0),
        Req::text(turn2, 10, 0),
        Req::text(take(23), 8, 0),
        with_prompt_logprobs,
    ]
}

fn opts_for(name: &str, quant: Option<TqBits>, blocks: usize, spec: Option<SpeculativeConfig>) -> EngineOptions {
    let cfg = iris::loader::read_config(&fixture(name)).unwrap().1;
    let per_token = match quant {
        Some(bits) => TqSpec::new(bits).bytes_per_token(&cfg, KvDtype::F32),
        None => KvCacheSpec::bytes_per_token(&cfg, KvDtype::F32),
    };
    EngineOptions {
        kv_memory: Some((blocks * BS * per_token) as u64),
        kv_quant: quant,
        block_size: BS,
        max_num_batched_tokens: 16,
        max_num_seqs: 6,
        max_model_len: Some(96),
        speculative: spec,
        ..Default::default()
    }
}

fn with_cache(o: &EngineOptions, on: bool) -> EngineOptions {
    EngineOptions { enable_prefix_caching: Some(on), ..o.clone() }
}

/// Sequential (each request alone, one after another, plenty of memory): the cached counts
/// are exact. Then mixed (arrivals over time, chunked prefill, a pool that forces preemption):
/// outputs equal, hits counted.
fn check_text(name: &str, quant: Option<TqBits>, spec: Option<SpeculativeConfig>) {
    let _gpu = gpu_lock();
    let path = fixture(name);
    let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
    let what = format!("{name} {quant:?} {spec:?}");
    let big = opts_for(name, quant, 400, spec);
    let first = {
        let reqs = text_requests(vocab, &[]);
        run(&mut engine_with(&path, with_cache(&big, false)), &reqs[..1]).tokens.remove(0)
    };
    let answer: Vec<u32> = first.iter().map(|s| s.token).collect();
    let mut reqs = text_requests(vocab, &answer);

    // Sequential: request i arrives once request i - 1 has finished.
    let mut e = engine_with(&path, with_cache(&big, true));
    let mut seq = Got { tokens: vec![], cached: vec![], prompt_logprobs: vec![] };
    for r in &reqs {
        let g = run(&mut e, std::slice::from_ref(r));
        seq.tokens.extend(g.tokens);
        seq.cached.extend(g.cached);
        seq.prompt_logprobs.extend(g.prompt_logprobs);
    }
    let mut off = Got { tokens: vec![], cached: vec![], prompt_logprobs: vec![] };
    let mut e_off = engine_with(&path, with_cache(&big, false));
    for r in &reqs {
        let g = run(&mut e_off, std::slice::from_ref(r));
        off.tokens.extend(g.tokens);
        off.cached.extend(g.cached);
        off.prompt_logprobs.extend(g.prompt_logprobs);
    }
    assert!(off.cached.iter().all(|&c| c == 0), "{what}: cached tokens without the cache");
    assert_eq!(e_off.stats.prefix.queries, 0);
    // The system prefix's 9 full blocks; a repeat and a 36-token prompt the full blocks before
    // their last MIN_COMPUTED tokens (which are computed); the second turn the first turn's
    // prompt and answer but the last answer token (never computed), in full blocks.
    let r0 = reqs[0].prompt.len();
    let turn1 = (r0 + answer.len() - 1) / BS * BS;
    assert!(turn1 <= reqs[5].prompt.len() - MIN_COMPUTED);
    let want = [0, 36, (r0 - MIN_COMPUTED) / BS * BS, 28, 20, turn1, 0, 0];
    assert_eq!(seq.cached, want, "{what}: cached tokens per request");
    assert!(e.stats.prefix.hits > 0 && e.stats.prefix.hits == want.iter().sum::<usize>() as u64);
    // Bit for bit where every row either run computes was computed as a prompt chunk of 5 rows
    // or more: requests without hits (0, 6, 7), and 1 and 2 (cached: 36 of 44 and 32 of 40
    // tokens; the rest in one chunk; uncached: chunks of 16, 16 and 12 or 8). Request 3's
    // uncached run ends with a chunk of 4 rows (36 = 16 + 16 + 4), as does request 4's
    // (its cached run computes 16 in one), and the second turn (5) reads keys its first turn
    // computed while decoding, one row at a time.
    // Gemma 4's tiny fixtures round rows of chunks up to 6 rows differently from larger
    // chunks (measured with `forward_in_chunks`; Gemma 3's up to 4), and its MoE groups tokens
    // by expert: close, not bit for bit, there.
    let row_exact = !name.starts_with("tiny-gemma4");
    let exact = |i: usize| if [3, 4, 5].contains(&i) || !row_exact { Exact::Close } else { Exact::Bits };
    assert_same(&format!("{what} sequential"), &seq, &off, &reqs, exact);

    // Mixed: arrivals over time, 16-token steps, 30 blocks for up to 79-token sequences.
    for (r, at) in reqs.iter_mut().zip([0, 3, 5, 6, 6, 9, 10, 12]) {
        r.arrives = at;
    }
    let sequential_spec = e.stats.spec.clone();
    let small = opts_for(name, quant, 30, spec);
    let mut e = engine_with(&path, with_cache(&small, true));
    let with = run(&mut e, &reqs);
    let mut e_off = engine_with(&path, with_cache(&small, false));
    let without = run(&mut e_off, &reqs);
    assert!(e.stats.preemptions > 0, "{what}: the mixed run meant to force preemption");
    assert!(with.cached.iter().sum::<usize>() > 0, "{what}: no cache hit in the mixed run");
    if spec.is_some() {
        // Rejected drafts (whose keys are written, then overwritten) in both runs, accepted
        // ones (whose blocks are published) in at least one.
        for (run, s) in [("sequential", &sequential_spec), ("mixed", &e.stats.spec)] {
            assert!(s.num_accepted_tokens < s.num_draft_tokens, "{what} {run}: no draft was rejected");
        }
        let accepted = sequential_spec.num_accepted_tokens + e.stats.spec.num_accepted_tokens;
        assert!(accepted > 0, "{what}: no draft was accepted");
    }
    assert_eq!(with.cached[7], 0, "{what}: prompt logprobs must compute the whole prompt");
    assert_same(&format!("{what} mixed"), &with, &without, &reqs, |_| Exact::Close);
    assert_same(&format!("{what} mixed against sequential"), &with, &off, &reqs, |_| Exact::Close);
}

#[test]
fn llama_outputs_are_the_same_with_the_prefix_cache() {
    check_text("tiny-llama", None, None);
}

#[test]
fn qwen2_outputs_are_the_same_with_the_prefix_cache() {
    check_text("tiny-qwen2", None, None);
}

#[test]
fn qwen3_outputs_are_the_same_with_the_prefix_cache() {
    check_text("tiny-qwen3", None, None);
}

/// Sliding-window layers read only their window, but the blocks are the same blocks.
#[test]
fn gemma3_outputs_are_the_same_with_the_prefix_cache() {
    check_text("tiny-gemma3", None, None);
}

/// KV-sharing layers read the storing layers' blocks, cached or not.
#[test]
fn gemma4_outputs_are_the_same_with_the_prefix_cache() {
    check_text("tiny-gemma4-moe", None, None);
    check_text("tiny-gemma4", None, None);
}

/// TurboQuant codes of a position depend only on its key: shared code blocks read the same.
#[test]
fn turboquant_outputs_are_the_same_with_the_prefix_cache() {
    check_text("tiny-llama", Some(TqBits { key: 3, value: 4 }), None);
    check_text("tiny-qwen3", Some(TqBits { key: 3, value: 4 }), None);
}

/// Verify steps write keys for draft tokens that may be rejected; only committed tokens'
/// blocks are published.
#[test]
fn speculation_with_the_prefix_cache_keeps_outputs() {
    let spec = Some(SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    check_text("tiny-llama", None, spec);
    check_text("tiny-qwen3", None, spec);
}

/// A pool far too small for the cached working set: three system prompts take turns across
/// sixteen requests, two of them cancelled mid-prefill and mid-decode. Every request is
/// served, outputs equal the uncached run's, cached blocks were evicted and hit, and all
/// reference counts return to zero.
#[test]
fn eviction_under_memory_pressure_keeps_serving() {
    let _gpu = gpu_lock();
    let name = "tiny-qwen3";
    let path = fixture(name);
    let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
    let mut next = rng(42, vocab);
    let systems: Vec<Vec<u32>> = (0..3).map(|_| (0..33).map(|_| next()).collect()).collect();
    let mut reqs: Vec<Req> = (0..16)
        .map(|i| {
            let tail: Vec<u32> = (0..1 + i % 5).map(|_| next()).collect();
            Req::text([systems[i % 3].as_slice(), &tail].concat(), 6 + i % 4, i * 3)
        })
        .collect();
    reqs[4].cancel = Some(reqs[4].arrives + 1);
    reqs[9].cancel = Some(reqs[9].arrives + 6);
    // 20 blocks: three system prompts of 8 blocks each cannot all stay cached.
    let opts = EngineOptions { max_model_len: Some(64), ..opts_for(name, None, 20, None) };
    let mut e = engine_with(&path, with_cache(&opts, true));
    let with = run(&mut e, &reqs);
    let without = run(&mut engine_with(&path, with_cache(&opts, false)), &reqs);
    assert_same("eviction", &with, &without, &reqs, |_| Exact::Close);
    let a = &e.scheduler().allocator;
    assert!(a.num_evicted() > 0, "the pool was meant to be too small for the cache");
    assert!(e.stats.prefix.hits > 0, "no hit at all");
    assert!(a.num_cached() <= a.num_blocks());
    for (i, r) in reqs.iter().enumerate() {
        if r.cancel.is_none() {
            assert_eq!(with.tokens[i].len(), r.params.max_tokens, "request {i} was cut short");
        }
    }
}

/// Image prompts: the same image behind the same text shares every full block; a different
/// image of the same size behind the same text (the same token ids) shares only the text before
/// it; outputs are those of the uncached engine, sequentially and mixed with text prompts,
/// chunked prefill and preemption.
fn check_vl(name: &str) {
    let _gpu = gpu_lock();
    use iris::media::{decode_image, DecodeLimits};
    let path = fixture(name);
    let r = reference(name);
    let j = reference_json(name);
    let vision = iris::loader::load(&path, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap().vision.unwrap();
    let image = |file: &str, invert: bool| {
        let bytes = std::fs::read(path.join(file)).unwrap();
        let mut rgb = decode_image(&bytes, &DecodeLimits::default()).unwrap();
        if invert {
            rgb.data.iter_mut().for_each(|v| *v = 255 - *v);
        }
        ImageInput::new(vision.preprocess(&rgb).unwrap())
    };
    let case = |c: &str, invert: bool| -> Req {
        let images =
            j["cases"][c]["images"].as_array().unwrap().iter().map(|f| image(f.as_str().unwrap(), invert)).collect();
        let params = SamplingParams { logprobs: Some(2), ..greedy(6) };
        Req { prompt: ids(&r[&format!("{c}.input_ids")]), params, images, arrives: 0, cancel: None }
    };
    let single = case("single", false);
    let other = case("single", true);
    assert_eq!(single.prompt, other.prompt, "the same token ids, a different picture");
    assert_ne!(single.images[0].key, other.images[0].key);
    let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
    let mut next = rng(7, vocab - 64);
    let text = Req::text((0..29).map(|_| next()).collect(), 6, 0);
    let reqs = vec![single.clone(), other, single, case("multi", false), case("multi", false), text.clone(), text];
    let first_image = reqs[0].prompt.iter().position(|&t| t == vision.image_token_id()).unwrap();

    let big = EngineOptions { kv_memory: Some(64 << 20), block_size: BS, ..Default::default() };
    let one_by_one = |on: bool| {
        let mut e = engine_with(&path, with_cache(&big, on));
        let mut g = Got { tokens: vec![], cached: vec![], prompt_logprobs: vec![] };
        for r in &reqs {
            let x = run(&mut e, std::slice::from_ref(r));
            g.tokens.extend(x.tokens);
            g.cached.extend(x.cached);
            g.prompt_logprobs.extend(x.prompt_logprobs);
        }
        g
    };
    let (seq, off) = (one_by_one(true), one_by_one(false));
    let full = |i: usize| (reqs[i].prompt.len() - MIN_COMPUTED) / BS * BS;
    assert_eq!(seq.cached[0], 0);
    assert_eq!(seq.cached[1], first_image / BS * BS, "{name}: a different image shares only the text before it");
    assert_eq!(seq.cached[2], full(2), "{name}: the same image shares every full block");
    assert_eq!(seq.cached[4], full(4), "{name}: two images, the same two");
    assert_eq!(seq.cached[6], full(6));
    // Gemma 4: see check_text.
    let exact = if name.starts_with("tiny-gemma4") { Exact::Close } else { Exact::Bits };
    assert_same(&format!("{name} sequential"), &seq, &off, &reqs, |_| exact);

    let bytes_per_block = {
        let cfg = iris::loader::read_config(&path).unwrap().1;
        KvCacheSpec::bytes_per_token(&cfg, KvDtype::F32) * BS
    };
    let mut mixed = reqs.clone();
    for (r, at) in mixed.iter_mut().zip([0, 1, 4, 6, 9, 9, 12]) {
        r.arrives = at;
    }
    let longest = reqs.iter().map(|r| r.prompt.len()).max().unwrap();
    let small = EngineOptions {
        kv_memory: Some((((longest + 8) / BS + 4) * bytes_per_block) as u64),
        block_size: BS,
        max_num_batched_tokens: 16,
        max_num_seqs: 6,
        max_model_len: Some(longest + 8),
        ..Default::default()
    };
    let mut e = engine_with(&path, with_cache(&small, true));
    let with = run(&mut e, &mixed);
    let without = run(&mut engine_with(&path, with_cache(&small, false)), &mixed);
    assert!(e.stats.preemptions > 0, "{name}: the mixed run meant to force preemption");
    assert!(with.cached.iter().sum::<usize>() > 0, "{name}: no cache hit in the mixed run");
    assert_same(&format!("{name} mixed"), &with, &without, &mixed, |_| Exact::Close);
    assert_same(&format!("{name} mixed against sequential"), &with, &off, &mixed, |_| Exact::Close);
}

#[test]
fn qwen2_vl_images_share_blocks_by_content() {
    check_vl("tiny-qwen2-vl");
}

#[test]
fn gemma4_images_share_blocks_by_content() {
    check_vl("tiny-gemma4");
}

#[test]
fn glm4v_images_share_blocks_by_content() {
    check_vl("tiny-glm4v");
}

/// Where shared blocks cannot give exactly a sequence's own keys and state, caching is off by
/// default and refused when asked for, with a message that says why and what to do.
#[test]
fn hybrid_models_and_float_windows_refuse_prefix_caching() {
    let _gpu = gpu_lock();
    let base = EngineOptions { kv_memory: Some(1 << 20), block_size: BS, max_num_seqs: 2, ..Default::default() };
    let cases = [
        ("tiny-qwen3.5", base.clone(), "recurrent state"),
        (
            "tiny-llama",
            EngineOptions { kv_quant: Some(TqBits { key: 3, value: 4 }), kv_float_window: 4, ..base.clone() },
            "--kv-float-window",
        ),
    ];
    for (name, opts, why) in cases {
        let path = fixture(name);
        let err = match build_engine(&path, &device(), &with_cache(&opts, true)) {
            Ok(_) => panic!("{name}: --enable-prefix-caching was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(why) && err.contains("--no-enable-prefix-caching"), "{name}: {err}");
        let (e, report) = build_engine(&path, &device(), &opts).unwrap();
        assert!(!e.config().prefix_caching && !report.prefix_caching, "{name}: on by default");
        assert!(report.kv_summary().contains("no prefix caching"));
        assert!(!e.scheduler().allocator.prefix_caching());
    }
    // Elsewhere it is on by default.
    let (e, _) = build_engine(&fixture("tiny-llama"), &device(), &base).unwrap();
    assert!(e.config().prefix_caching && e.scheduler().allocator.prefix_caching());
}

// ---- Through the server: transformers' scores and text after cache hits ----

mod server_support;

use serde_json::{json, Value};
use server_support::Server;

/// The server's block size in these checks.
const SERVER_BS: usize = 16;

/// Log-softmax of one row of reference logits (f64 sums), largest first.
fn reference_logprobs(row: &candle_core::Tensor) -> Vec<f32> {
    let v = row.to_vec1::<f32>().unwrap();
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    let mut lp: Vec<f32> = v.iter().map(|&x| (x as f64 - lse) as f32).collect();
    lp.sort_by(|a, b| b.total_cmp(a));
    lp
}

/// Logprobs the server gives against transformers': the greedy token's (`chosen`) and the top
/// ones (`top`). model_parity holds iris's logits within 1e-4 of the row's largest logit, and
/// a logprob moves by at most twice that.
fn assert_scores(what: &str, chosen: f32, top: &[f32], row: &candle_core::Tensor) {
    let want = reference_logprobs(row);
    let scale = row.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let tol = 2e-4 * scale + 1e-5;
    assert!((chosen - want[0]).abs() <= tol, "{what}: the greedy token's logprob {chosen} against {}", want[0]);
    // The completions API keys its top entries by text, so tokens of one text (a random
    // model's stray bytes) keep one entry: each value must be one of the reference's top ones.
    assert!(!top.is_empty(), "{what}: no top logprobs");
    for g in top {
        assert!(want[..5].iter().any(|w| (g - w).abs() <= tol), "{what}: {g} is none of {:?}", &want[..5]);
    }
}

/// The cached prompt tokens the server must report for a prompt of `len` tokens whose first
/// `shared` tokens were computed and released before: whole blocks, leaving MIN_COMPUTED.
fn expect_cached(len: usize, shared: usize) -> usize {
    (len.saturating_sub(MIN_COMPUTED) / SERVER_BS).min(shared / SERVER_BS) * SERVER_BS
}

fn cached_of(v: &Value) -> usize {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize
}

/// `/v1/completions` on token ids, one greedy token with its top 5: its logprob, the top ones,
/// and the cached prompt tokens.
fn score(s: &Server, prompt: &[u32]) -> (f32, Vec<f32>, usize) {
    let body = json!({ "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5 });
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let top = lp["top_logprobs"][0].as_object().unwrap().values().map(|x| x.as_f64().unwrap() as f32).collect();
    (lp["token_logprobs"][0].as_f64().unwrap() as f32, top, cached_of(&v))
}

/// A greedy chat (OpenAI) with the top 5 logprobs of every token: content, the logprobs
/// (chosen and top, per token) and the cached prompt tokens.
fn chat_scored(s: &Server, messages: &Value, n: usize) -> (String, Vec<Vec<f32>>, usize, usize) {
    let body = json!({ "messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                       "logprobs": true, "top_logprobs": 5 });
    let r = s.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let per_token = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let mut lp = vec![t["logprob"].as_f64().unwrap() as f32];
            lp.extend(t["top_logprobs"].as_array().unwrap().iter().map(|x| x["logprob"].as_f64().unwrap() as f32));
            lp
        })
        .collect();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    (content, per_token, cached_of(&v), v["usage"]["prompt_tokens"].as_u64().unwrap() as usize)
}

/// An Anthropic message (greedy): its text and `cache_read_input_tokens`.
fn anthropic(s: &Server, messages: &Value, n: usize) -> (String, usize) {
    let mut msgs = messages.clone();
    let mut body = json!({ "max_tokens": n, "temperature": 0, "top_k": 1 });
    if msgs[0]["role"] == "system" {
        body["system"] = msgs[0]["content"].clone();
        msgs.as_array_mut().unwrap().remove(0);
    }
    body["messages"] = msgs;
    let r = s.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let text = v["content"][0]["text"].as_str().unwrap_or("").to_string();
    (text, v["usage"]["cache_read_input_tokens"].as_u64().unwrap() as usize)
}

/// Every token's logprobs equal between two runs of one request (the cache's and a server
/// without it).
fn assert_same_scores(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    assert_eq!(a.len(), b.len(), "{what}: token counts");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: token {k}");
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= LOGPROB_TOL, "{what}: token {k}: {p} against {q}");
        }
    }
}

/// A text fixture through `iris serve` with the prefix cache on (the default): the reference
/// chat prompt, then prompts cut from it that hit its blocks, are scored as transformers
/// scores them (its logits at every prompt position); the chat then gives transformers'
/// greedy text over both APIs after hits of the expected size, with the same logprobs for
/// every token as a server without the cache.
fn check_server_text(name: &str) {
    let _gpu = gpu_lock();
    let (r, j) = (reference(name), reference_json(name));
    let prompt = ids(&r["chat.input_ids"]);
    let generated = json_ids(&j["chat_generated_ids"]);
    let logits = &r["chat.logits"];
    let bs = SERVER_BS.to_string();
    let s = Server::start_model(name, &["--block-size", &bs]);
    let n = prompt.len();
    // The whole prompt first (nothing cached), then cuts of it (the cache holds its full
    // blocks), longest last.
    for (i, k) in [n, 20, n / 2, n - 9, n - 1].into_iter().enumerate() {
        let (chosen, top, cached) = score(&s, &prompt[..k]);
        assert_eq!(cached, if i == 0 { 0 } else { expect_cached(k, n) }, "{name}: cached tokens of a {k}-token cut");
        let what = format!("{name}: the next token after {k} prompt tokens");
        assert_scores(&what, chosen, &top, &logits.get(k - 1).unwrap());
    }
    assert!(expect_cached(n - 1, n) > 0, "{name}: the cuts must hit the cache");

    let messages = j["chat_messages"].clone();
    let (text, scores, cached, prompt_len) = chat_scored(&s, &messages, generated.len());
    assert_eq!(prompt_len, n, "{name}: the chat renders to the reference's ids");
    assert_eq!(cached, expect_cached(n, n), "{name}: the chat reads the prompt's blocks");
    assert_eq!(text, server_support::continuation_text(name, &prompt, &generated), "{name}: greedy text");
    assert_scores(
        &format!("{name}: the chat's first token"),
        scores[0][0],
        &scores[0][1..],
        &logits.get(n - 1).unwrap(),
    );
    let (atext, read) = anthropic(&s, &messages, generated.len());
    assert_eq!(read, expect_cached(n, n), "{name}: Anthropic reads the prompt's blocks");
    assert!(!atext.is_empty() && text.starts_with(&atext), "{name} anthropic: {atext:?} against {text:?}");

    let cold = Server::start_model(name, &["--block-size", &bs, "--no-enable-prefix-caching"]);
    let (cold_text, cold_scores, cold_cached, _) = chat_scored(&cold, &messages, generated.len());
    assert_eq!((cold_text, cold_cached), (text, 0), "{name}: without the cache");
    assert_same_scores(&format!("{name}: chat with and without the cache"), &scores, &cold_scores);
}

#[test]
fn server_scores_and_text_after_cache_hits_llama_qwen2() {
    check_server_text("tiny-llama");
    check_server_text("tiny-qwen2");
}

#[test]
fn server_scores_and_text_after_cache_hits_qwen3_gemma3() {
    check_server_text("tiny-qwen3");
    check_server_text("tiny-gemma3");
}

#[test]
fn server_scores_and_text_after_cache_hits_gemma4() {
    check_server_text("tiny-gemma4");
}

/// A vision fixture through the server with the cache on: each image case gives
/// transformers' greedy text and first-token scores when it runs cold, when it runs again
/// (its image's blocks read from the cache), and after another picture ran; the repeat's
/// logprobs are the cold run's.
fn check_server_images(name: &str) {
    let _gpu = gpu_lock();
    let r = reference(name);
    let bs = SERVER_BS.to_string();
    let s = Server::start_model(name, &["--block-size", &bs]);
    let part = |f: &str| json!({"type": "image_url", "image_url": {"url": server_support::data_url(name, f)}});
    let mut seen = std::collections::HashMap::new();
    for case in ["single", "nonsquare", "single", "multi", "multi", "nonsquare"] {
        let messages = server_support::case_messages(name, case, &part);
        let (want, prompt_len) = server_support::reference_case_text(name, case);
        let n = reference_json(name)["cases"][case]["generated_ids"].as_array().unwrap().len();
        let (text, scores, cached, len) = chat_scored(&s, &messages, n);
        assert_eq!((len, &text), (prompt_len, &want), "{name} {case}: prompt length and greedy text");
        let tail = &r[&format!("{case}.logits_tail")];
        let last = tail.get(tail.dim(0).unwrap() - 1).unwrap();
        assert_scores(&format!("{name} {case}: first token"), scores[0][0], &scores[0][1..], &last);
        match seen.get(case) {
            None => {
                seen.insert(case, scores);
            }
            Some(first) => {
                assert_eq!(cached, expect_cached(len, len), "{name} {case}: the repeat reads every full block");
                assert_same_scores(&format!("{name} {case}: repeat"), &scores, first);
            }
        }
    }
}

#[test]
fn server_images_after_cache_hits_qwen2_vl() {
    check_server_images("tiny-qwen2-vl");
}

#[test]
fn server_images_after_cache_hits_glm4v_moe() {
    check_server_images("tiny-glm4v-moe");
}
