//! Speculative decoding with n-gram drafts never changes greedy output: for every text fixture
//! family and K in {1, 2, 4}, alone and in a mixed batch with chunked prefill and preemption,
//! with float and TurboQuant caches (a float window included, whose ring rows a rejected draft
//! overwrote are restored), a stop string or max_tokens falling inside an accepted draft, and
//! logprobs. Each case also checks that drafts were both accepted and rejected, so both
//! branches ran. The hybrid Qwen3.5 models roll their linear-attention layers' recurrent state
//! back to the checkpoint of a verify step's last kept row: a wrong rollback changes the tokens
//! after the first rejected draft. (The sampled case's distribution is tested in `engine::sampler`, for `verify`
//! alone, and in `engine::spec_distribution`, through the engine.)

mod common;

use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{Drafter, Engine, FinishReason, ReplayDrafter, Request, SamplingParams, SpeculativeConfig};
use iris::kv::{KvCacheSpec, KvDtype, TqBits};

fn spec(k: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig { num_tokens: k, lookup_min: 1, lookup_max: 3, adaptive: false })
}

/// Prompts with repeats in them (so prompt lookup finds matches), lengths 3..=45.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    repeating_prompts(vocab, &[3, 17, 9, 45, 6, 30, 12, 24, 7, 38], 0x9e3779b97f4a7c15)
}

fn requests(vocab: u32) -> Vec<(Vec<u32>, SamplingParams)> {
    prompts(vocab).into_iter().enumerate().map(|(i, p)| (p, greedy(12 + i % 5 * 3))).collect()
}

/// Every request alone, in its own engine (no speculation unless `opts` has it).
fn solo(path: &std::path::Path, reqs: &[(Vec<u32>, SamplingParams)], opts: &EngineOptions) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            let mut e = engine_with(path, opts.clone());
            run_requests(&mut e, std::slice::from_ref(r), &[0]).remove(0)
        })
        .collect()
}

fn assert_both_branches(e: &Engine, what: &str) {
    let s = &e.stats.spec;
    assert!(s.num_draft_tokens > 0, "{what}: no draft was verified");
    assert!(s.num_accepted_tokens > 0, "{what}: no draft was accepted");
    assert!(s.num_accepted_tokens < s.num_draft_tokens, "{what}: no draft was rejected");
}

/// Where a test's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Drafts {
    /// Prompt lookup (the n-gram drafter `--speculative-config` builds).
    Ngram,
    /// Each request's output without speculation, with every fifth token changed
    /// (`ReplayDrafter`): drafts are accepted up to a changed token and rejected there. The
    /// random tiny models' own continuations rarely repeat their prompts, which n-gram drafts
    /// need to be accepted at all.
    Replay,
}

/// Whether speculation is refused for `path` on the test device: a hybrid model's state
/// checkpoints are kept on the CPU only so far, so on a GPU it is refused at start in one line
/// (checked here), and the test has nothing more to run.
fn refused_here(path: &std::path::Path) -> bool {
    let hybrid = !iris::loader::read_config(path).unwrap().1.linear_layers().is_empty();
    if !(hybrid && on_gpu()) {
        return false;
    }
    let opts = EngineOptions { kv_memory: Some(1 << 20), speculative: spec(2), ..Default::default() };
    let err = iris::engine::build::build_engine(path, &device(), &opts).err().expect("refused on a GPU").to_string();
    assert!(err.contains("--speculative-config") && err.contains("CPU") && !err.contains('\n'), "{err}");
    true
}

/// `output` with tokens 3, 8, 13, ... changed to another id.
fn corrupted(output: &[u32]) -> Vec<u32> {
    output.iter().enumerate().map(|(i, &t)| if i % 5 == 3 { t ^ 1 } else { t }).collect()
}

