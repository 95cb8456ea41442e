//! The Gemma 4 assistant drafter (`gemma4_assistant`) against transformers 5.24
//! (tests/fixtures/tiny-gemma4{,-moe}-assistant, scripts/make_gemma4_assistant_fixture.py): its
//! draft logits over the target's cache, alone and batched; the engine drafting with it
//! (`--speculative-config` method gemma4_mtp): its drafts, greedy output unchanged; refusals.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture, reference, reference_json, rel_err};
use iris::batch::{AttentionMeta, Batch, Positions, SeqSlice};
use iris::kv::{KvCache, KvCacheSpec, KvDtype};
use iris::loader::LoadedModel;
use iris::models::gemma4::{AssistantError, Gemma4Assistant};

/// The assistant drafter runs on the CPU only so far (on CUDA the engine refuses it at start in
/// one line: tests/cli `bad_flags`), so these tests run there on every test device.
fn device() -> Device {
    Device::Cpu
}

fn engine_with(path: &std::path::Path, opts: iris::engine::build::EngineOptions) -> iris::engine::Engine {
    iris::engine::build::build_engine(path, &device(), &opts).expect("engine builds").0
}

const BS: usize = 4;

/// Prefills each prompt into its own blocks of one cache; returns the cache, each prompt's
/// block table and each prompt's last final hidden row.
fn prefill(m: &LoadedModel, dev: &Device, prompts: &[Vec<u32>]) -> (KvCache, Vec<Vec<u32>>, Vec<Tensor>) {
    let blocks: Vec<usize> = prompts.iter().map(|p| p.len().div_ceil(BS) + 1).collect();
    let spec = KvCacheSpec { block_size: BS, num_blocks: blocks.iter().sum(), dtype: KvDtype::F32 };
    let kv = KvCache::new(m.config(), spec, dev).unwrap();
    let (mut tables, mut rows, mut next) = (Vec::new(), Vec::new(), 0u32);
    for (p, &nb) in prompts.iter().zip(&blocks) {
        // Reversed block order: paging must not assume adjacency.
        let table: Vec<u32> = (next..next + nb as u32).rev().collect();
        next += nb as u32;
        let seq = SeqSlice { q_start: 0, q_len: p.len(), context_len: p.len(), block_table: table.clone() };
        let positions = Positions::Flat((0..p.len() as u32).collect());
        let batch = Batch::new(dev, BS, vec![seq], p, positions, None).unwrap();
        let h = m.model.forward(&batch, &kv, None).unwrap();
        rows.push(h.narrow(0, p.len() - 1, 1).unwrap());
        tables.push(table);
    }
    (kv, tables, rows)
}

fn argmax(t: &Tensor) -> Vec<u32> {
    t.argmax(1).unwrap().to_vec1::<u32>().unwrap()
}

/// Drafts `k` tokens for every prompt in one batch per step, after the target's own next
/// tokens; returns those and each step's logits `[S, V]`.
fn draft(pair: Pair, prompts: &[Vec<u32>], k: usize) -> (Vec<u32>, Vec<Tensor>) {
    draft_after(pair, prompts, None, k)
}

/// (target fixture, its assistant fixture).
type Pair = (&'static str, &'static str);
const E2B: Pair = ("tiny-gemma4", "tiny-gemma4-assistant");
const MOE: Pair = ("tiny-gemma4-moe", "tiny-gemma4-moe-assistant");

/// As `draft`, after the tokens `lasts` if given.
fn draft_after(pair: Pair, prompts: &[Vec<u32>], lasts: Option<&[u32]>, k: usize) -> (Vec<u32>, Vec<Tensor>) {
    let dev = device();
    let m = iris::loader::load(&fixture(pair.0), &dev, DType::F32).unwrap();
    let a = Gemma4Assistant::load(&fixture(pair.1), m.config(), &dev, DType::F32).unwrap();
    let (kv, tables, rows) = prefill(&m, &dev, prompts);
    let mut hidden = Tensor::cat(&rows, 0).unwrap();
    let first = match lasts {
        Some(l) => l.to_vec(),
        None => argmax(&m.model.logits(&hidden).unwrap()),
    };
    let seqs = prompts
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(i, (p, t))| SeqSlice { q_start: i, q_len: 1, context_len: p.len(), block_table: t })
        .collect();
    let meta = AttentionMeta::new(BS, seqs);
    let positions: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
    let (mut last, mut out) = (first.clone(), Vec::new());
    for _ in 0..k {
        let embeds = m.model.input_embeddings(&Tensor::new(last.as_slice(), &dev).unwrap()).unwrap();
        let step = a.step(&embeds, &hidden, &positions, &kv, &meta).unwrap();
        last = argmax(&step.logits);
        hidden = step.hidden;
        out.push(step.logits);
    }
    (first, out)
}

