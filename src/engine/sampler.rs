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

use crate::engine::grammar::{Constraint, RowMasks};
use crate::engine::sampling_params::SamplingParams;
use crate::ops::argmax::argmax_row as argmax;
use crate::ops::sample::{draw_row, kept, DraftCheck, Draw, Kept};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::cell::RefCell;

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

impl Sampled {
    /// A token picked without logprobs (by a device, from the logits as they are).
    pub fn token_only(token: u32) -> Self {
        Sampled { token, logprob: f32::NAN, top_logprobs: Vec::new() }
    }
}

/// The distribution a draft was drawn from (speculative decoding's q), for verification to
/// judge it by p(d) / q(d) and to draw from the residual max(p - q, 0) when it is rejected.
/// Empty: a point mass on the draft (a draft chosen without sampling: n-gram, greedy, replay),
/// for which that rule is "accept with p(d), else draw from p less d".
///
/// The tokens of nonzero probability sorted by id, as `ops::sample::Kept` keeps the target's
/// row, so verification merges the two in one pass. Sparse because a sampled draft is
/// usually cut by top-k / top-p / min-p to a few tokens; untruncated it costs 8 bytes per
/// token with any mass, about a dense row's f32s. The probabilities are f32: their rounding
/// (2^-24 relative) is the only way in which q departs from what the draft was drawn from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraftDist {
    probs: Vec<(u32, f32)>,
}

impl DraftDist {
    /// A point mass on the draft (what an empty `Sequence::draft_q` means for every draft).
    pub fn point() -> Self {
        Self::default()
    }

    pub fn is_point(&self) -> bool {
        self.probs.is_empty()
    }

    /// q(token); 0 outside the distribution.
    pub fn prob(&self, token: u32) -> f32 {
        self.probs.binary_search_by_key(&token, |e| e.0).map_or(0.0, |i| self.probs[i].1)
    }
}

/// Sampling state that lives as long as one sequence.
#[derive(Debug, Clone)]
pub struct SequenceSampler {
    rng: StdRng,
    /// Draws the drafts of a drafter that samples (`draw_draft`): apart from `rng` so that the
    /// target's tokens take the same numbers with and without speculation's drafts.
    draft_rng: StdRng,
    eos_token_ids: Vec<u32>,
}

