//! Turning one row of logits into a token.
//!
//! Pipeline (vLLM's order):
//! 1. logit bias, then min_tokens suppression of EOS / stop tokens;
//! 2. repetition penalty (prompt + output), then frequency / presence (output only);
//! 3. logprobs, if requested, are `log_softmax` of the logits as they are now, i.e.
//!    after bias and penalties but BEFORE temperature and truncation. This is what the
//!    model "thinks" once the request's explicit edits are applied, it does not depend
//!    on how adventurous the sampling is, and the sampled token always has a finite
//!    logprob (it would not after top-k/top-p if we measured a truncated distribution).
//! 4. greedy (argmax, lowest id on ties) when temperature is ~0; otherwise
//!    temperature, top-k, top-p, min-p, and a draw from the renormalised remainder
//!    with the sequence's own RNG.
//!
//! Each sequence owns its RNG, so with a seed its output does not depend on what
//! else shares the batch. Scratch buffers are per thread (not per sequence) so a
//! batch of hundreds of sequences over a 256k vocabulary does not pin hundreds of MB.

use crate::engine::sampling_params::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::cell::RefCell;
use std::cmp::Ordering;

/// The token chosen for one sequence at one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Logprob of `token` (see the module doc for which distribution). NaN when the
    /// request did not ask for logprobs: computing it costs a full pass of `exp`
    /// over the vocabulary, which greedy decoding otherwise avoids.
    pub logprob: f32,
    /// The `params.logprobs` most likely tokens, most likely first (ties: lower id).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Sampling state that lives as long as one sequence.
#[derive(Debug, Clone)]
pub struct SequenceSampler {
    rng: StdRng,
    eos_token_ids: Vec<u32>,
}

/// Per-thread reusable buffers.
#[derive(Default)]
struct Scratch {
    /// (token, scaled logit) candidates for the random path.
    cand: Vec<(u32, f32)>,
    /// One bit per vocabulary entry: "already penalised".
    seen: Vec<u64>,
    /// Sorted copy of the output tokens, to count occurrences.
    ids: Vec<u32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl SequenceSampler {
    /// A sampler seeded with `seed`, or from the OS when `None`.
    pub fn new(seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Self { rng, eos_token_ids: Vec::new() }
    }

    /// A sampler seeded from `params.seed`.
    pub fn for_params(params: &SamplingParams) -> Self {
        Self::new(params.seed)
    }

    /// EOS ids of the model, suppressed (with `params.stop_token_ids`) while fewer
    /// than `params.min_tokens` tokens were generated.
    pub fn with_eos_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.eos_token_ids = ids;
        self
    }

    /// Pick the next token. `logits` is one row of the model's output; it is edited in
    /// place (bias and penalties applied) so no vocabulary-sized copy is made.
    /// `prompt_tokens` and `output_tokens` feed the penalties.
    ///
    /// Non-finite logits (NaN from a broken model, -inf from masking) are never
    /// sampled; if no logit is finite the result is token 0 with a NaN logprob.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> Sampled {
        SCRATCH.with_borrow_mut(|s| {
            process_logits_with(s, logits, params, &self.eos_token_ids, prompt_tokens, output_tokens);
            let token =
                if params.is_greedy() { argmax(logits) } else { self.draw(logits, params, &mut s.cand) }.unwrap_or(0);
            match params.logprobs {
                None => Sampled { token, logprob: f32::NAN, top_logprobs: Vec::new() },
                Some(n) => {
                    let (logprob, top_logprobs) = logprobs(logits, token, n);
                    Sampled { token, logprob, top_logprobs }
                }
            }
        })
    }

    /// Temperature, top-k, top-p, min-p, then a draw. `None` if nothing is finite.
    fn draw(&mut self, logits: &[f32], params: &SamplingParams, cand: &mut Vec<(u32, f32)>) -> Option<u32> {
        let inv_t = 1.0 / params.temperature;
        cand.clear();
        cand.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, l * inv_t)));
        if cand.is_empty() {
            return None;
        }
        let k = params.top_k;
        if k > 0 && k < cand.len() {
            // O(V) partition instead of a full sort; the kept k stay unordered.
            cand.select_nth_unstable_by(k - 1, by_value_desc);
            cand.truncate(k);
        }

        // From here on work with unnormalised probabilities w = exp(l - l_max), computed
        // once: the order is the same as the logits', the most likely token has w = 1,
        // and top-p / min-p / the draw need no further `exp`.
        let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
        }
        if params.top_p < 1.0 {
            top_p_filter(cand, params.top_p);
        }
        if params.min_p > 0.0 {
            // p_i >= min_p * p_max  <=>  w_i >= min_p, since w_max = 1.
            cand.retain(|&(_, w)| w >= params.min_p);
        }

        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        let mut u = self.rng.random::<f64>() * total;
        for &(id, w) in cand.iter() {
            let w = w as f64;
            if u < w {
                return Some(id);
            }
            u -= w;
        }
        // Only reachable through rounding in the running subtraction.
        cand.iter().rev().find(|c| c.1 > 0.0).map(|c| c.0)
    }
}