fn check(pair: Pair, cases: &[&str]) {
    let r = reference(pair.1);
    let info = reference_json(pair.1);
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| common::json_ids(&info["cases"][c]["prompt"])).collect();
    let k = info["num_draft_steps"].as_u64().unwrap() as usize;
    let (first, steps) = draft(pair, &prompts, k);
    for (i, c) in cases.iter().enumerate() {
        assert_eq!(first[i] as u64, info["cases"][c]["first_token"].as_u64().unwrap(), "{c}: target's first token");
        let want = &r[&format!("{c}.draft_logits")];
        let tokens = common::ids(&r[&format!("{c}.draft_tokens")]);
        for (s, logits) in steps.iter().enumerate() {
            let got = logits.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
            let err = rel_err(&got, &want.get(s).unwrap());
            assert!(err <= 1e-4, "{c} step {s}: draft logits relative error {err}");
            assert_eq!(argmax(&got.unsqueeze(0).unwrap())[0], tokens[s], "{c} step {s}: draft token");
        }
    }
}

#[test]
fn draft_logits_match_transformers_short_prompt() {
    check(E2B, &["short"]);
}

#[test]
fn draft_logits_match_transformers_past_the_sliding_window() {
    check(E2B, &["long"]);
}

#[test]
fn draft_logits_match_transformers_batched_mixed_lengths() {
    check(E2B, &["long", "short"]);
}

/// The 26B-A4B-like target: no KV sharing of its own, K-eq-V full layers of one KV head.
#[test]
fn draft_logits_match_transformers_for_the_moe_target() {
    check(MOE, &["short"]);
    check(MOE, &["long"]);
    check(MOE, &["long", "short"]);
}

fn load_err(dir: &std::path::Path, target: &str) -> String {
    let dev = device();
    let m = iris::loader::load(&fixture(target), &dev, DType::F32).unwrap();
    match Gemma4Assistant::load(dir, m.config(), &dev, DType::F32) {
        Ok(_) => panic!("{} loaded for {target}", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "one line: {msg}");
            let _: &AssistantError = &e;
            msg
        }
    }
}

#[test]
fn refuses_mismatched_targets_and_non_assistants() {
    // Not a Gemma 4 target.
    let msg = load_err(&fixture("tiny-gemma4-assistant"), "tiny-gemma3");
    assert!(msg.contains("Gemma 4 target"), "{msg}");
    // A Gemma 4 target of another width (the MoE fixture is 64 wide too: edit the drafter).
    let wide = common::copy_with_config(&fixture("tiny-gemma4-assistant"), "g4a-wide", |c| {
        c["backbone_hidden_size"] = 96.into();
    });
    let msg = load_err(wide.path(), "tiny-gemma4");
    assert!(msg.contains("backbone_hidden_size is 96") && msg.contains("64"), "{msg}");
    let vocab = common::copy_with_config(&fixture("tiny-gemma4-assistant"), "g4a-vocab", |c| {
        c["text_config"]["vocab_size"] = 2048.into();
    });
    let msg = load_err(vocab.path(), "tiny-gemma4");
    assert!(msg.contains("vocab_size"), "{msg}");
    // Another Gemma 4 target whose cached heads differ (2 sliding KV heads, not 1).
    let msg = load_err(&fixture("tiny-gemma4-assistant"), "tiny-gemma4-moe");
    assert!(msg.contains("key/value heads is 1") && msg.contains("target's 2"), "{msg}");
    // The target itself is no assistant.
    let msg = load_err(&fixture("tiny-gemma4"), "tiny-gemma4");
    assert!(msg.contains("not a Gemma 4 assistant"), "{msg}");
    // No such directory.
    let msg = load_err(std::path::Path::new("/nonexistent/assistant"), "tiny-gemma4");
    assert!(msg.contains("cannot read"), "{msg}");
}

// ---- The engine drafting with the assistant (`--speculative-config` method gemma4_mtp) ----

use common::{greedy, run_requests};
use iris::engine::build::{build_engine, EngineOptions};
use iris::engine::speculative::DraftSource;
use iris::engine::{SamplingParams, SpeculativeConfig};

fn spec_opts(k: usize, base: EngineOptions) -> EngineOptions {
    spec_opts_for(E2B, k, base)
}

