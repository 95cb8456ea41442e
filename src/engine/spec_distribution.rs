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

use std::collections::HashMap;
use std::path::Path;

use candle_core::Device;

use super::build::{build_engine, EngineOptions};
use super::sampler::WRONG_RESIDUAL;
use super::{Drafter, Engine, ReplayDrafter, Request, SamplingParams, SpeculativeConfig};

const REQUESTS: u64 = 8000;
const T: f32 = 0.5;
const T_COOLER: f32 = 0.4;
const DRAFTS: usize = 3;
const TOKENS: usize = 4;

fn engine(fixture: &str, spec: bool) -> Engine {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture);
    let opts = EngineOptions {
        kv_memory: Some(64 << 20),
        max_num_seqs: 256,
        speculative: spec.then_some(SpeculativeConfig {
            num_tokens: DRAFTS,
            lookup_min: 1,
            lookup_max: 3,
            adaptive: false,
        }),
        ..Default::default()
    };
    build_engine(&path, &Device::Cpu, &opts).expect("the fixture builds").0
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
fn joint_counts(fixture: &str, spec: bool, temperature: f32, seeds: u64) -> HashMap<Vec<u32>, usize> {
    let prompt: Vec<u32> = (0..12).map(|i| 7 + (i * 37) % 500).collect();
    let mut e = engine(fixture, spec);
    if spec {
        let greedy = run(&mut engine(fixture, false), &prompt, &[params(0.0, None)]).remove(0);
        let recorded: Vec<u32> = prompt.iter().chain(&greedy).copied().collect();
        e.set_drafter(Drafter::Replay(ReplayDrafter::new(DRAFTS, vec![(prompt.len(), recorded)])))
            .expect("speculative");
    }
    let reqs: Vec<SamplingParams> = (seeds..seeds + REQUESTS).map(|s| params(temperature, Some(s))).collect();
    let outs = run(&mut e, &prompt, &reqs);
    if spec {
        let s = &e.stats.spec;
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
fn check_same_distribution(fixture: &str) -> HashMap<Vec<u32>, usize> {
    let plain = joint_counts(fixture, false, T, 0);
    let (stat, dof) = chi2(&joint_counts(fixture, true, T, REQUESTS), &plain);
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
    let plain = check_same_distribution("tiny-llama");

    // Power: the same comparison tells a wrong residual, and a slightly cooler temperature, apart.
    // The engine steps on a rayon worker, where the flag is set (it is per thread).
    let one_worker = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a thread pool");
    let wrong = one_worker.install(|| {
        WRONG_RESIDUAL.with(|w| w.set(true));
        joint_counts("tiny-llama", true, T, 2 * REQUESTS)
    });
    let (stat, dof) = chi2(&wrong, &plain);
    assert!(stat > critical(dof), "a residual that keeps the draft went unnoticed: chi2 {stat:.1}");
    let (stat, dof) = chi2(&joint_counts("tiny-llama", false, T_COOLER, 3 * REQUESTS), &plain);
    assert!(stat > critical(dof), "temperature 0.4 against 0.5 went unnoticed: chi2 {stat:.1}");
}

/// The same through a hybrid model, whose recurrent state each rejected draft rolls back: a
/// state left past a rejected row would shift every later token's distribution.
#[test]
fn speculation_keeps_the_sampled_distribution_hybrid() {
    check_same_distribution("tiny-qwen3.5");
}