/// One row of a batch for [`sample_batch`].
pub struct SampleRow<'a> {
    pub logits: &'a mut [f32],
    pub sampler: &'a mut SequenceSampler,
    pub params: &'a SamplingParams,
    pub prompt_tokens: &'a [u32],
    pub output_tokens: &'a [u32],
}

/// Sample every row in parallel; results are in row order. An engine with a
/// contiguous `[B, V]` host buffer builds the rows with `logits.chunks_mut(V)`.
pub fn sample_batch(rows: Vec<SampleRow<'_>>) -> Vec<Sampled> {
    rows.into_par_iter().map(|r| r.sampler.sample(r.logits, r.params, r.prompt_tokens, r.output_tokens)).collect()
}

/// Apply logit bias, min_tokens suppression and penalties in place (steps 1-2 of the
/// pipeline). Public so a device-side sampler can share the exact semantics.
pub fn process_logits(
    logits: &mut [f32],
    params: &SamplingParams,
    eos_token_ids: &[u32],
    prompt_tokens: &[u32],
    output_tokens: &[u32],
) {
    SCRATCH.with_borrow_mut(|s| process_logits_with(s, logits, params, eos_token_ids, prompt_tokens, output_tokens))
}

fn process_logits_with(
    s: &mut Scratch,
    logits: &mut [f32],
    params: &SamplingParams,
    eos_token_ids: &[u32],
    prompt_tokens: &[u32],
    output_tokens: &[u32],
) {
    let vocab = logits.len();
    // Out-of-range ids are skipped (get_mut) rather than trusted: validate() reports them.
    for &(id, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += bias;
        }
    }

    if output_tokens.len() < params.min_tokens {
        let eos = if params.ignore_eos { &[][..] } else { eos_token_ids };
        for &id in params.stop_token_ids.iter().chain(eos) {
            if let Some(l) = logits.get_mut(id as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    let rep = params.repetition_penalty;
    if rep != 1.0 {
        // A bitset makes this O(prompt + output) per step without a sort, and the
        // penalty hits each distinct token exactly once.
        s.seen.clear();
        s.seen.resize(vocab.div_ceil(64), 0);
        for &t in prompt_tokens.iter().chain(output_tokens) {
            let t = t as usize;
            if t >= vocab {
                continue;
            }
            let (word, bit) = (t / 64, 1u64 << (t % 64));
            if s.seen[word] & bit == 0 {
                s.seen[word] |= bit;
                let l = &mut logits[t];
                *l = if *l > 0.0 { *l / rep } else { *l * rep };
            }
        }
    }

    let (freq, pres) = (params.frequency_penalty, params.presence_penalty);
    if (freq != 0.0 || pres != 0.0) && !output_tokens.is_empty() {
        s.ids.clear();
        s.ids.extend_from_slice(output_tokens);
        s.ids.sort_unstable();
        for run in s.ids.chunk_by(|a, b| a == b) {
            if let Some(l) = logits.get_mut(run[0] as usize) {
                *l -= freq * run.len() as f32 + pres;
            }
        }
    }
}

/// Descending by value (logit or probability), then ascending id, so every selection
/// is deterministic.
fn by_value_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Argmax over finite logits; ties go to the lowest id.
fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_finite() && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// Keep the smallest most-likely prefix whose mass reaches `top_p` (at least one).
/// `cand` holds (token, unnormalised probability).
///
/// Sorting a 256k vocabulary costs ~10 ms. Instead this is a quickselect on mass:
/// partition around a split, sum the upper part, and continue in the part that holds
/// the cut-off: O(V) expected, and only the last <= 64 candidates get sorted. The
/// first split is small because real nuclei are usually a few dozen tokens.
fn top_p_filter(cand: &mut Vec<(u32, f32)>, top_p: f32) {
    const SORT_BELOW: usize = 64;
    let mass = |c: &[(u32, f32)]| c.iter().map(|c| c.1 as f64).sum::<f64>();
    let target = top_p as f64 * mass(cand);

    // Invariant: cand[..lo] are the lo most likely candidates, with mass `before`
    // short of the target, and the cut-off lies in cand[lo..hi].
    let (mut lo, mut hi, mut before) = (0, cand.len(), 0.0f64);
    let mut split = SORT_BELOW;
    while hi - lo > SORT_BELOW {
        // 1 <= split < hi - lo, so the range shrinks either way.
        let mid = lo + split;
        cand[lo..hi].select_nth_unstable_by(split - 1, by_value_desc);
        let upper = mass(&cand[lo..mid]);
        if before + upper >= target {
            hi = mid;
        } else {
            before += upper;
            lo = mid;
        }
        split = (hi - lo) / 2;
    }
    cand[lo..hi].sort_unstable_by(by_value_desc);
    let mut cum = before;
    for i in lo..hi {
        cum += cand[i].1 as f64;
        if cum >= target {
            cand.truncate(i + 1);
            return;
        }
    }
    // Rounding left us just short of the target: keep everything up to `hi`.
    cand.truncate(hi.max(1));
}

/// log_softmax of `logits` at `token`, and the `n` most likely tokens.
pub(crate) fn logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return (f32::NAN, Vec::new());
    }
    let sum: f64 = logits.iter().filter(|l| l.is_finite()).map(|&l| (l - max).exp() as f64).sum();
    let lse = max + sum.ln() as f32;

    // n <= 20, so an insertion-sorted short list beats selecting over the vocabulary.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if !l.is_finite() || (top.len() == n && top.last().is_some_and(|t| l <= t.1)) {
                continue;
            }
            // Ascending scan: an equal logit goes after the earlier (lower) id.
            let pos = top.partition_point(|t| t.1 >= l);
            top.insert(pos, (i as u32, l));
            top.truncate(n);
        }
    }
    for t in &mut top {
        t.1 -= lse;
    }
    let lp = logits.get(token as usize).map_or(f32::NAN, |&l| l - lse);
    (lp, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..Default::default() }
    }

    /// Log-probabilities of a hand-made distribution, usable as logits.
    fn logits_of(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn counts(logits: &[f32], p: &SamplingParams, draws: usize, seed: u64) -> Vec<usize> {
        let mut s = SequenceSampler::new(Some(seed));
        let mut c = vec![0; logits.len()];
        for _ in 0..draws {
            let mut row = logits.to_vec();
            c[s.sample(&mut row, p, &[], &[]).token as usize] += 1;
        }
        c
    }

    fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
        let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f64> = logits.iter().map(|&l| (((l - m) / t) as f64).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|x| x / z).collect()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = SequenceSampler::new(Some(0));
        let mut l = vec![0.1, 3.0, -2.0, 3.0, f32::NAN];
        assert_eq!(s.sample(&mut l, &params(0.0), &[], &[]).token, 1);
        let mut l = vec![f32::NEG_INFINITY, -5.0, -4.0];
        assert_eq!(s.sample(&mut l, &params(0.0), &[], &[]).token, 2);
    }

    #[test]
    fn top_k_never_leaves_the_top_k() {
        let l = logits_of(&[0.4, 0.35, 0.25]);
        let p = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let c = counts(&l, &p, 1000, 1);
        assert_eq!(c[2], 0);
        assert!(c[0] > 300 && c[1] > 300, "{c:?}");
        // top_k larger than the vocabulary is clamped, not an error.
        let p = SamplingParams { temperature: 1.0, top_k: 10, ..Default::default() };
        assert!(counts(&l, &p, 1000, 1)[2] > 150);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        let l = logits_of(&[0.05, 0.5, 0.15, 0.3]);
        // 0.5 + 0.3 = 0.8 >= 0.75: tokens 1 and 3 only.
        let p = SamplingParams { temperature: 1.0, top_p: 0.75, ..Default::default() };
        let c = counts(&l, &p, 2000, 2);
        assert_eq!((c[0], c[2]), (0, 0), "{c:?}");
        // Renormalised: 0.5/0.8 = 0.625.
        assert!((c[1] as f64 / 2000.0 - 0.625).abs() < 0.04, "{c:?}");
        // 0.85 needs the 0.15 token too, but never the 0.05 one.
        let p = SamplingParams { temperature: 1.0, top_p: 0.85, ..Default::default() };
        let c = counts(&l, &p, 2000, 3);
        assert_eq!(c[0], 0);
        assert!(c[2] > 100, "{c:?}");
        // Tiny top_p still keeps the single most likely token.
        let p = SamplingParams { temperature: 1.0, top_p: 1e-6, ..Default::default() };
        assert_eq!(counts(&l, &p, 200, 4)[1], 200);
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_threshold() {
        let l = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        // Threshold 0.2 * 0.5 = 0.1: drops only the 0.05 token.
        let p = SamplingParams { temperature: 1.0, min_p: 0.2, ..Default::default() };
        let c = counts(&l, &p, 2000, 5);
        assert_eq!(c[3], 0);
        assert!(c[2] > 150, "{c:?}");
        // Threshold 0.5 * 0.5 = 0.25: keeps 0 and 1.
        let p = SamplingParams { temperature: 1.0, min_p: 0.5, ..Default::default() };
        let c = counts(&l, &p, 2000, 6);
        assert_eq!((c[2], c[3]), (0, 0), "{c:?}");
    }

    #[test]
    fn temperature_sampling_matches_softmax() {
        let l = vec![1.0, 0.5, 0.0, -0.5, 2.0, -1.0];
        for (t, seed) in [(1.0, 7), (0.7, 8), (1.8, 9)] {
            let draws = 20_000;
            let c = counts(&l, &params(t), draws, seed);
            let expected = softmax(&l, t);
            let chi2: f64 = c
                .iter()
                .zip(&expected)
                .map(|(&o, &p)| {
                    let e = p * draws as f64;
                    (o as f64 - e).powi(2) / e
                })
                .sum();
            // 5 degrees of freedom: P(chi2 > 20.5) = 0.001.
            assert!(chi2 < 20.5, "t={t} chi2={chi2} counts={c:?} expected={expected:?}");
        }
    }

    #[test]
    fn seeds_are_reproducible_and_independent_of_the_batch() {
        let l: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let p = params(1.0);
        let run = |seed: u64| -> Vec<u32> {
            let mut s = SequenceSampler::new(Some(seed));
            (0..100).map(|_| s.sample(&mut l.clone(), &p, &[], &[]).token).collect()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));

        // Same seed inside a batch, next to another (unseeded) sequence.
        let mut a = SequenceSampler::new(Some(42));
        let mut b = SequenceSampler::new(None);
        let mut got = Vec::new();
        for _ in 0..100 {
            let (mut la, mut lb) = (l.clone(), l.clone());
            let out = sample_batch(vec![
                SampleRow { logits: &mut lb, sampler: &mut b, params: &p, prompt_tokens: &[], output_tokens: &[] },
                SampleRow { logits: &mut la, sampler: &mut a, params: &p, prompt_tokens: &[], output_tokens: &[] },
            ]);
            got.push(out[1].token);
        }
        assert_eq!(got, run(42));
    }

    #[test]
    fn penalties_follow_the_formulas() {
        let mut l = vec![2.0, -1.0, 0.5, 3.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        // Prompt {0, 1}; output {1, 2, 2}; token 3 and 4 unseen.
        process_logits(&mut l, &p, &[], &[0, 1, 0], &[1, 2, 2]);
        let want = [
            2.0 / 2.0,         // positive: divided, once despite appearing twice
            -2.0 - 0.5 - 0.25, // negative: multiplied by 2; then 1 occurrence + presence
            0.5 / 2.0 - 2.0 * 0.5 - 0.25,
            3.0,
            1.0,
        ];
        for (got, want) in l.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{l:?} vs {want:?}");
        }
    }

    #[test]
    fn logit_bias_and_min_tokens() {
        let mut s = SequenceSampler::new(Some(0)).with_eos_token_ids(vec![0]);
        let p = SamplingParams { logit_bias: vec![(2, 10.0)], ..Default::default() };
        assert_eq!(s.sample(&mut [5.0, 1.0, 0.0], &p, &[], &[]).token, 2);

        let p = SamplingParams { min_tokens: 2, stop_token_ids: vec![1], ..Default::default() };
        assert_eq!(s.sample(&mut [5.0, 4.0, 0.0], &p, &[], &[7]).token, 2);
        assert_eq!(s.sample(&mut [5.0, 4.0, 0.0], &p, &[], &[7, 7]).token, 0);
        let p = SamplingParams { ignore_eos: true, ..p };
        assert_eq!(s.sample(&mut [5.0, 4.0, 0.0], &p, &[], &[7]).token, 0);
    }

    #[test]
    fn logprobs_are_normalised_sorted_and_temperature_free() {
        let l = vec![0.3, 2.0, -1.0, 2.0, 0.0];
        let mut s = SequenceSampler::new(Some(3));
        let p = SamplingParams { temperature: 0.5, logprobs: Some(5), ..Default::default() };
        let out = s.sample(&mut l.clone(), &p, &[], &[]);
        let total: f32 = out.top_logprobs.iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let ids: Vec<u32> = out.top_logprobs.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 0, 4, 2]);
        let own = out.top_logprobs.iter().find(|t| t.0 == out.token).map(|t| t.1);
        assert_eq!(own, Some(out.logprob));
        // Measured before temperature: equal to the T=1 log_softmax.
        let want = softmax(&l, 1.0);
        for &(id, lp) in &out.top_logprobs {
            assert!((lp as f64 - want[id as usize].ln()).abs() < 1e-5);
        }

        let p = SamplingParams { logprobs: Some(2), ..Default::default() };
        let out = s.sample(&mut l.clone(), &p, &[], &[]);
        assert_eq!(out.top_logprobs.len(), 2);
        let p = SamplingParams { logprobs: Some(0), ..Default::default() };
        let out = s.sample(&mut l.clone(), &p, &[], &[]);
        assert!(out.top_logprobs.is_empty());
        assert!((out.logprob as f64 - want[1].ln()).abs() < 1e-5);
        assert!(s.sample(&mut l.clone(), &params(0.0), &[], &[]).logprob.is_nan());
    }

    #[test]
    fn top_p_quickselect_matches_a_full_sort() {
        let mut x = 12345u64;
        let weights: Vec<f32> = (0..5000)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32).powi(6) // skewed, like real logits
            })
            .collect();
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        let mut order: Vec<u32> = (0..weights.len() as u32).collect();
        order.sort_by(|&a, &b| by_value_desc(&(a, weights[a as usize]), &(b, weights[b as usize])));
        for top_p in [0.001f32, 0.1, 0.5, 0.9, 0.99, 0.999999] {
            let mut cum = 0.0;
            let n = order
                .iter()
                .position(|&id| {
                    cum += weights[id as usize] as f64;
                    cum >= top_p as f64 * total
                })
                .map_or(order.len(), |i| i + 1);
            let mut cand: Vec<(u32, f32)> = weights.iter().enumerate().map(|(i, &w)| (i as u32, w)).collect();
            top_p_filter(&mut cand, top_p);
            let mut got: Vec<u32> = cand.iter().map(|c| c.0).collect();
            got.sort_unstable();
            let mut want = order[..n].to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "top_p={top_p}");
        }
    }

    #[test]
    fn large_vocab_filters_agree_with_a_full_sort() {
        let vocab = 200_000;
        // Deterministic pseudo-random logits with a few dominant tokens.
        let mut x = 0x9E3779B97F4A7C15u64;
        let l: Vec<f32> = (0..vocab)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let base = (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0;
                if i % 9973 == 0 {
                    base + 9.0
                } else {
                    base
                }
            })
            .collect();
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));

        let p = SamplingParams { temperature: 1.0, top_k: 50, ..Default::default() };
        let top50 = &order[..50];
        let mut s = SequenceSampler::new(Some(11));
        for _ in 0..200 {
            assert!(top50.contains(&s.sample(&mut l.clone(), &p, &[], &[]).token));
        }

        let top_p = 0.9;
        let probs = softmax(&l, 1.0);
        let mut cum = 0.0;
        let nucleus = order
            .iter()
            .take_while(|&&id| {
                let before = cum;
                cum += probs[id as usize];
                before < top_p
            })
            .count();
        let p = SamplingParams { temperature: 1.0, top_p: top_p as f32, ..Default::default() };
        let mut seen_outside_head = false;
        for _ in 0..200 {
            let t = s.sample(&mut l.clone(), &p, &[], &[]).token;
            let rank = order.iter().position(|&id| id == t).unwrap_or(usize::MAX);
            assert!(rank < nucleus, "rank {rank} outside nucleus of {nucleus}");
            seen_outside_head |= rank >= 21;
        }
        // The nucleus here is far larger than the 21 boosted tokens; make sure the
        // growing-prefix search actually reached into it.
        assert!(nucleus > 64 && seen_outside_head, "nucleus {nucleus}");
    }
}
