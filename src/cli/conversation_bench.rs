//! `iris bench --conversation-turns N`: a conversation that grows turn by turn (each prompt is
//! the previous prompt, its answer and a new user message), run on two engines built from the
//! same flags, with prefix caching on and off: per turn, the prompt, the tokens read from the
//! cache and the time to first token of each, medians over --repeats conversations (each
//! starts with other tokens, so one conversation never hits another's blocks).

use std::time::Instant;

use crate::engine::{Engine, Request, SamplingParams};

/// One turn's medians.
pub struct TurnRow {
    pub turn: usize,
    pub prompt_len: usize,
    pub cached: usize,
    pub ttft_on_ms: f64,
    pub ttft_off_ms: f64,
}

/// Runs `repeats` conversations of `turns` turns on each engine; `unit` is the text the user
/// messages are cut from (`user_len` tokens each), `gen_len` the answer's length.
pub fn run(
    on: &mut Engine,
    off: &mut Engine,
    unit: &[u32],
    turns: usize,
    user_len: usize,
    gen_len: usize,
    repeats: usize,
) -> anyhow::Result<Vec<TurnRow>> {
    anyhow::ensure!(!unit.is_empty() && turns > 0 && repeats > 0, "nothing to run");
    // Per engine, per turn: TTFTs over the repeats; the cache-on run's cached counts.
    let mut ttft = [vec![Vec::new(); turns], vec![Vec::new(); turns]];
    let mut cached = vec![0; turns];
    let mut prompt_lens = vec![0; turns];
    for r in 0..repeats {
        for (k, engine) in [&mut *on, &mut *off].into_iter().enumerate() {
            // A different rotation of the text per repeat: its first block differs from the
            // other conversations'.
            let mut text = unit.iter().copied().cycle().skip(r * 7 + 1);
            let mut prompt: Vec<u32> = Vec::new();
            for t in 0..turns {
                prompt.extend(text.by_ref().take(user_len));
                let (answer, ms, hit) = turn(engine, &prompt, gen_len)?;
                ttft[k][t].push(ms);
                if k == 0 {
                    cached[t] = hit;
                    prompt_lens[t] = prompt.len();
                }
                prompt.extend(answer);
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let [on_ms, off_ms] = ttft;
    Ok((0..turns)
        .zip(on_ms.into_iter().zip(off_ms))
        .map(|(t, (a, b))| TurnRow {
            turn: t + 1,
            prompt_len: prompt_lens[t],
            cached: cached[t],
            ttft_on_ms: median(a),
            ttft_off_ms: median(b),
        })
        .collect())
}

/// One request alone: its answer, its time to first token (ms) and its cached prompt tokens.
fn turn(engine: &mut Engine, prompt: &[u32], gen_len: usize) -> anyhow::Result<(Vec<u32>, f64, usize)> {
    let params = SamplingParams { max_tokens: gen_len, ignore_eos: true, ..SamplingParams::default() };
    let start = Instant::now();
    engine.add_request(Request { prompt_tokens: prompt.to_vec(), params })?;
    let (mut answer, mut first, mut cached) = (Vec::new(), None, 0);
    while engine.has_work() {
        for u in engine.step()? {
            if let Some(t) = u.token {
                first.get_or_insert_with(|| start.elapsed().as_secs_f64() * 1e3);
                answer.push(t.token);
            }
            cached = u.num_cached_tokens;
        }
    }
    Ok((answer, first.unwrap_or(0.0), cached))
}