/// Per-thread reusable buffers.
#[derive(Default)]
struct Scratch {
    /// (order key, token) candidates for the random path.
    cand: Vec<(u32, u32)>,
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
        let (rng, draft_rng) = match seed {
            // The draft stream from the seed through a different derivation than
            // `seed_from_u64`, so it is no other seed's main stream.
            Some(s) => {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&s.to_le_bytes());
                key[8..14].copy_from_slice(b"drafts");
                (StdRng::seed_from_u64(s), StdRng::from_seed(key))
            }
            None => (StdRng::from_rng(&mut rand::rng()), StdRng::from_rng(&mut rand::rng())),
        };
        Self { rng, draft_rng, eos_token_ids: Vec::new() }
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
        self.sample_constrained(logits, params, prompt_tokens, output_tokens, None)
    }

    /// `sample` within a grammar: the tokens `constraint` does not allow next are masked out
    /// (-inf) before anything else, so neither the draw nor logprobs see them.
    pub fn sample_constrained(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        constraint: Option<&mut Constraint>,
    ) -> Sampled {
        let masks = constraint.map(|c| c.row_masks(&[]));
        self.sample_masked(logits, params, prompt_tokens, output_tokens, masks.as_ref())
    }

    /// `sample_constrained` with the grammar's mask computed beforehand.
    pub fn sample_masked(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        masks: Option<&RowMasks>,
    ) -> Sampled {
        if let Some(m) = masks {
            m.apply(0, logits);
        }
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

    /// Verifies a sequence's draft tokens against the target model: `rows[i]` are the logits
    /// after the sequence's last token and then after each of `drafts[..i]` (so one row more
    /// than drafts). Returns the tokens to append: the drafts accepted in order, then one more
    /// (from the row that rejected, or after the last draft), at least one token in all.
    ///
    /// Each row is processed as `sample` would process it with the drafts before it already
    /// output (penalties, min_tokens). Greedy: a draft is accepted when it is the row's argmax,
    /// so the tokens equal those of decoding one at a time. Sampled: rejection sampling for a
    /// deterministic draft keeps the target distribution exactly: draft x is accepted with
    /// probability p(x); on rejection the token is drawn from p with x removed, renormalised.
    /// (A draft drawn from a distribution q of its own: `verify_masked` with its q.)
    /// Logprobs are those of the row the token came from, as without speculation.
    pub fn verify(
        &mut self,
        rows: &mut [Vec<f32>],
        drafts: &[u32],
        params: &SamplingParams,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> Vec<Sampled> {
        self.verify_constrained(rows, drafts, params, prompt_tokens, output_tokens, None)
    }

    /// `verify` within a grammar: row i is masked by `constraint` as it stands after the
    /// drafts before it, so a draft the grammar rejects is never accepted (its logit is -inf:
    /// not the argmax, and of zero mass). The drafts are consumed only to mask the rows after
    /// them and rolled back: the output processor consumes what was accepted.
    pub fn verify_constrained(
        &mut self,
        rows: &mut [Vec<f32>],
        drafts: &[u32],
        params: &SamplingParams,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        constraint: Option<&mut Constraint>,
    ) -> Vec<Sampled> {
        let masks = constraint.map(|c| c.row_masks(drafts));
        self.verify_masked(rows, drafts, &[], params, prompt_tokens, output_tokens, masks.as_ref())
    }

    /// `verify_constrained` with the grammar's masks computed beforehand, and `draft_q[i]` the
    /// distribution draft i was drawn from (empty: every draft a point mass). A sampled row
    /// judges a draft d with a distribution by Leviathan et al.'s rule: accepted with
    /// probability min(1, p(d) / q(d)), else the token is drawn from max(p - q, 0)
    /// renormalised, so the output follows p exactly whatever q is. Either way it takes the
    /// same numbers from the generator (one to judge, one more for the residual), those that
    /// `settle_verify` takes.
    #[allow(clippy::too_many_arguments)]
    pub fn verify_masked(
        &mut self,
        rows: &mut [Vec<f32>],
        drafts: &[u32],
        draft_q: &[DraftDist],
        params: &SamplingParams,
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        masks: Option<&RowMasks>,
    ) -> Vec<Sampled> {
        debug_assert_eq!(rows.len(), drafts.len() + 1);
        debug_assert!(draft_q.is_empty() || draft_q.len() == drafts.len());
        let point = DraftDist::point();
        let mut history = Vec::with_capacity(output_tokens.len() + drafts.len());
        history.extend_from_slice(output_tokens);
        history.extend_from_slice(drafts);
        let mut out = Vec::with_capacity(rows.len());
        SCRATCH.with_borrow_mut(|s| {
            for (i, logits) in rows.iter_mut().enumerate() {
                let output = &history[..output_tokens.len() + i];
                if let Some(m) = masks {
                    m.apply(i, logits);
                }
                process_logits_with(s, logits, params, &self.eos_token_ids, prompt_tokens, output);
                let (token, accepted) = match drafts.get(i) {
                    None => {
                        let t =
                            if params.is_greedy() { argmax(logits) } else { self.draw(logits, params, &mut s.cand) };
                        (t.unwrap_or(0), false)
                    }
                    Some(&draft) => self.judge(logits, draft, draft_q.get(i).unwrap_or(&point), params, &mut s.cand),
                };
                out.push(match params.logprobs {
                    None => Sampled::token_only(token),
                    Some(n) => {
                        let (logprob, top_logprobs) = logprobs(logits, token, n);
                        Sampled { token, logprob, top_logprobs }
                    }
                });
                if !accepted {
                    break;
                }
            }
        });
        out
    }

    /// One draft, drawn from `q`, against its row: (the token to append, whether it is the draft).
    fn judge(
        &mut self,
        logits: &[f32],
        draft: u32,
        q: &DraftDist,
        params: &SamplingParams,
        cand: &mut Vec<(u32, u32)>,
    ) -> (u32, bool) {
        if params.is_greedy() {
            let t = argmax(logits).unwrap_or(0);
            return (t, t == draft);
        }
        let accept = self.next_draw(params);
        let Some(kept) = kept(logits, &accept, cand) else {
            // Nothing finite: rejected, taking the residual's number all the same (as a
            // device verifying the row does; see `settle_verify`).
            self.rng.random::<f32>();
            return (0, false);
        };
        let accepted = if q.is_point() {
            kept.accepts(draft, accept.u)
        } else {
            // u < p(d) / q(d), as u q(d) < p(d): a 24-bit by 24-bit product, exact in f64, so a
            // q equal to p (up to its f32 rounding) accepts always. A draft outside its own q
            // (a drafter's mistake) is accepted wherever p has it.
            (accept.u as f64) * (q.prob(draft) as f64) < kept.prob_of(draft)
        };
        if accepted {
            return (draft, true);
        }
        let residual = self.rng.random::<f32>();
        (residual_pick(&kept, draft, q, residual).unwrap_or(0), false)
    }

    /// A draft for a drafter that samples (an MTP head, say), drawn from its `head_logits`
    /// shaped as the target's rows are by `params` (temperature, top-k, top-p, min-p; not
    /// penalties, bias or grammar, which verification applies to p: exactness needs only that
    /// the draft comes from the q handed over), with a generator of its own seeded from the
    /// request's seed (so a seeded request repeats, and the target's generator takes the same
    /// numbers as without drafts). Returns the draft and q, for `Sequence::draft_q`. Greedy
    /// params: the argmax and a point mass (greedy verification compares argmaxes). Nothing
    /// finite: token 0 as a point mass (judged like any deterministic draft).
    pub fn draw_draft(&mut self, head_logits: &mut [f32], params: &SamplingParams) -> (u32, DraftDist) {
        if params.is_greedy() {
            return (argmax(head_logits).unwrap_or(0), DraftDist::point());
        }
        let d = Draw { u: self.draft_rng.random::<f32>(), ..draw_shape(params) };
        SCRATCH.with_borrow_mut(|s| {
            let Some(kept) = kept(head_logits, &d, &mut s.cand) else { return (0, DraftDist::point()) };
            let token = kept.pick(d.u, None).unwrap_or(0);
            let probs: Vec<(u32, f32)> = kept.probs().map(|(t, p)| (t, p as f32)).collect();
            // One token kept: q is the point mass on it, whose rule is the cheaper one.
            let q = if probs.len() > 1 { DraftDist { probs } } else { DraftDist::point() };
            (token, q)
        })
    }

    /// Temperature, top-k, top-p, min-p, then a draw (`ops::sample` defines them, for the
    /// host and the device alike). `None` if nothing is finite.
    fn draw(&mut self, logits: &[f32], params: &SamplingParams, cand: &mut Vec<(u32, u32)>) -> Option<u32> {
        draw_row(logits, &self.next_draw(params), cand)
    }

    /// The draw of this step for a non-greedy row; takes one number from the generator.
    fn next_draw(&mut self, params: &SamplingParams) -> Draw {
        Draw { u: self.rng.random::<f32>(), ..draw_shape(params) }
    }

    /// The draws a device makes to verify `drafts` (rows after the last token and after each
    /// draft, as `verify` takes them), when nothing but the draws shapes those rows (see
    /// `draws_plainly`). Greedy rows take their argmax. Sampled rows take the uniforms `verify`
    /// would take, in its order: row i judges draft i with u_i and, rejected, draws the residual
    /// with u_(i+1), the number `verify` takes next in that case; the last row draws with u_k.
    /// The generator is not advanced here: `settle_verify` does it once the outcome is known.
    pub fn verify_draws(&self, params: &SamplingParams, drafts: &[u32]) -> Vec<Draw> {
        if params.is_greedy() {
            return vec![Draw::greedy(); drafts.len() + 1];
        }
        let mut probe = self.rng.clone();
        let mut draws: Vec<Draw> =
            (0..=drafts.len()).map(|_| Draw { u: probe.random::<f32>(), ..draw_shape(params) }).collect();
        for i in 0..drafts.len() {
            draws[i].draft = Some(DraftCheck { token: drafts[i], u_residual: draws[i + 1].u });
        }
        draws
    }

    /// Advances the generator as `verify` would have for `num_draft` drafts of which the first
    /// `accepted` were: one number per judged draft, and one for the token after.
    pub fn settle_verify(&mut self, params: &SamplingParams, num_draft: usize, accepted: usize) {
        if !params.is_greedy() {
            for _ in 0..(accepted + 2).min(num_draft + 1) {
                self.rng.random::<f32>();
            }
        }
    }

    /// The draw a device makes for this row, when nothing but the draw shapes it (no bias,
    /// penalty, min_tokens or logprobs: see `draws_plainly`); takes from the generator exactly
    /// what `sample` would, so host and device give a seeded sequence the same tokens.
    pub fn device_draw(&mut self, params: &SamplingParams) -> Draw {
        if params.is_greedy() {
            Draw::greedy()
        } else {
            self.next_draw(params)
        }
    }
}

/// A non-greedy row's draw for `params`, u still to be set.
fn draw_shape(params: &SamplingParams) -> Draw {
    Draw {
        inv_temperature: 1.0 / params.temperature,
        top_k: params.top_k.min(u32::MAX as usize) as u32,
        top_p: params.top_p,
        min_p: params.min_p,
        u: 0.0,
        draft: None,
    }
}

/// The token drawn after `draft`, drawn from `q`, was rejected: from max(p - q, 0)
/// renormalised, p the kept distribution; for a point mass that is p with the draft removed.
/// (Tests swap in a wrong residual to show the distribution tests catch it.)
fn residual_pick(kept: &Kept<'_>, draft: u32, q: &DraftDist, u: f32) -> Option<u32> {
    #[cfg(test)]
    if WRONG_RESIDUAL.with(|w| w.get()) {
        return kept.pick(u, None); // the target distribution itself: over-weights the draft
    }
    if q.is_point() {
        return kept.pick(u, Some(draft));
    }
    let total: f64 = p_less_q(kept, q).map(|(_, r)| r).sum();
    if total <= 0.0 {
        // p <= q everywhere only when p == q, which accepts always; kept for safety.
        return kept.pick(u, None);
    }
    let x = u as f64 * total;
    let (mut acc, mut last) = (0.0, None);
    for (t, r) in p_less_q(kept, q).filter(|&(_, r)| r > 0.0) {
        acc += r;
        if x < acc {
            return Some(t);
        }
        last = Some(t); // rounding can leave x at the very end
    }
    last
}

/// max(p(t) - q(t), 0) over the kept tokens t, by id: one merge of the two id-sorted lists
/// (tokens outside p have no residual).
fn p_less_q<'a>(kept: &'a Kept<'_>, q: &'a DraftDist) -> impl Iterator<Item = (u32, f64)> + 'a {
    let mut j = 0;
    kept.probs().map(move |(t, p)| {
        while q.probs.get(j).is_some_and(|e| e.0 < t) {
            j += 1;
        }
        let qt = q.probs.get(j).filter(|e| e.0 == t).map_or(0.0, |e| e.1 as f64);
        (t, (p - qt).max(0.0))
    })
}

/// Whether `sample` would draw from the model's logits as they are for a sequence with
/// `n_output` tokens so far, but for its grammar's mask: no bias or penalty edits them, no
/// logprobs. A device can then mask the row and draw the token itself
/// (`SequenceSampler::device_draw`, `ops::token_mask`) and copy back only its id.
pub fn draws_plainly(params: &SamplingParams, n_output: usize) -> bool {
    params.logprobs.is_none()
        && params.logit_bias.is_empty()
        && params.repetition_penalty == 1.0
        && ((params.frequency_penalty == 0.0 && params.presence_penalty == 0.0) || n_output == 0)
        && n_output >= params.min_tokens
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
thread_local! {
    /// Tests only: makes `residual_pick` draw from the target distribution itself (a wrong
    /// residual), to show the distribution tests catch it.
    pub(crate) static WRONG_RESIDUAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
pub(crate) mod tests;