/// An engine speculating K tokens from `drafts`; `outputs[i]` is request i's output without
/// speculation (what a replay drafter replays, corrupted).
fn speculating(
    path: &std::path::Path,
    opts: EngineOptions,
    drafts: Drafts,
    reqs: &[(Vec<u32>, SamplingParams)],
    outputs: &[Vec<u32>],
) -> Engine {
    let k = opts.speculative.expect("speculative options").num_tokens;
    let mut e = engine_with(path, opts);
    if drafts == Drafts::Replay {
        let recorded = reqs
            .iter()
            .zip(outputs)
            .map(|((prompt, _), out)| (prompt.len(), prompt.iter().copied().chain(corrupted(out)).collect()))
            .collect();
        e.set_drafter(Drafter::Replay(ReplayDrafter::new(k, recorded))).unwrap();
    }
    e
}

fn check_alone(name: &str, drafts: Drafts) {
    let _gpu = gpu_lock();
    let path = fixture(name);
    if refused_here(&path) {
        return;
    }
    let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
    let reqs = requests(vocab);
    let base = EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_seqs: 4, ..Default::default() };
    let want = solo(&path, &reqs, &base);
    for k in [1, 2, 4] {
        let (mut verified, mut accepted) = (0, 0);
        for (i, r) in reqs.iter().enumerate() {
            let opts = EngineOptions { speculative: spec(k), ..base.clone() };
            let mut e = speculating(&path, opts, drafts, &reqs, &want);
            let got = run_requests(&mut e, std::slice::from_ref(r), &[0]).remove(0);
            assert_eq!(got, want[i], "{name} K={k} {drafts:?}: request {i} differs with speculation");
            assert_eq!(got.len(), r.1.max_tokens, "{name} K={k}: request {i} did not stop at max_tokens");
            verified += e.stats.spec.num_draft_tokens;
            accepted += e.stats.spec.num_accepted_tokens;
        }
        assert!(verified > 0, "{name} K={k}: no draft was ever verified");
        if drafts == Drafts::Replay {
            assert!(accepted > 0 && accepted < verified, "{name} K={k}: {accepted} of {verified} drafts accepted");
        }
    }
}

/// Ten requests arriving over time, prompts prefilled in chunks of a 16-token budget next to
/// other sequences' verify steps, in a pool that forces preemption.
fn check_mixed(name: &str, k: usize, quant: Option<(TqBits, usize)>, drafts: Drafts) {
    let _gpu = gpu_lock();
    let path = fixture(name);
    if refused_here(&path) {
        return;
    }
    let cfg = iris::loader::read_config(&path).unwrap().1;
    let reqs = requests(cfg.vocab_size as u32);
    let with_quant = |o: EngineOptions| match quant {
        Some((bits, window)) => EngineOptions { kv_quant: Some(bits), kv_float_window: window, ..o },
        None => o,
    };
    let base =
        with_quant(EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_seqs: 4, ..Default::default() });
    let want = solo(&path, &reqs, &base);
    let (bytes_per_block, window_bytes) = match quant {
        Some((bits, window)) => {
            let t = iris::kv::TqSpec { float_window: window, window_rings: 8, ..iris::kv::TqSpec::new(bits) };
            (t.bytes_per_token(&cfg, KvDtype::F32) * 4, t.window_bytes(&cfg, KvDtype::F32))
        }
        None => (KvCacheSpec::bytes_per_token(&cfg, KvDtype::F32) * 4, 0),
    };
    // A hybrid model's state slots come first: 8 sequences, each state kept K + 1 times.
    let state_bytes = cfg.state_bytes_per_sequence() * 8 * (k + 1);
    let opts = with_quant(EngineOptions {
        kv_memory: Some((24 * bytes_per_block + window_bytes + state_bytes) as u64),
        block_size: 4,
        max_num_batched_tokens: 16,
        max_num_seqs: 8,
        max_model_len: Some(90),
        speculative: spec(k),
        ..Default::default()
    });
    let mut e = speculating(&path, opts, drafts, &reqs, &want);
    let got = run_requests(&mut e, &reqs, &[0, 0, 1, 2, 3, 3, 5, 8, 13, 21]);
    let what = format!("{name} K={k} {quant:?} {drafts:?}");
    assert!(e.stats.preemptions > 0, "{what}: the test meant to force preemption but none happened");
    assert_both_branches(&e, &what);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "{what}: request {i} differs with speculation in a mixed batch");
    }
    let sched = e.scheduler();
    assert_eq!(sched.allocator.num_free(), sched.allocator.num_blocks(), "{what}: blocks leaked");
}

