//! MTP drafting end to end on the CPU, on a real model with a trained head: SmolLM2-135M-Instruct
//! Q4_1 (the quick start's model, fetched from PyPI) and the head `scripts/train_mtp_head.py`
//! made for it (tests/fixtures/real/smollm2-mtp). The held-out prompts (`heldout.json`, never
//! trained on) are generated greedily without drafts and with MTP drafts of K tokens, at each
//! batch size, engines alternated round by round. Prints decode tokens/s (medians), the speedup
//! over plain decoding measured in the same rounds, acceptance per draft position, and fails if
//! any output differs from plain decoding's.
//!
//!   cargo bench --bench mtp_speedup -- [--rounds 3] [--gen 64] [--batches 1,8] [--k 1,2,3] [--prompts 40]
//!
//! Speculation here is not adaptive (`"adaptive": false`): the figures are what drafting gives
//! and costs, not what the governor would choose; `--adaptive` measures the governor's choice
//! instead.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Device;
use iris::engine::build::{build_engine, EngineOptions};
use iris::engine::speculative::DraftSource;
use iris::engine::{Engine, Request, SamplingParams, SpeculativeConfig};
use iris::loader::MtpWeights;

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn list(name: &str, default: &str) -> Vec<usize> {
    arg(name, default.to_string()).split(',').filter_map(|v| v.parse().ok()).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn head_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real/smollm2-mtp")
}

/// The held-out prompts' token ids.
fn prompts() -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(head_dir().join("heldout.json")).expect("heldout.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("heldout.json is JSON");
    let items = v.get("sequences").and_then(|p| p.as_array()).expect("heldout.json has `sequences`");
    let n = arg("--prompts", items.len());
    items
        .iter()
        .take(n)
        .map(|p| {
            let ids = p.get("prompt_ids").and_then(|i| i.as_array()).expect("`prompt_ids`");
            ids.iter().map(|t| t.as_u64().expect("an id") as u32).collect()
        })
        .collect()
}

fn engine(gguf: &Path, k: usize) -> Engine {
    let mut opts = EngineOptions { kv_memory: Some(256 << 20), max_num_seqs: 16, ..Default::default() };
    if k > 0 {
        let adaptive = std::env::args().any(|a| a == "--adaptive");
        opts.speculative = Some(SpeculativeConfig { num_tokens: k, lookup_min: 1, lookup_max: 1, adaptive });
        let head = head_dir().join("SmolLM2-135M-Instruct.mtp.safetensors");
        opts.drafter = Some(DraftSource::Mtp(MtpWeights::File(head)));
    }
    build_engine(gguf, &Device::Cpu, &opts).expect("engine builds").0
}

/// Generates `gen` tokens for each prompt, `batch` at a time: (outputs, decode seconds, decode
/// tokens). Decode time runs from the step after the batch's last first token.
fn run(e: &mut Engine, prompts: &[Vec<u32>], batch: usize, gen: usize) -> (Vec<Vec<u32>>, f64, usize) {
    let params = SamplingParams { max_tokens: gen, ignore_eos: true, ..SamplingParams::default() };
    let (mut outs, mut secs, mut tokens) = (Vec::new(), 0.0, 0);
    for group in prompts.chunks(batch) {
        let ids: Vec<_> = group
            .iter()
            .map(|p| e.add_request(Request { prompt_tokens: p.clone(), params: params.clone() }).unwrap())
            .collect();
        let mut got = vec![Vec::new(); group.len()];
        let mut t0 = None;
        while e.has_work() {
            let t = Instant::now();
            for u in e.step().unwrap() {
                if let (Some(i), Some(tok)) = (ids.iter().position(|&x| x == u.id), &u.token) {
                    got[i].push(tok.token);
                }
            }
            if t0.is_some() {
                secs += t.elapsed().as_secs_f64();
            } else if got.iter().all(|g| !g.is_empty()) {
                t0 = Some(());
                tokens -= got.iter().map(Vec::len).sum::<usize>();
            }
        }
        tokens += got.iter().map(Vec::len).sum::<usize>();
        outs.extend(got);
    }
    (outs, secs, tokens)
}

fn main() {
    let gguf = iris::fetch::SMOLLM2.ensure().expect("SmolLM2 GGUF");
    let (rounds, gen) = (arg("--rounds", 3usize), arg("--gen", 64usize));
    let ks = list("--k", "1,2,3");
    let prompts = prompts();
    println!("SmolLM2-135M-Instruct Q4_1 + trained MTP head, {} held-out prompts, {gen} tokens each", prompts.len());
    println!("| batch | K | plain tok/s | MTP tok/s | speedup | accepted per position | tokens per verify |");
    println!("|---|---|---|---|---|---|---|");
    for batch in list("--batches", "1,8") {
        let mut plain = engine(&gguf, 0);
        let mut spec: Vec<Engine> = ks.iter().map(|&k| engine(&gguf, k)).collect();
        let mut plain_rates = Vec::new();
        let mut rates = vec![Vec::new(); ks.len()];
        let mut want = None;
        for _ in 0..rounds {
            let (out, s, n) = run(&mut plain, &prompts, batch, gen);
            plain_rates.push(n as f64 / s);
            want.get_or_insert(out);
            for (i, e) in spec.iter_mut().enumerate() {
                let (out, s, n) = run(e, &prompts, batch, gen);
                assert_eq!(Some(&out), want.as_ref(), "K={}: output differs from plain decoding", ks[i]);
                rates[i].push(n as f64 / s);
            }
        }
        let p = median(plain_rates);
        for (i, e) in spec.iter().enumerate() {
            let st = &e.stats.spec;
            let per_pos: Vec<String> = st
                .accepted_per_position
                .iter()
                .map(|&a| format!("{:.2}", a as f64 / st.num_drafts.max(1) as f64))
                .collect();
            let r = median(rates[i].clone());
            println!(
                "| {batch} | {} | {p:.1} | {r:.1} | {:.2}x | {} | {:.2} |",
                ks[i],
                r / p,
                per_pos.join(" / "),
                st.tokens_per_verify()
            );
        }
    }
}
