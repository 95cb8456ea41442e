//! Sampled speculative decoding keeps the target distribution, through the whole engine:
//! many seeded requests on a tiny model, speculation on against off, compared token sequence
//! by token sequence (the sampler-level test checks `verify` alone, `sampler::tests`).
//!
//! Every request has the same prompt; its drafts are the target's greedy continuation
//! (`ReplayDrafter`), of which top-3 sampling at temperature 0.5 accepts about a fifth (8,000
//! requests verify some 21,000 drafts). The joint distribution of output tokens 2 to 4 (those
//! after the first, which both runs draw from the prompt's last row) is compared by a
//! two-sample chi-square test at P = 0.001: about 50 against a threshold of about 107, at 66
//! degrees of freedom, when measured. The same test tells apart a residual that keeps the
//! draft (a wrong rejection sampler: chi-square about 1,000) and plain sampling at temperature
//! 0.4 from 0.5 (about 370): that is its power. The hybrid tiny-qwen3.5 (recurrent state
//! rolled back after rejected drafts) passes the same comparison (chi-square about 85 against
//! about 124 at 79 degrees of freedom, measured), and fails it with the rollback left out.
//!
//! MTP drafts are drawn from the head's own distribution q and judged by the p/q rule with
//! its residual max(p - q, 0): the same comparison on tiny-qwen3.5-mtp, whose trained head
//! drafts the prompt it was trained on, and the same power check (a residual that keeps the
//! draft is told apart).

use std::collections::HashMap;
use std::path::Path;

use candle_core::Device;

use super::build::{build_engine, EngineOptions};
use super::sampler::WRONG_RESIDUAL;
use super::speculative::DraftSource;
use super::{Drafter, Engine, ReplayDrafter, Request, SamplingParams, SpeculativeConfig};
use crate::loader::MtpWeights;

const REQUESTS: u64 = 8000;
const T: f32 = 0.5;
const T_COOLER: f32 = 0.4;
const DRAFTS: usize = 3;
const TOKENS: usize = 4;

/// Where a run's drafts come from.
#[derive(Clone, Copy, PartialEq)]
enum Drafts {
    /// No speculation.
    Off,
    /// The target's greedy continuation (`ReplayDrafter`).
    Replay,
    /// The checkpoint's MTP head, drawing from its own distribution.
    Mtp,
}

fn fixture_dir(fixture: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture)
}

fn engine(fixture: &str, drafts: Drafts) -> Engine {
    let opts = EngineOptions {
        kv_memory: Some(64 << 20),
        max_num_seqs: 256,
        speculative: (drafts != Drafts::Off).then_some(SpeculativeConfig {
            num_tokens: DRAFTS,
            lookup_min: 1,
            lookup_max: 3,
            adaptive: false,
        }),
        drafter: (drafts == Drafts::Mtp).then_some(DraftSource::Mtp(MtpWeights::Checkpoint)),
        ..Default::default()
    };
    build_engine(&fixture_dir(fixture), &Device::Cpu, &opts).expect("the fixture builds").0
}

/// The prompt every request has: for an MTP fixture, the first prompt its head was trained on
/// (`reference_mtp.json`), where its drafts are often right; else a fixed one.
fn prompt_of(fixture: &str) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(fixture_dir(fixture).join("reference_mtp.json")) else {
        return (0..12).map(|i| 7 + (i * 37) % 500).collect();
    };
    let r: serde_json::Value = serde_json::from_str(&text).expect("reference_mtp.json parses");
    let first = r["training"]["train_sequences"][0]["prompt"].as_str().expect("a training prompt");
    first.split(' ').map(|t| t.parse().expect("a token id")).collect()
}

fn params(temperature: f32, seed: Option<u64>) -> SamplingParams {
    let top_k = if temperature == 0.0 { 0 } else { 3 };
    SamplingParams { temperature, top_k, seed, max_tokens: TOKENS, ignore_eos: true, ..Default::default() }
}

/// Runs every request to its end; returns each one's output tokens.
fn run(e: &mut Engine, prompt: &[u32], reqs: &[SamplingParams]) -> Vec<Vec<u32>> {
    let mut index = HashMap::new();
    for (i, p) in reqs.iter().enumerate() {
        let id = e.add_request(Request { prompt_tokens: prompt.to_vec(), params: p.clone() }).expect("valid request");
        index.insert(id, i);
    }
    let mut outs = vec![Vec::new(); reqs.len()];
    while e.has_work() {
        for u in e.step().expect("step runs") {
            if let Some(t) = u.token {
                outs[index[&u.id]].push(t.token);
            }
        }
    }
    outs
}