macro_rules! family_tests {
    ($($m:ident => $name:literal, $drafts:ident);*) => {$(
        mod $m {
            use super::Drafts::*;
            #[test]
            fn greedy_speculation_equals_plain_decoding_alone() {
                super::check_alone($name, $drafts);
            }
            #[test]
            fn greedy_speculation_equals_plain_decoding_in_mixed_batches() {
                for k in [1, 2, 4] {
                    super::check_mixed($name, k, None, $drafts);
                }
            }
        }
    )*};
}

family_tests!(
    llama => "tiny-llama", Ngram;
    qwen2 => "tiny-qwen2", Ngram;
    qwen3 => "tiny-qwen3", Ngram;
    gemma3 => "tiny-gemma3", Ngram;
    gemma4 => "tiny-gemma4", Ngram;
    gemma4_moe => "tiny-gemma4-moe", Ngram;
    qwen35 => "tiny-qwen3.5", Replay;
    qwen35_moe => "tiny-qwen3.5-moe", Replay
);

/// The hybrid models with n-gram drafts too: nearly all rejected, each one rolled back.
#[test]
fn hybrid_speculation_with_ngram_drafts() {
    check_alone("tiny-qwen3.5", Drafts::Ngram);
    check_alone("tiny-qwen3.5-moe", Drafts::Ngram);
}

/// TurboQuant codes, with a float window shorter than the sequences: a rejected draft's ring
/// rows must be put back, or later rows read the draft's keys in place of older ones.
#[test]
fn turboquant_with_a_float_window_survives_rejected_drafts() {
    let bits = TqBits { key: 4, value: 4 };
    for window in [0, 6] {
        check_mixed("tiny-llama", 4, Some((bits, window)), Drafts::Ngram);
    }
}

/// The same for a hybrid model: its attention layers' codes and rings are rolled back along
/// with its recurrent layers' state.
#[test]
fn turboquant_and_recurrent_state_survive_rejected_drafts() {
    let bits = TqBits { key: 4, value: 4 };
    for window in [0, 6] {
        check_mixed("tiny-qwen3.5", 4, Some((bits, window)), Drafts::Replay);
    }
}

#[test]
fn a_float_window_no_longer_than_the_drafts_is_refused() {
    let opts = EngineOptions {
        kv_memory: Some(1 << 20),
        kv_quant: Some(TqBits { key: 4, value: 4 }),
        kv_float_window: 4,
        speculative: spec(4),
        ..Default::default()
    };
    let err = iris::engine::build::build_engine(&fixture("tiny-llama"), &device(), &opts).err().expect("refused");
    assert!(err.to_string().contains("--kv-float-window 4 must be larger"), "{err}");
}

/// Runs one request; returns its updates.
fn run_one(e: &mut Engine, prompt: &[u32], params: SamplingParams) -> Vec<iris::engine::SeqUpdate> {
    run_steps(e, prompt, params).into_iter().map(|(_, u)| u).collect()
}

/// Runs one request; returns its updates with the step each came from.
fn run_steps(e: &mut Engine, prompt: &[u32], params: SamplingParams) -> Vec<(usize, iris::engine::SeqUpdate)> {
    e.add_request(Request { prompt_tokens: prompt.to_vec(), params }).unwrap();
    let mut out = Vec::new();
    let mut step = 0;
    while e.has_work() {
        out.extend(e.step().unwrap().into_iter().map(|u| (step, u)));
        step += 1;
    }
    out
}

