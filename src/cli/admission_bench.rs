//! `iris bench --admit-prompt-len N`: what admitting a long prompt does to the sequences that
//! are decoding. `--streams` sequences (prompts of --prompt-len tokens) decode; once each has
//! its first token, --gen-len steps run as they are (the steady inter-token latency), then a
//! prompt of N tokens arrives and the streams go on until its first token (the latency while
//! it is admitted, in chunks as --max-num-batched-tokens and --long-prefill-token-threshold
//! cut it). Run it with the threshold and without to see what the chunk policy buys.

use std::time::Instant;

use serde::Serialize;

use crate::engine::{Engine, Request, SamplingParams, SeqId};

/// Inter-token latencies of one phase, over every stream's consecutive tokens (ms).
#[derive(Debug, Serialize, Clone)]
pub struct Latencies {
    pub gaps: usize,
    pub median_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Latencies {
    fn of(mut gaps: Vec<f64>) -> anyhow::Result<Self> {
        anyhow::ensure!(!gaps.is_empty(), "no stream produced two tokens in a phase: raise --gen-len");
        gaps.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| gaps[((gaps.len() - 1) as f64 * q).round() as usize];
        Ok(Latencies { gaps: gaps.len(), median_ms: at(0.5), p99_ms: at(0.99), max_ms: at(1.0) })
    }
}

#[derive(Debug, Serialize, Clone)]
pub struct AdmissionReport {
    pub streams: usize,
    pub admitted_prompt_len: usize,
    pub long_prefill_token_threshold: usize,
    pub max_num_batched_tokens: usize,
    /// The streams' inter-token latency before the long prompt arrives.
    pub steady: Latencies,
    /// The streams' inter-token latency from its arrival to its first token.
    pub admitting: Latencies,
    /// The long prompt's time to first token.
    pub admitted_ttft_ms: f64,
    /// Steps from its arrival to its first token.
    pub admission_steps: usize,
}

/// `unit`: the text prompts are cut from.
pub fn run(
    engine: &mut Engine,
    unit: &[u32],
    streams: usize,
    prompt_len: usize,
    admit_len: usize,
    steady_steps: usize,
) -> anyhow::Result<AdmissionReport> {
    anyhow::ensure!(streams > 0 && !unit.is_empty(), "--streams must be at least 1");
    let max_len = engine.config().max_model_len;
    anyhow::ensure!(
        admit_len < max_len && prompt_len < max_len,
        "--admit-prompt-len {admit_len} and --prompt-len {prompt_len} must be below the model length {max_len} \
         (--max-model-len)"
    );
    let text = |skip: usize, n: usize| unit.iter().copied().cycle().skip(skip).take(n).collect::<Vec<u32>>();
    // The streams run until they are cancelled at the end.
    let params = SamplingParams { max_tokens: max_len - prompt_len, ignore_eos: true, ..SamplingParams::default() };
    let ids: Vec<SeqId> = (0..streams)
        .map(|i| engine.add_request(Request { prompt_tokens: text(i * 3 + 1, prompt_len), params: params.clone() }))
        .collect::<Result<_, _>>()?;
    let mut s = Streams { last: vec![None; streams], gaps: [Vec::new(), Vec::new()], ids };
    let mut guard = 0;
    while s.last.iter().any(Option::is_none) {
        s.step(engine, 0, None)?;
        guard += 1;
        anyhow::ensure!(guard < 1_000_000, "the streams never started");
    }
    s.gaps[0].clear();
    for _ in 0..steady_steps {
        s.step(engine, 0, None)?;
    }
    let long = Request {
        prompt_tokens: text(streams * 3 + 7, admit_len),
        params: SamplingParams { max_tokens: 1, ignore_eos: true, ..SamplingParams::default() },
    };
    let arrived = Instant::now();
    let long_id = engine.add_request(long)?;
    let mut admission_steps = 0;
    loop {
        admission_steps += 1;
        if s.step(engine, 1, Some(long_id))? {
            break;
        }
        anyhow::ensure!(admission_steps < 1_000_000, "the long prompt was never admitted");
    }
    let admitted_ttft_ms = arrived.elapsed().as_secs_f64() * 1e3;
    for &id in &s.ids {
        engine.abort(id);
    }
    while engine.has_work() {
        engine.step()?;
    }
    let [steady, admitting] = s.gaps;
    let sched = &engine.config().scheduler;
    Ok(AdmissionReport {
        streams,
        admitted_prompt_len: admit_len,
        long_prefill_token_threshold: sched.long_prefill_token_threshold,
        max_num_batched_tokens: sched.max_num_batched_tokens,
        steady: Latencies::of(steady)?,
        admitting: Latencies::of(admitting)?,
        admitted_ttft_ms,
        admission_steps,
    })
}

/// The decoding streams: when each last got a token, and the gaps between tokens per phase.
struct Streams {
    ids: Vec<SeqId>,
    last: Vec<Option<Instant>>,
    gaps: [Vec<f64>; 2],
}

impl Streams {
    /// One engine step; the streams' gaps go to `phase`. Returns whether `watch` got a token.
    fn step(&mut self, engine: &mut Engine, phase: usize, watch: Option<SeqId>) -> anyhow::Result<bool> {
        let mut seen = false;
        for u in engine.step()? {
            anyhow::ensure!(u.finish.is_none() || Some(u.id) == watch, "a stream finished early: {:?}", u.finish);
            if u.token.is_none() {
                continue;
            }
            let now = Instant::now();
            if Some(u.id) == watch {
                seen = true;
            } else if let Some(i) = self.ids.iter().position(|&id| id == u.id) {
                if let Some(t) = self.last[i].replace(now) {
                    self.gaps[phase].push((now - t).as_secs_f64() * 1e3);
                }
            }
        }
        Ok(seen)
    }
}