/// Counts of each (token 2, token 3, token 4) among `REQUESTS` requests seeded from `seeds`
/// on (each comparison takes its two samples from different seeds, so they are independent).
fn joint_counts(fixture: &str, drafts: Drafts, temperature: f32, seeds: u64) -> HashMap<Vec<u32>, usize> {
    let prompt = prompt_of(fixture);
    let mut e = engine(fixture, drafts);
    if drafts == Drafts::Replay {
        let greedy = run(&mut engine(fixture, Drafts::Off), &prompt, &[params(0.0, None)]).remove(0);
        let recorded: Vec<u32> = prompt.iter().chain(&greedy).copied().collect();
        e.set_drafter(Drafter::Replay(ReplayDrafter::new(DRAFTS, vec![(prompt.len(), recorded)])))
            .expect("speculative");
    }
    let reqs: Vec<SamplingParams> = (seeds..seeds + REQUESTS).map(|s| params(temperature, Some(s))).collect();
    let outs = run(&mut e, &prompt, &reqs);
    if drafts != Drafts::Off {
        let s = &e.stats.spec;
        eprintln!("{fixture}: {} of {} drafts accepted", s.num_accepted_tokens, s.num_draft_tokens);
        assert!(s.num_accepted_tokens > 0 && s.num_accepted_tokens < s.num_draft_tokens, "{s:?}");
    }
    let mut counts = HashMap::new();
    for o in outs {
        assert_eq!(o.len(), TOKENS);
        *counts.entry(o[1..].to_vec()).or_insert(0) += 1;
    }
    counts
}

/// Two-sample chi-square of equal-sized samples over their cells (cells with fewer than 10
/// together pooled into one), and its degrees of freedom.
fn chi2(a: &HashMap<Vec<u32>, usize>, b: &HashMap<Vec<u32>, usize>) -> (f64, usize) {
    let mut cells: Vec<(usize, usize)> = Vec::new();
    let (mut rare_a, mut rare_b) = (0, 0);
    for key in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
        let (x, y) = (a.get(key).copied().unwrap_or(0), b.get(key).copied().unwrap_or(0));
        if x + y < 10 {
            (rare_a, rare_b) = (rare_a + x, rare_b + y);
        } else {
            cells.push((x, y));
        }
    }
    if rare_a + rare_b > 0 {
        cells.push((rare_a, rare_b));
    }
    let stat = cells.iter().map(|&(x, y)| (x as f64 - y as f64).powi(2) / (x + y) as f64).sum();
    (stat, cells.len() - 1)
}

/// The chi-square value exceeded with probability 0.001 at `dof` degrees of freedom
/// (Wilson-Hilferty; within 1% of the table from 10 degrees of freedom on).
fn critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.0902; // the normal's 0.999 quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Speculation against plain sampling on `fixture`: the same distribution of tokens 2 to 4.
fn check_same_distribution(fixture: &str, drafts: Drafts) -> HashMap<Vec<u32>, usize> {
    let plain = joint_counts(fixture, Drafts::Off, T, 0);
    let (stat, dof) = chi2(&joint_counts(fixture, drafts, T, REQUESTS), &plain);
    eprintln!("{fixture}: chi2 {stat:.1} at {dof} degrees of freedom (critical {:.1})", critical(dof));
    assert!(dof >= 10, "{fixture}: too few cells to compare ({dof} degrees of freedom)");
    assert!(
        stat < critical(dof),
        "{fixture}: speculation changed the distribution: chi2 {stat:.1} > {:.1}",
        critical(dof)
    );
    plain
}

#[test]
fn speculation_keeps_the_sampled_distribution_through_the_engine() {
    let plain = check_same_distribution("tiny-llama", Drafts::Replay);
    assert_wrong_residual_noticed("tiny-llama", Drafts::Replay, &plain);
    // The same comparison tells a slightly cooler temperature apart.
    let (stat, dof) = chi2(&joint_counts("tiny-llama", Drafts::Off, T_COOLER, 3 * REQUESTS), &plain);
    assert!(stat > critical(dof), "temperature 0.4 against 0.5 went unnoticed: chi2 {stat:.1}");
}

/// Power: a residual that keeps the draft gives another distribution, which the comparison
/// against `plain` must notice. The engine steps on a rayon worker, where the flag is set (it
/// is per thread).
fn assert_wrong_residual_noticed(fixture: &str, drafts: Drafts, plain: &HashMap<Vec<u32>, usize>) {
    let one_worker = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a thread pool");
    let wrong = one_worker.install(|| {
        WRONG_RESIDUAL.with(|w| w.set(true));
        joint_counts(fixture, drafts, T, 2 * REQUESTS)
    });
    let (stat, dof) = chi2(&wrong, plain);
    assert!(stat > critical(dof), "{fixture}: a residual that keeps the draft went unnoticed: chi2 {stat:.1}");
}

/// The same through a hybrid model, whose recurrent state each rejected draft rolls back: a
/// state left past a rejected row would shift every later token's distribution.
#[test]
fn speculation_keeps_the_sampled_distribution_hybrid() {
    check_same_distribution("tiny-qwen3.5", Drafts::Replay);
}

/// MTP drafts, drawn from the head's q and judged by p/q with the residual max(p - q, 0).
#[test]
fn mtp_drafts_keep_the_sampled_distribution() {
    let plain = check_same_distribution("tiny-qwen3.5-mtp", Drafts::Mtp);
    assert_wrong_residual_noticed("tiny-qwen3.5-mtp", Drafts::Mtp, &plain);
}