/// A stop string that completes inside an accepted draft ends the sequence there, with the
/// same text and tokens as without speculation; so does max_tokens.
#[test]
fn stop_strings_and_max_tokens_inside_a_draft() {
    let _gpu = gpu_lock();
    let base = EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_seqs: 4, ..Default::default() };
    let spec_opts = EngineOptions { speculative: spec(4), ..base.clone() };
    // A token that came in the same step as the one before it (an accepted draft's successor),
    // whose text is not in the output before it: the first such case over fixtures and prompts.
    let case = TINY_MODELS.iter().flat_map(|m| prompts(1024).into_iter().map(move |p| (fixture(m), p))).find_map(
        |(path, prompt)| {
            let free = run_steps(&mut engine_with(&path, spec_opts.clone()), &prompt, greedy(40));
            let mut text = String::new();
            for (i, (step, u)) in free.iter().enumerate() {
                let stop = u.text.trim();
                // The stop string's first occurrence ends inside this token's text.
                let first_ends_here = (text.clone() + &u.text).find(stop).is_some_and(|p| p + stop.len() > text.len());
                if i > 0 && free[i - 1].0 == *step && !stop.is_empty() && first_ends_here {
                    return Some((path, prompt, i, stop.to_string()));
                }
                text.push_str(&u.text);
            }
            None
        },
    );
    let (path, prompt, at, stop) = case.expect("some accepted draft's successor has new text");
    let prompt = &prompt;
    let params = SamplingParams { stop: vec![stop.clone()], ..greedy(40) };
    let plain = run_one(&mut engine_with(&path, base.clone()), prompt, params.clone());
    let sped = run_one(&mut engine_with(&path, spec_opts.clone()), prompt, params);
    let summary = |us: &[iris::engine::SeqUpdate]| {
        (us.iter().map(|u| u.text.clone()).collect::<String>(), us.len(), us.last().and_then(|u| u.finish.clone()))
    };
    assert_eq!(summary(&sped), summary(&plain), "stop string {stop:?} at token {at}");
    assert_eq!(summary(&sped).2, Some(FinishReason::Stop));
    assert_eq!(sped.len(), at + 1, "the stop string ends the sequence at its token");

    // max_tokens inside the same draft.
    let params = greedy(at + 1);
    let plain = run_one(&mut engine_with(&path, base), prompt, params.clone());
    let sped = run_one(&mut engine_with(&path, spec_opts), prompt, params);
    assert_eq!(summary(&sped), summary(&plain));
    assert_eq!((sped.len(), summary(&sped).2), (at + 1, Some(FinishReason::Length)));
}

/// The logprobs of accepted tokens are those without speculation (to rounding: a verify step
/// multiplies more rows at once); a seeded sampled request repeats exactly.
#[test]
fn logprobs_and_seeded_sampling() {
    check_logprobs_and_seeded_sampling("tiny-qwen3", Drafts::Ngram);
}

/// The same with a recurrent state rolled back between verify steps.
#[test]
fn logprobs_and_seeded_sampling_hybrid() {
    check_logprobs_and_seeded_sampling("tiny-qwen3.5", Drafts::Replay);
}

