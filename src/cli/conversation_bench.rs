//! `iris bench --conversation-turns N`: a conversation that grows turn by turn (each prompt is
//! the previous prompt, its answer and a new user message), run on two engines built from the
//! same flags, with prefix caching on and off: per turn, the prompt, the tokens read from the
//! cache and the time to first token of each, medians over --repeats conversations (each
//! starts with other tokens, and another picture with --conversation-image, so one
//! conversation never hits another's blocks).
//!
//! The baseline a cache is judged by is the prefill of the tokens it leaves to compute: per
//! turn, a fresh prompt of that many tokens runs alone on the uncached engine ("new tokens
//! alone"). With the cache, a turn's TTFT should stay near it however long the conversation
//! grows; what it adds is the new tokens' attention over the cached context.

use std::time::Instant;

use serde::Serialize;

use super::stats::median;
use crate::engine::{Engine, ImageInput, Request, SamplingParams};

/// One turn's medians.
#[derive(Debug, Serialize, Clone)]
pub struct TurnRow {
    pub turn: usize,
    pub prompt_len: usize,
    pub cached: usize,
    pub ttft_on_ms: f64,
    pub ttft_off_ms: f64,
    /// A fresh prompt of `prompt_len - cached` tokens, alone, without the cache.
    pub ttft_new_alone_ms: f64,
}

/// What every conversation of a run is made of.
pub struct Conversation<'a> {
    /// The text the user messages are cut from (`user_len` tokens each).
    pub unit: &'a [u32],
    /// Tokens the first turn begins with (an image prompt), before its user text.
    pub opening: &'a [u32],
    /// The images `opening` places, for conversation `r`; resent every turn.
    pub images: &'a dyn Fn(usize) -> Vec<ImageInput>,
    /// A token a client never sends back as itself (the image placeholder): an answer that
    /// holds it (a random model's can) is resent with a text token there.
    pub placeholder: Option<u32>,
    pub turns: usize,
    pub user_len: usize,
    /// The answer's length.
    pub gen_len: usize,
}

/// Runs `repeats` conversations on each engine.
pub fn run(on: &mut Engine, off: &mut Engine, c: &Conversation, repeats: usize) -> anyhow::Result<Vec<TurnRow>> {
    anyhow::ensure!(!c.unit.is_empty() && c.turns > 0 && repeats > 0, "nothing to run");
    // Per engine, per turn: TTFTs over the repeats; the cache-on run's cached counts and the
    // new tokens alone.
    let mut ttft = [vec![Vec::new(); c.turns], vec![Vec::new(); c.turns]];
    let mut alone = vec![Vec::new(); c.turns];
    let mut cached = vec![0; c.turns];
    let mut prompt_lens = vec![0; c.turns];
    for r in 0..repeats {
        for (k, engine) in [&mut *on, &mut *off].into_iter().enumerate() {
            // Each conversation encodes its picture afresh, as a new client's would be.
            engine.clear_embed_cache();
            // A different rotation of the text per repeat: its first block differs from the
            // other conversations'.
            let mut text = c.unit.iter().copied().cycle().skip(r * 7 + 1);
            let mut prompt: Vec<u32> = c.opening.to_vec();
            let images = (c.images)(r);
            for t in 0..c.turns {
                prompt.extend(text.by_ref().take(c.user_len));
                let (answer, ms, hit) = turn(engine, &prompt, images.clone(), c.gen_len)?;
                ttft[k][t].push(ms);
                if k == 0 {
                    cached[t] = hit;
                    prompt_lens[t] = prompt.len();
                }
                let unit0 = c.unit[0];
                prompt.extend(answer.into_iter().map(|t| if Some(t) == c.placeholder { unit0 } else { t }));
            }
        }
        // The baseline: as many fresh tokens as the cache left, on the uncached engine (another
        // rotation of the text, one token apart from every conversation's).
        for t in 0..c.turns {
            let fresh: Vec<u32> =
                c.unit.iter().copied().cycle().skip(r * 7 + 4).take(prompt_lens[t] - cached[t]).collect();
            alone[t].push(turn(off, &fresh, Vec::new(), 1)?.1);
        }
    }
    let [on_ms, off_ms] = ttft;
    Ok((0..c.turns)
        .zip(on_ms.into_iter().zip(off_ms).zip(alone))
        .map(|(t, ((a, b), n))| TurnRow {
            turn: t + 1,
            prompt_len: prompt_lens[t],
            cached: cached[t],
            ttft_on_ms: median(a),
            ttft_off_ms: median(b),
            ttft_new_alone_ms: median(n),
        })
        .collect())
}

/// One request alone: its answer, its time to first token (ms) and its cached prompt tokens.
fn turn(
    engine: &mut Engine,
    prompt: &[u32],
    images: Vec<ImageInput>,
    gen_len: usize,
) -> anyhow::Result<(Vec<u32>, f64, usize)> {
    let params = SamplingParams { max_tokens: gen_len, ignore_eos: true, ..SamplingParams::default() };
    let start = Instant::now();
    engine.add_request_with_images(Request { prompt_tokens: prompt.to_vec(), params }, images)?;
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