fn spec_opts_for(pair: Pair, k: usize, base: EngineOptions) -> EngineOptions {
    EngineOptions {
        speculative: Some(SpeculativeConfig { num_tokens: k, lookup_min: 1, lookup_max: 1, adaptive: false }),
        drafter: Some(DraftSource::Assistant(fixture(pair.1))),
        ..base
    }
}

/// Prompts of lengths 3..=38 (some past the sliding window of 8), pseudo-random ids.
fn requests() -> Vec<(Vec<u32>, SamplingParams)> {
    let lens = [3, 17, 9, 38, 6, 30, 12, 24];
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 1000) as u32 + 10
    };
    lens.iter().enumerate().map(|(i, &n)| ((0..n).map(|_| next()).collect(), greedy(10 + i % 4 * 3))).collect()
}

fn solo(target: &str, reqs: &[(Vec<u32>, SamplingParams)], opts: &EngineOptions) -> (Vec<Vec<u32>>, u64, u64) {
    let (mut outs, mut drafted, mut accepted) = (Vec::new(), 0, 0);
    for r in reqs {
        let mut e = engine_with(&fixture(target), opts.clone());
        outs.push(run_requests(&mut e, std::slice::from_ref(r), &[0]).remove(0));
        drafted += e.stats.spec.num_draft_tokens;
        accepted += e.stats.spec.num_accepted_tokens;
    }
    (outs, drafted, accepted)
}

#[test]
fn greedy_with_the_assistant_equals_plain_decoding_alone() {
    greedy_alone(E2B);
}

#[test]
fn greedy_with_the_assistant_equals_plain_decoding_alone_moe() {
    greedy_alone(MOE);
}

fn greedy_alone(pair: Pair) {
    let reqs = requests();
    let base = EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_seqs: 4, ..Default::default() };
    let (want, _, _) = solo(pair.0, &reqs, &base);
    for k in [1, 2, 4] {
        let (got, drafted, accepted) = solo(pair.0, &reqs, &spec_opts_for(pair, k, base.clone()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "K={k}: request {i} differs with the assistant drafting");
            assert_eq!(g.len(), reqs[i].1.max_tokens);
        }
        assert!(drafted > 0, "K={k}: no draft was verified");
        eprintln!("{} alone K={k}: {accepted} of {drafted} draft tokens accepted", pair.0);
    }
}

/// Requests arriving over time, prompts prefilled in chunks next to verify steps, in a pool
/// that forces preemption, with prefix caching on (two prompts share a start).
#[test]
fn greedy_with_the_assistant_equals_plain_decoding_in_mixed_batches() {
    let mut reqs = requests();
    let shared: Vec<u32> = reqs[3].0[..20].iter().copied().chain([77, 78, 79]).collect();
    reqs.push((shared, greedy(9)));
    let base = EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_seqs: 4, ..Default::default() };
    let (want, _, _) = solo("tiny-gemma4", &reqs, &base);
    let cfg = iris::loader::read_config(&fixture("tiny-gemma4")).unwrap().1;
    let per_block = iris::kv::KvCacheSpec::bytes_per_token(&cfg, iris::kv::KvDtype::F32) * 4;
    for k in [1, 2, 4] {
        let opts = spec_opts(
            k,
            EngineOptions {
                kv_memory: Some(24 * per_block as u64),
                block_size: 4,
                max_num_batched_tokens: 16,
                max_num_seqs: 8,
                max_model_len: Some(90),
                enable_prefix_caching: Some(true),
                ..Default::default()
            },
        );
        let mut e = engine_with(&fixture("tiny-gemma4"), opts);
        let got = run_requests(&mut e, &reqs, &[0, 0, 1, 2, 3, 3, 5, 8, 9]);
        assert!(e.stats.preemptions > 0, "K={k}: the test meant to force preemption but none happened");
        let s = &e.stats.spec;
        assert!(s.num_draft_tokens > 0, "K={k}: no draft was verified");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "K={k}: request {i} differs with the assistant drafting in a mixed batch");
        }
        eprintln!(
            "mixed K={k}: acceptance {:.3} ({} of {} draft tokens), prefix hits {:?}",
            s.acceptance_rate(),
            s.num_accepted_tokens,
            s.num_draft_tokens,
            e.stats.prefix
        );
        let sched = e.scheduler();
        assert_eq!(sched.allocator.num_free(), sched.allocator.num_blocks(), "K={k}: blocks leaked");
    }
}