fn check_logprobs_and_seeded_sampling(name: &str, drafts: Drafts) {
    let _gpu = gpu_lock();
    let path = fixture(name);
    if refused_here(&path) {
        return;
    }
    let base = EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_seqs: 4, ..Default::default() };
    let spec_opts = EngineOptions { speculative: spec(4), ..base.clone() };
    let prompt = &prompts(1024)[5];
    let params = SamplingParams { logprobs: Some(3), ..greedy(24) };
    let plain = run_one(&mut engine_with(&path, base.clone()), prompt, params.clone());
    let tokens =
        |us: &[iris::engine::SeqUpdate]| us.iter().map(|u| u.token.as_ref().unwrap().token).collect::<Vec<_>>();
    let reqs = [(prompt.clone(), params.clone())];
    let mut e = speculating(&path, spec_opts.clone(), drafts, &reqs, &[tokens(&plain)]);
    let sped = run_one(&mut e, prompt, params);
    assert!(e.stats.spec.num_accepted_tokens > 0, "no draft was accepted");
    assert_eq!(plain.len(), sped.len());
    for (p, s) in plain.iter().zip(&sped) {
        let (p, s) = (p.token.as_ref().unwrap(), s.token.as_ref().unwrap());
        assert_eq!(p.token, s.token);
        assert!((p.logprob - s.logprob).abs() < 1e-4, "{} vs {}", p.logprob, s.logprob);
        assert_eq!(p.top_logprobs.len(), s.top_logprobs.len());
        for (a, b) in p.top_logprobs.iter().zip(&s.top_logprobs) {
            assert!(a.0 == b.0 && (a.1 - b.1).abs() < 1e-4, "{a:?} vs {b:?}");
        }
    }
    // Low temperature: these random models' sampled tokens then repeat enough to be drafted.
    // The tiny Qwen3.5's next-token logits are nearly flat (their top ones a tenth apart), so
    // there two candidates (top-k 2) let the greedy continuation a replay drafter proposes be
    // accepted often enough.
    let prompt = &prompts(1024)[1];
    let top_k = if drafts == Drafts::Replay { 2 } else { 0 };
    let sampled = SamplingParams { temperature: 0.3, top_k, seed: Some(7), ..greedy(24) };
    let reqs = [(prompt.clone(), sampled.clone())];
    let greedy_out = tokens(&run_one(&mut engine_with(&path, base), prompt, greedy(24)));
    let replayed = || speculating(&path, spec_opts.clone(), drafts, &reqs, std::slice::from_ref(&greedy_out));
    let mut e = replayed();
    let a = tokens(&run_one(&mut e, prompt, sampled.clone()));
    assert_both_branches(&e, "sampling");
    let b = tokens(&run_one(&mut replayed(), prompt, sampled));
    assert_eq!(a, b, "a seeded request with speculation repeats");
}

/// A sequence cancelled between verify steps frees its blocks (lookahead ones included) and
/// its state slot; the sequences beside it go on exactly as without it.
#[test]
fn cancelling_while_speculating_frees_everything() {
    let _gpu = gpu_lock();
    let path = fixture("tiny-llama");
    let opts = EngineOptions {
        kv_memory: Some(1 << 20),
        block_size: 4,
        max_num_seqs: 4,
        kv_quant: Some(TqBits { key: 4, value: 4 }),
        kv_float_window: 6,
        speculative: spec(4),
        ..Default::default()
    };
    let reqs = requests(1024);
    let want = run_requests(&mut engine_with(&path, opts.clone()), &reqs[3..4], &[0]).remove(0);
    let mut e = engine_with(&path, opts);
    let gone = e.add_request(Request { prompt_tokens: reqs[1].0.clone(), params: greedy(40) }).unwrap();
    let kept = e.add_request(Request { prompt_tokens: reqs[3].0.clone(), params: reqs[3].1.clone() }).unwrap();
    let mut got = Vec::new();
    let mut step = 0;
    while e.has_work() {
        if step == 6 {
            assert!(e.abort(gone), "the sequence is still running");
        }
        for u in e.step().unwrap() {
            assert!(u.id != gone || step < 6, "no update after the abort");
            if u.id == kept {
                got.extend(u.token.map(|t| t.token));
            }
        }
        step += 1;
    }
    assert!(e.stats.spec.num_draft_tokens > 0, "no draft was verified");
    assert_eq!(got, want, "the other sequence changed");
    let sched = e.scheduler();
    assert_eq!(sched.allocator.num_free(), sched.allocator.num_blocks(), "blocks leaked");
    assert_eq!(sched.num_free_slots(), 4, "a state slot leaked");
}
