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
    if tests::WRONG_RESIDUAL.with(|w| w.get()) {
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
/// `n_output` tokens so far: no grammar masks them, no bias or penalty edits them, no
/// logprobs. A device can then draw the token itself (`SequenceSampler::device_draw`) and copy
/// back only its id.
pub fn draws_plainly(params: &SamplingParams, n_output: usize) -> bool {
    params.grammar.is_none()
        && params.logprobs.is_none()
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
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Makes `residual_pick` draw from the target distribution itself (a wrong residual).
        pub(crate) static WRONG_RESIDUAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

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
    /// Chi-square of observed counts against probabilities (cells with p = 0 must be empty).
    fn chi2(counts: &[usize], p: &[f32]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&o, &p)| {
                if p == 0.0 {
                    assert_eq!(o, 0, "a token of probability 0 was drawn");
                    return 0.0;
                }
                let e = p as f64 * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// Speculation with rejection sampling draws the first token from the target distribution
    /// (with and without truncation), and the token after an accepted draft from the next row's.
    /// Each case has 3 degrees of freedom: P(chi2 > 16.27) = 0.001. Returns the largest chi2.
    fn speculative_chi2() -> f64 {
        let p0 = [0.1, 0.4, 0.3, 0.2];
        let p1 = [0.25, 0.35, 0.15, 0.25];
        let mut worst: f64 = 0.0;
        // (params, first draft, the first row's target distribution)
        let truncated = [0.0, 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9];
        let cases = [
            (SamplingParams { temperature: 1.0, ..Default::default() }, 2u32, p0),
            (SamplingParams { temperature: 1.0, ..Default::default() }, 1, p0),
            // The draft is outside top-k 3: always rejected, the residual is the whole target.
            (SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() }, 0, truncated),
            (SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() }, 3, truncated),
        ];
        for (params, draft, target) in cases {
            let (mut first, mut second) = (vec![0usize; 4], vec![0usize; 4]);
            for seed in 0..20_000u64 {
                let mut s = SequenceSampler::new(Some(seed));
                let mut rows = vec![logits_of(&p0), logits_of(&p1), logits_of(&p1)];
                let out = s.verify(&mut rows, &[draft, 1], &params, &[], &[]);
                assert!(!out.is_empty() && out.len() <= 3);
                first[out[0].token as usize] += 1;
                match out.get(1) {
                    Some(t) => second[t.token as usize] += 1,
                    // (A wrong residual may "reject" into the draft itself.)
                    None => assert!(
                        out[0].token != draft || WRONG_RESIDUAL.with(|w| w.get()),
                        "an accepted draft is followed"
                    ),
                }
            }
            worst = worst.max(chi2(&first, &target));
            if second.iter().sum::<usize>() > 1000 {
                // Top-3 of p1 keeps ids 1, 0 and 3 (0.35, 0.25, 0.25).
                let p1t = if params.top_k == 3 { [0.25 / 0.85, 0.35 / 0.85, 0.0, 0.25 / 0.85] } else { p1 };
                worst = worst.max(chi2(&second, &p1t));
            }
        }
        worst
    }

    #[test]
    fn rejection_sampling_keeps_the_target_distribution() {
        let worst = speculative_chi2();
        assert!(worst < 16.27, "chi2 {worst}");
    }

    #[test]
    fn the_distribution_test_catches_a_wrong_residual() {
        WRONG_RESIDUAL.with(|w| w.set(true));
        let worst = speculative_chi2();
        WRONG_RESIDUAL.with(|w| w.set(false));
        assert!(worst > 1000.0, "a residual that keeps the draft went unnoticed: chi2 {worst}");
    }

    /// Probabilities as a dense row over `n` tokens (0 where q has none).
    fn dense(q: &DraftDist, n: usize) -> Vec<f32> {
        (0..n as u32).map(|t| q.prob(t)).collect()
    }

    /// Speculation with drafts sampled from a q of their own (`draw_draft`, then Leviathan et
    /// al.'s rule in `verify_masked`), at temperature 1 with and without top-k / top-p: the
    /// first token follows the first row's target distribution and the token after an accepted
    /// draft the next row's, whatever q is. Returns each case's largest chi2 (3 degrees of
    /// freedom: P(chi2 > 16.27) = 0.001); it also checks that the drafts follow the q returned.
    fn sampled_drafts_chi2() -> Vec<f64> {
        let p0 = [0.1, 0.4, 0.3, 0.2];
        let p1 = [0.25, 0.35, 0.15, 0.25];
        let t1 = SamplingParams { temperature: 1.0, ..Default::default() };
        let top_k = SamplingParams { top_k: 3, ..t1.clone() };
        let top_p = SamplingParams { top_p: 0.8, ..t1.clone() };
        // Top-3 and top-0.8 of p0 both keep ids 1, 2, 3; of p1, ids 1, 0, 3.
        let p0t = [0.0, 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9];
        let p1t = [0.25 / 0.85, 0.35 / 0.85, 0.0, 0.25 / 0.85];
        // (params, the rows' target distributions, the drafter's two heads)
        let cases = [
            // A skewed q, heavy where p is light.
            (t1.clone(), [p0, p1], [[0.05, 0.1, 0.6, 0.25], [0.6, 0.05, 0.05, 0.3]]),
            // q puts mass on token 0, which p has not (a -inf logit).
            (t1.clone(), [[0.0, 0.5, 0.3, 0.2], p1], [[0.4, 0.2, 0.2, 0.2], [0.1, 0.1, 0.7, 0.1]]),
            // Truncation cuts q as it cuts p: q keeps token 0 (none of p) and not token 2 (p's).
            (top_k, [p0, p1], [[0.5, 0.1, 0.05, 0.35], [0.1, 0.2, 0.6, 0.1]]),
            (top_p, [p0, p1], [[0.6, 0.05, 0.05, 0.3], [0.05, 0.1, 0.7, 0.15]]),
        ];
        let n = 20_000u64;
        let mut worst = Vec::new();
        for (params, [r0, r1], heads) in cases {
            let truncated = params.top_k > 0 || params.top_p < 1.0;
            let (want0, want1) = if truncated { (p0t, p1t) } else { (r0, r1) };
            let (mut first, mut second, mut drafted) = (vec![0usize; 4], vec![0usize; 4], vec![0usize; 4]);
            let mut q0 = DraftDist::point();
            for seed in 0..n {
                let mut s = SequenceSampler::new(Some(seed));
                let (d0, q) = s.draw_draft(&mut logits_of(&heads[0]), &params);
                let (d1, q1) = s.draw_draft(&mut logits_of(&heads[1]), &params);
                drafted[d0 as usize] += 1;
                q0 = q;
                let mut rows = vec![logits_of(&r0), logits_of(&r1), logits_of(&r1)];
                let qs = [q0.clone(), q1];
                let out = s.verify_masked(&mut rows, &[d0, d1], &qs, &params, &[], &[], None);
                first[out[0].token as usize] += 1;
                if let Some(t) = out.get(1) {
                    second[t.token as usize] += 1;
                }
            }
            assert!(!q0.is_point());
            assert!(chi2(&drafted, &dense(&q0, 4)) < 16.27, "drafts {drafted:?} against q {q0:?}");
            let mut w = chi2(&first, &want0);
            if second.iter().sum::<usize>() > 1000 {
                w = w.max(chi2(&second, &want1));
            }
            worst.push(w);
        }
        worst
    }

    #[test]
    fn sampled_drafts_keep_the_target_distribution() {
        let worst = sampled_drafts_chi2();
        eprintln!("chi2 by case: {worst:?}");
        assert!(worst.iter().all(|&w| w < 16.27), "chi2 {worst:?}");
    }

    #[test]
    fn the_sampled_draft_test_catches_a_wrong_residual() {
        WRONG_RESIDUAL.with(|w| w.set(true));
        let worst = sampled_drafts_chi2();
        WRONG_RESIDUAL.with(|w| w.set(false));
        eprintln!("chi2 by case, wrong residual: {worst:?}");
        // Each case on its own, far past the 16.27 of P = 0.001.
        assert!(worst.iter().all(|&w| w > 200.0), "a residual that ignores q went unnoticed: chi2 {worst:?}");
    }

    /// A draft drawn from the target's own distribution (q == p) is always accepted, with and
    /// without truncation: u q(d) < p(d) holds for every u < 1 despite q's f32 rounding.
    #[test]
    fn a_q_equal_to_p_accepts_always() {
        let mut g = StdRng::seed_from_u64(5);
        for seed in 0..3000u64 {
            let params = SamplingParams {
                temperature: [1.0, 0.7, 1.3][seed as usize % 3],
                top_k: [0, 5][seed as usize / 3 % 2],
                top_p: [1.0, 0.9][seed as usize / 6 % 2],
                ..Default::default()
            };
            let row: Vec<f32> = (0..64).map(|_| g.random_range(-3.0f32..3.0)).collect();
            let mut s = SequenceSampler::new(Some(seed));
            let (d, q) = s.draw_draft(&mut row.clone(), &params);
            let mut rows = vec![row.clone(), row];
            let out = s.verify_masked(&mut rows, &[d], &[q], &params, &[], &[], None);
            assert_eq!((out.len(), out[0].token), (2, d), "seed {seed}, {params:?}");
        }
    }

    /// Drafts come from a generator of their own: the target's numbers are those it takes
    /// without drafts, and a seeded drafter repeats.
    #[test]
    fn drafts_leave_the_target_generator_alone() {
        let head = logits_of(&[0.3, 0.3, 0.2, 0.2]);
        let p = params(1.0);
        let (mut a, mut b) = (SequenceSampler::new(Some(9)), SequenceSampler::new(Some(9)));
        let drafts: Vec<u32> = (0..50).map(|_| a.draw_draft(&mut head.clone(), &p).0).collect();
        assert_eq!(a.rng.random::<u64>(), b.rng.random::<u64>());
        let mut c = SequenceSampler::new(Some(9));
        assert_eq!(drafts, (0..50).map(|_| c.draw_draft(&mut head.clone(), &p).0).collect::<Vec<_>>());
        assert!(drafts.iter().any(|&d| d != drafts[0]), "drafts are sampled");
        // Greedy: the argmax, a point mass.
        assert_eq!(a.draw_draft(&mut vec![0.0, 2.0, 1.0], &params(0.0)), (1, DraftDist::point()));
    }

    /// Verifying on a device (`verify_draws`, the rows drawn by the `Sample` op, then
    /// `settle_verify`) gives `verify`'s tokens and leaves the generator where `verify` does,
    /// for every count of accepted drafts, including rows with nothing finite.
    #[test]
    fn device_verification_matches_the_host() {
        use crate::ops::sample::{Sample, PARAMS_PER_ROW};
        use candle_core::{Device, Tensor};
        let vocab = 8;
        let mut outcomes = std::collections::BTreeSet::new();
        for seed in 0..400u64 {
            let params = SamplingParams {
                temperature: [0.0, 0.6, 1.0, 1.5][seed as usize % 4],
                top_k: [0, 3][seed as usize / 4 % 2],
                ..Default::default()
            };
            let mut g = StdRng::seed_from_u64(seed ^ 0xabc);
            let mut rows: Vec<Vec<f32>> =
                (0..4).map(|_| (0..vocab).map(|_| g.random_range(-1.5f32..1.5)).collect()).collect();
            if seed % 37 == 5 {
                rows[1] = vec![f32::NAN; vocab];
            }
            // Drafts mostly each row's likeliest token, so that every count gets accepted.
            let drafts: Vec<u32> = rows[..3]
                .iter()
                .map(|r| if g.random::<f32>() < 0.8 { argmax(r).unwrap_or(0) } else { g.random_range(0..vocab as u32) })
                .collect();
            let (mut host, mut dev) = (SequenceSampler::new(Some(seed)), SequenceSampler::new(Some(seed)));
            let want: Vec<u32> =
                host.verify(&mut rows.clone(), &drafts, &params, &[], &[]).iter().map(|t| t.token).collect();

            let draws = dev.verify_draws(&params, &drafts);
            let flat: Vec<f32> = rows.concat();
            let p: Vec<f32> = draws.iter().flat_map(|d| d.to_params()).collect();
            let ids: Vec<u32> = Sample::forward(
                &Tensor::from_vec(flat, (4, vocab), &Device::Cpu).unwrap(),
                &Tensor::from_vec(p, (4, PARAMS_PER_ROW), &Device::Cpu).unwrap(),
            )
            .unwrap()
            .to_vec1()
            .unwrap();
            let accepted = ids.iter().zip(&drafts).take_while(|(a, b)| a == b).count();
            dev.settle_verify(&params, drafts.len(), accepted);
            let got: Vec<u32> =
                ids[..accepted + 1].iter().map(|&t| if t == crate::ops::sample::NO_TOKEN { 0 } else { t }).collect();
            assert_eq!(got, want, "seed {seed}, {params:?}");
            assert_eq!(host.rng.random::<u64>(), dev.rng.random::<u64>(), "seed {seed}: the generators part");
            outcomes.insert(accepted);
        }
        assert_eq!(outcomes.into_iter().collect::<Vec<_>>(), [0, 1, 2, 3], "every count of accepted drafts");
    }

    #[test]
    fn greedy_verification_accepts_the_argmax_chain() {
        let mut s = SequenceSampler::new(Some(0));
        let p = params(0.0);
        let row = |best: usize| -> Vec<f32> { (0..6).map(|i| if i == best { 2.0 } else { 0.0 }).collect() };
        // Rows' argmax: 3, 4, 1, 5. Drafts 3, 4, 2: two accepted, then the row's 1.
        let mut rows = vec![row(3), row(4), row(1), row(5)];
        let got: Vec<u32> = s.verify(&mut rows, &[3, 4, 2], &p, &[], &[]).iter().map(|t| t.token).collect();
        assert_eq!(got, vec![3, 4, 1]);
        // Every draft accepted: the last row gives one more.
        let mut rows = vec![row(3), row(4), row(1), row(5)];
        let got: Vec<u32> = s.verify(&mut rows, &[3, 4, 1], &p, &[], &[]).iter().map(|t| t.token).collect();
        assert_eq!(got, vec![3, 4, 1, 5]);
        // The first draft wrong: just the row's token.
        let mut rows = vec![row(3), row(4)];
        assert_eq!(s.verify(&mut rows, &[0], &p, &[], &[]).len(), 1);
    }

    #[test]
    fn verification_sees_the_drafts_before_each_row() {
        // A presence penalty on the drafts before a row changes that row's choice, exactly as
        // if they had been output.
        let mut s = SequenceSampler::new(Some(0));
        let p = SamplingParams { presence_penalty: 1.5, logprobs: Some(1), ..Default::default() };
        let mut rows = vec![vec![0.0, 2.0, 1.0], vec![0.0, 2.0, 1.0]];
        let got = s.verify(&mut rows, &[1], &p, &[], &[]);
        assert_eq!(got.iter().map(|t| t.token).collect::<Vec<_>>(), vec![1, 2]);
        // The second token's logprob is that of a plain sample after [1].
        let plain = s.sample(&mut vec![0.0, 2.0, 1.0], &p, &[], &[1]);
        assert_eq!((got[1].token, got[1].logprob), (plain.token, plain.logprob));
    }
}
