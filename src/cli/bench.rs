//! `iris bench`: prefill and decode throughput and time to first token, in-process; with
//! `--url`, a load benchmark of a running server instead (`load_bench.rs`).

use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::args::EngineArgs;
use super::session::open_engine;
use crate::engine::{Engine, Request, SamplingParams};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Benchmark the server running at this URL (e.g. http://127.0.0.1:8000) with concurrent
    /// streaming chat requests, instead of the engine in-process. The engine flags and
    /// --batch-sizes, --prompt-len, --repeats do not apply then; --gen-len is max_tokens.
    #[arg(long)]
    pub url: Option<String>,
    /// With --url: concurrent streams, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub concurrency: Vec<usize>,
    /// With --url: requests per level (default: 4 per stream, at least 16).
    #[arg(long)]
    pub num_requests: Option<usize>,
    /// With --url: API key to send (`Authorization: Bearer`).
    #[arg(long, env = "IRIS_API_KEY")]
    pub api_key: Option<String>,
    /// With --url: seconds after which an unfinished request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Batch sizes (concurrent sequences) to measure decode at.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch_sizes: Vec<usize>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 64)]
    pub gen_len: usize,
    /// Repetitions per measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize, Clone)]
pub struct BenchRow {
    pub batch: usize,
    pub prompt_len: usize,
    pub gen_len: usize,
    /// Prompt tokens per second over the prefill of all sequences.
    pub prefill_tok_s: f64,
    /// Time from submission to the first token of the first sequence.
    pub ttft_ms: f64,
    /// Generated tokens per second once every sequence is decoding.
    pub decode_tok_s: f64,
    /// All generated tokens over the whole run, prefill included.
    pub total_tok_s: f64,
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog while the children watch from the window. \
In the morning the market fills with people buying bread, fruit and fresh fish from the harbour. ";

fn prompt_tokens(engine: &Engine, len: usize) -> anyhow::Result<Vec<u32>> {
    let tok = engine.tokenizer();
    let unit = tok.encode(TEXT, false)?;
    anyhow::ensure!(!unit.is_empty(), "the tokenizer produced no tokens for the benchmark text");
    Ok(unit.iter().copied().cycle().take(len).collect())
}

fn run_once(engine: &mut Engine, batch: usize, prompt: &[u32], gen_len: usize) -> anyhow::Result<BenchRow> {
    let params = SamplingParams { max_tokens: gen_len, ignore_eos: true, ..SamplingParams::default() };
    let start = Instant::now();
    for _ in 0..batch {
        engine.add_request(Request { prompt_tokens: prompt.to_vec(), params: params.clone() })?;
    }
    let (mut first_token, mut all_started, mut tokens_at_all_started) = (None, None, 0usize);
    let mut started = std::collections::HashSet::new();
    let mut generated = 0usize;
    while engine.has_work() {
        for u in engine.step()? {
            if u.token.is_some() {
                generated += 1;
                first_token.get_or_insert_with(|| start.elapsed());
                started.insert(u.id);
            }
        }
        if all_started.is_none() && started.len() == batch {
            all_started = Some(start.elapsed());
            tokens_at_all_started = generated;
        }
    }
    let total = start.elapsed().as_secs_f64();
    let prefill_done = all_started.map(|d| d.as_secs_f64()).unwrap_or(total);
    let decode_time = total - prefill_done;
    Ok(BenchRow {
        batch,
        prompt_len: prompt.len(),
        gen_len,
        prefill_tok_s: (batch * prompt.len()) as f64 / prefill_done.max(1e-9),
        ttft_ms: first_token.map(|d| d.as_secs_f64() * 1e3).unwrap_or(0.0),
        decode_tok_s: (generated - tokens_at_all_started) as f64 / decode_time.max(1e-9),
        total_tok_s: generated as f64 / total.max(1e-9),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if let Some(url) = a.url {
        let timeout = std::time::Duration::try_from_secs_f64(a.request_timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| anyhow::anyhow!("--request-timeout must be a positive number of seconds"))?;
        return super::load_bench::run(super::load_bench::LoadBench {
            url,
            concurrency: a.concurrency,
            num_requests: a.num_requests,
            max_tokens: a.gen_len,
            api_key: a.api_key.filter(|k| !k.is_empty()),
            timeout,
            json: a.json,
        });
    }
    anyhow::ensure!(
        a.repeats > 0 && a.gen_len > 1 && a.prompt_len > 0,
        "--repeats, --gen-len (> 1) and --prompt-len must be positive"
    );
    anyhow::ensure!(
        !a.batch_sizes.is_empty() && a.batch_sizes.iter().all(|&b| b > 0),
        "--batch-sizes must be positive numbers"
    );
    let (mut engine, _) = open_engine(&a.engine)?;
    let prompt = prompt_tokens(&engine, a.prompt_len)?;
    // Warm up caches and thread pools.
    run_once(&mut engine, 1, &prompt, 4)?;
    let pb = ProgressBar::new((a.batch_sizes.len() * a.repeats) as u64);
    pb.set_style(
        ProgressStyle::with_template("bench {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for &b in &a.batch_sizes {
        pb.set_message(format!("batch {b}"));
        let mut runs = Vec::new();
        for _ in 0..a.repeats {
            runs.push(run_once(&mut engine, b, &prompt, a.gen_len)?);
            pb.inc(1);
        }
        let m = |f: fn(&BenchRow) -> f64| median(runs.iter().map(f).collect());
        rows.push(BenchRow {
            batch: b,
            prompt_len: a.prompt_len,
            gen_len: a.gen_len,
            prefill_tok_s: m(|r| r.prefill_tok_s),
            ttft_ms: m(|r| r.ttft_ms),
            decode_tok_s: m(|r| r.decode_tok_s),
            total_tok_s: m(|r| r.total_tok_s),
        });
    }
    pb.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("| batch | prompt | gen | prefill tok/s | TTFT ms | decode tok/s | total tok/s |");
        println!("|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} |",
                r.batch, r.prompt_len, r.gen_len, r.prefill_tok_s, r.ttft_ms, r.decode_tok_s, r.total_tok_s
            );
        }
    }
    Ok(())
}
