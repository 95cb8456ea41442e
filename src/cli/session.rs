//! Builds an engine for a CLI command and runs single requests through it.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::args::EngineArgs;
use crate::engine::build::{build_engine, StartupReport};
use crate::engine::{Engine, FinishReason, Request, SamplingParams};

pub fn spinner(msg: String) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.set_message(msg);
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

pub fn open_engine(args: &EngineArgs) -> anyhow::Result<(Engine, StartupReport)> {
    let model = args.model.resolve()?;
    let path = model.path;
    let device = args.device()?;
    let mut opts = args.options()?;
    opts.tokenizer = model.tokenizer;
    let pb = spinner(format!("loading {}", path.display()));
    let built = build_engine(&path, &device, &opts).with_context(|| format!("cannot load {}", path.display()));
    pb.finish_and_clear();
    let (engine, report) = built?;
    let cfg = engine.model().config();
    // Debug level (`-v`): stderr stays free for the statistics line and errors.
    tracing::debug!(
        "loaded {} ({}, {} layers, {}); {}, max model len {}",
        path.display(),
        cfg.arch.name(),
        cfg.num_layers,
        report.weights.summary(),
        report.kv_summary(),
        report.max_model_len
    );
    Ok((engine, report))
}

pub struct RunStats {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub ttft: Duration,
    pub total: Duration,
    pub finish: Option<FinishReason>,
}

/// Runs one request to completion, passing each text delta to `out`.
pub fn run_one(
    engine: &mut Engine,
    prompt: Vec<u32>,
    params: SamplingParams,
    out: &mut dyn Write,
) -> anyhow::Result<RunStats> {
    let n_prompt = prompt.len();
    let start = Instant::now();
    let id = engine.add_request(Request { prompt_tokens: prompt, params })?;
    let mut ttft = None;
    let mut stats = RunStats {
        prompt_tokens: n_prompt,
        output_tokens: 0,
        ttft: Duration::ZERO,
        total: Duration::ZERO,
        finish: None,
    };
    while engine.has_work() {
        for u in engine.step()? {
            if u.id != id {
                continue;
            }
            if u.token.is_some() && ttft.is_none() {
                ttft = Some(start.elapsed());
            }
            out.write_all(u.text.as_bytes())?;
            out.flush()?;
            stats.output_tokens = u.num_output_tokens;
            if u.finish.is_some() {
                stats.finish = u.finish;
            }
        }
        if stats.finish.is_some() {
            break;
        }
    }
    stats.ttft = ttft.unwrap_or_default();
    stats.total = start.elapsed();
    Ok(stats)
}

pub fn print_stats(s: &RunStats) {
    let decode = s.total.saturating_sub(s.ttft).as_secs_f64();
    let decode_tps = if decode > 0.0 && s.output_tokens > 1 { (s.output_tokens - 1) as f64 / decode } else { 0.0 };
    eprintln!(
        "[{} prompt tokens, {} generated, finish: {}; time to first token {:.0} ms ({:.0} tok/s prefill), decode {:.1} tok/s]",
        s.prompt_tokens,
        s.output_tokens,
        s.finish.as_ref().map(|f| f.as_openai_str()).unwrap_or("none"),
        s.ttft.as_secs_f64() * 1e3,
        s.prompt_tokens as f64 / s.ttft.as_secs_f64().max(1e-9),
        decode_tps
    );
}