/// The engine's drafts after a prompt (the target's hidden row and paged cache, blocks of 4,
/// prompts prefilled in chunks) are transformers' (the fixture's draft tokens).
#[test]
fn the_engine_drafts_what_transformers_drafts() {
    let info = reference_json("tiny-gemma4-assistant");
    let k = info["num_draft_steps"].as_u64().unwrap() as usize;
    for case in ["short", "long"] {
        let c = &info["cases"][case];
        let prompt = common::json_ids(&c["prompt"]);
        let opts =
            EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_batched_tokens: 8, ..Default::default() };
        let mut e = engine_with(&fixture("tiny-gemma4"), spec_opts(k, opts));
        let id = e.add_request(iris::engine::Request { prompt_tokens: prompt, params: greedy(20) }).unwrap();
        let mut first = None;
        while first.is_none() {
            first = e.step().unwrap().into_iter().find_map(|u| u.token).map(|t| t.token);
        }
        assert_eq!(first.map(u64::from), c["first_token"].as_u64(), "{case}: first token");
        let draft = e.scheduler().get(id).unwrap().draft.clone();
        assert_eq!(draft, common::json_ids(&c["draft_tokens"]), "{case}: the engine's drafts");
    }
}

/// Every step's drafts in a batch of decoding sequences, each draft accepted (the benchmark
/// switch, so the hidden row taken is the last of K + 1 verify rows, not always the first; the
/// token after the drafts is then the rejecting row's, not that row's argmax), are those of
/// the assistant run on its own over the sequence's cached tokens prefilled afresh, after its
/// last token.
#[test]
fn the_engine_drafts_each_step_as_the_assistant_alone_does() {
    let k = 3;
    let opts =
        EngineOptions { kv_memory: Some(1 << 20), block_size: 4, max_num_batched_tokens: 16, ..Default::default() };
    let mut e = engine_with(&fixture("tiny-gemma4"), spec_opts(k, opts));
    e.accept_all_drafts(true);
    let ids: Vec<_> = requests()[..3]
        .iter()
        .map(|(p, _)| e.add_request(iris::engine::Request { prompt_tokens: p.clone(), params: greedy(16) }).unwrap())
        .collect();
    let mut checked = 0;
    while e.has_work() {
        e.step().unwrap();
        let live: Vec<(Vec<u32>, u32, Vec<u32>)> = ids
            .iter()
            .filter_map(|&id| e.scheduler().get(id))
            .filter(|s| s.draft.len() == k)
            .map(|s| {
                let (last, cached) = s.tokens().split_last().unwrap();
                (cached.to_vec(), *last, s.draft.clone())
            })
            .collect();
        if live.is_empty() {
            continue;
        }
        let cached: Vec<Vec<u32>> = live.iter().map(|(c, _, _)| c.clone()).collect();
        let lasts: Vec<u32> = live.iter().map(|&(_, l, _)| l).collect();
        let (_, steps) = draft_after(E2B, &cached, Some(&lasts), k);
        for (i, (c, _, d)) in live.iter().enumerate() {
            let alone: Vec<u32> = steps.iter().map(|l| argmax(&l.narrow(0, i, 1).unwrap())[0]).collect();
            assert_eq!(d, &alone, "after {} cached tokens", c.len());
            checked += 1;
        }
    }
    assert!(checked > 6, "only {checked} drafts checked");
}

#[test]
fn the_engine_refuses_a_bad_assistant_in_one_line() {
    let build = |target: &str, dir: std::path::PathBuf| {
        let opts = EngineOptions {
            kv_memory: Some(1 << 20),
            drafter: Some(DraftSource::Assistant(dir)),
            ..spec_opts(2, Default::default())
        };
        match build_engine(&fixture(target), &device(), &opts) {
            Ok(_) => panic!("built"),
            Err(e) => e.to_string(),
        }
    };
    for (target, dir, want) in [
        ("tiny-gemma4", std::path::PathBuf::from("/nonexistent/assistant"), "cannot read"),
        ("tiny-gemma3", fixture("tiny-gemma4-assistant"), "Gemma 4 target"),
        ("tiny-gemma4", fixture("tiny-gemma4"), "not a Gemma 4 assistant"),
    ] {
        let msg = build(target, dir);
        assert!(msg.contains(want) && msg.contains("--speculative-config") && !msg.contains('\n'), "{msg}");
    }
    let e = iris::engine::speculative::parse(r#"{"method": "gemma4_mtp", "num_speculative_tokens": 2}"#).unwrap_err();
    assert!(e.to_string().contains("needs \"model\""), "{e}");
    let e = iris::engine::speculative::parse(r#"{"method": "eagle", "model": "x", "num_speculative_tokens": 2}"#)
        .unwrap_err();
    assert!(e.to_string().contains("method `eagle`"), "{e}");
}
