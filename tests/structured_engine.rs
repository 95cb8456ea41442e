//! Structured outputs inside the engine: constrained and free sequences in one batch, with a
//! KV pool small enough to force preemption (recomputed sequences resume their grammar), give
//! each sequence the tokens it gives alone; with n-gram speculation, greedy constrained output
//! is unchanged and drafts were verified; the rows a GPU masks and draws itself give the
//! tokens the host's sampler gives.

mod common;

use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{Engine, GrammarCompiler, GrammarSpec, SamplingParams, SpeculativeConfig};
use iris::kv::{KvCacheSpec, KvDtype};

fn compiler(e: &Engine) -> GrammarCompiler {
    let mut eos = e.model().config().eos_token_ids.clone();
    eos.extend(e.tokenizer().eos_token_ids().iter().filter(|t| !eos.contains(t)).collect::<Vec<_>>());
    GrammarCompiler::new(e.tokenizer().inner(), e.model().config().vocab_size, &eos).expect("compiler")
}

const REGEX: &str = "[a-d]{3,12}(-[0-9]{1,3}){1,4}";

fn matches(text: &str) -> bool {
    let mut parts = text.split('-');
    let head = parts.next().unwrap_or_default();
    let tail: Vec<&str> = parts.collect();
    (3..=12).contains(&head.len())
        && head.bytes().all(|b| (b'a'..=b'd').contains(&b))
        && (1..=4).contains(&tail.len())
        && tail.iter().all(|p| (1..=3).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()))
}

/// Ten requests: even ones constrained by `REGEX` (sampled at temperature 1 with seeds, or
/// greedy), odd ones free and greedy.
fn requests(e: &Engine, sampled: bool) -> Vec<(Vec<u32>, SamplingParams)> {
    let g = compiler(e).compile(&GrammarSpec::Regex(REGEX.into())).expect("regex");
    let vocab = e.model().config().vocab_size as u32;
    (0..10u32)
        .map(|i| {
            // Prompts that repeat themselves, so prompt lookup drafts.
            let base: Vec<u32> = (0..5 + i).map(|j| (j * 37 + i * 11) % vocab).collect();
            let prompt = [base.clone(), base.clone(), base].concat();
            let params = if i % 2 == 0 {
                let temperature = if sampled { 1.0 } else { 0.0 };
                SamplingParams {
                    max_tokens: 40,
                    temperature,
                    seed: Some(i as u64),
                    grammar: Some(g.clone()),
                    ..Default::default()
                }
            } else {
                greedy(12)
            };
            (prompt, params)
        })
        .collect()
}

fn small_pool() -> EngineOptions {
    let cfg = iris::loader::read_config(&fixture("tiny-llama")).expect("config").1;
    let per_block = KvCacheSpec::bytes_per_token(&cfg, KvDtype::F32) * 4;
    EngineOptions {
        kv_memory: Some((24 * per_block) as u64),
        block_size: 4,
        max_num_batched_tokens: 16,
        max_num_seqs: 8,
        max_model_len: Some(90),
        ..Default::default()
    }
}

fn check_outputs(e: &Engine, reqs: &[(Vec<u32>, SamplingParams)], outs: &[Vec<u32>]) {
    for (i, ((_, p), out)) in reqs.iter().zip(outs).enumerate() {
        if p.grammar.is_some() {
            // Special tokens (the EOS that ended it) are not part of the match.
            let text = e.tokenizer().decode(out, true).expect("decode");
            assert!(matches(&text), "request {i}: {text:?} does not match {REGEX}");
        }
    }
}

#[test]
fn constrained_and_free_sequences_share_batches_through_preemption() {
    let _gpu = gpu_lock();
    for sampled in [true, false] {
        let path = fixture("tiny-llama");
        let mut solo_engine = engine_with(&path, EngineOptions { kv_memory: Some(1 << 22), ..Default::default() });
        let reqs = requests(&solo_engine, sampled);
        let solo: Vec<Vec<u32>> =
            reqs.iter().map(|r| run_requests(&mut solo_engine, std::slice::from_ref(r), &[0]).remove(0)).collect();
        check_outputs(&solo_engine, &reqs, &solo);
        let mut mixed_engine = engine_with(&path, small_pool());
        let mixed = run_requests(&mut mixed_engine, &reqs, &[0, 0, 1, 1, 2, 3, 3, 5, 8, 9]);
        assert!(mixed_engine.stats.preemptions > 0, "the pool was meant to force preemption");
        assert_eq!(mixed, solo, "sampled: {sampled}");
    }
}

#[test]
fn speculation_keeps_greedy_constrained_output() {
    let _gpu = gpu_lock();
    let path = fixture("tiny-llama");
    let mut plain = engine_with(&path, EngineOptions { kv_memory: Some(1 << 22), ..Default::default() });
    let reqs = requests(&plain, false);
    let want = run_requests(&mut plain, &reqs, &[0; 10]);
    check_outputs(&plain, &reqs, &want);
    let speculative = Some(SpeculativeConfig { num_tokens: 4, lookup_min: 1, lookup_max: 3, adaptive: false });
    let mut spec = engine_with(&path, EngineOptions { kv_memory: Some(1 << 22), speculative, ..Default::default() });
    let reqs = requests(&spec, false);
    assert_eq!(run_requests(&mut spec, &reqs, &[0; 10]), want);
    assert!(spec.stats.spec.num_draft_tokens > 0, "drafts were verified");
}

/// On a GPU, constrained rows are masked and drawn on the device (`ops::token_mask`); asking
/// for logprobs brings the same rows' logits to the host instead, whose sampler masks and draws
/// them. Both engines see the same batches, so the tokens must be equal: greedy and seeded
/// sampling, without drafts and with drafts judged on the device (rows after a draft the
/// grammar rejects included). On the CPU both sides are the host's sampler.
#[test]
fn device_masks_give_the_hosts_tokens() {
    let _gpu = gpu_lock();
    let path = fixture("tiny-llama");
    let no_spec = None;
    let spec = Some(SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    for (sampled, speculative) in [(false, no_spec), (true, no_spec), (false, spec), (true, spec)] {
        let opts = || EngineOptions { kv_memory: Some(1 << 22), speculative, ..Default::default() };
        let mut device = engine_with(&path, opts());
        let reqs = requests(&device, sampled);
        let drawn = run_requests(&mut device, &reqs, &[0; 10]);
        check_outputs(&device, &reqs, &drawn);
        let mut host = engine_with(&path, opts());
        let host_reqs: Vec<_> = requests(&host, sampled)
            .into_iter()
            .map(|(prompt, params)| (prompt, SamplingParams { logprobs: Some(0), ..params }))
            .collect();
        assert_eq!(
            run_requests(&mut host, &host_reqs, &[0; 10]),
            drawn,
            "sampled {sampled}, speculative {speculative:?}"
        );
        if speculative.is_some() {
            assert!(device.stats.spec.num_draft_tokens > 0, "drafts were verified");
        }
    }
}
