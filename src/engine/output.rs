//! The output processor: the last part of a step. Advances what each sequence has computed,
//! appends its accepted tokens (rolling back the cache past the last one), detokenizes, checks
//! stop conditions, finishes sequences, and asks the drafter for the next step's drafts.

use super::finish::FinishReason;
use super::prefix::PrefixStats;
use super::request::SeqUpdate;
use super::sampler::Sampled;
use super::scheduler::{Scheduler, SchedulerOutput};
use super::sequence::SeqId;
use super::speculative::Drafter;

/// Counters for metrics and logs.
#[derive(Debug, Default, Clone)]
pub struct EngineStats {
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    pub spec: SpecStats,
    /// Prefix caching's counters.
    pub prefix: PrefixStats,
}

/// Speculative decoding's counters (vLLM's `spec_decode_*`).
#[derive(Debug, Default, Clone)]
pub struct SpecStats {
    /// Verify passes: sequences in steps that checked at least one draft token.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// Accepted tokens by their place in the draft (0 is the first).
    pub accepted_per_position: Vec<u64>,
}

impl SpecStats {
    /// Accepted share of the draft tokens verified (0 when none were).
    pub fn acceptance_rate(&self) -> f64 {
        self.num_accepted_tokens as f64 / self.num_draft_tokens.max(1) as f64
    }

    /// Tokens a verify pass appended on average (accepted drafts and the one after them; 0
    /// when none ran).
    pub fn tokens_per_verify(&self) -> f64 {
        (self.num_accepted_tokens + self.num_drafts) as f64 / self.num_drafts.max(1) as f64
    }

    /// The counts since `before` (an earlier copy of these counters).
    pub fn since(&self, before: &SpecStats) -> SpecStats {
        SpecStats {
            num_drafts: self.num_drafts - before.num_drafts,
            num_draft_tokens: self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens: self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_position: self
                .accepted_per_position
                .iter()
                .enumerate()
                .map(|(i, n)| n - before.accepted_per_position.get(i).copied().unwrap_or(0))
                .collect(),
        }
    }

    fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.num_drafts += 1;
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        if self.accepted_per_position.len() < drafted {
            self.accepted_per_position.resize(drafted, 0);
        }
        for n in &mut self.accepted_per_position[..accepted] {
            *n += 1;
        }
    }
}

pub struct OutputProcessor {
    eos: Vec<u32>,
    max_model_len: usize,
    drafter: Option<Drafter>,
    /// Most draft tokens per step (`num_speculative_tokens`; the runner's graphs are sized by it).
    max_drafts: usize,
    /// Whether the next step verifies drafts (`SpecGovernor`); none are proposed while not.
    drafting: bool,
}

impl OutputProcessor {
    pub fn new(eos: Vec<u32>, max_model_len: usize, drafter: Option<Drafter>, max_drafts: usize) -> Self {
        OutputProcessor { eos, max_model_len, drafter, max_drafts, drafting: true }
    }

    pub fn set_drafter(&mut self, drafter: Drafter) {
        self.drafter = Some(drafter);
    }

    /// Whether the next step verifies drafts (the engine's governor says).
    pub fn set_drafting(&mut self, on: bool) {
        self.drafting = on;
    }

    /// Drafts come from elsewhere (a drafter model, run by the engine).
    pub fn clear_drafter(&mut self) {
        self.drafter = None;
    }

    /// How many tokens a sequence may draft for the next step: None unless it decodes; no
    /// more than can still be output, nor than fit in the model's context.
    pub fn draft_limit(&self, seq: &super::sequence::Sequence) -> Option<usize> {
        if seq.num_uncomputed() != 1 || !self.drafting {
            return None;
        }
        let left = seq.params.max_tokens.saturating_sub(seq.output().len() + 1);
        let room = self.max_model_len.saturating_sub(seq.num_tokens());
        Some(left.min(room).min(self.max_drafts))
    }

    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Applies a step's tokens (`tokens[i]` for `plan.items[i]`, from the runner).
    pub fn apply(
        &self,
        sched: &mut Scheduler,
        plan: &SchedulerOutput,
        tokens: Vec<Vec<Sampled>>,
        stats: &mut EngineStats,
    ) -> Vec<SeqUpdate> {
        let mut updates = Vec::new();
        for (item, toks) in plan.items.iter().zip(tokens) {
            let Some(seq) = sched.get_mut(item.id) else { continue };
            if seq.output().is_empty() {
                stats.prompt_tokens += item.num_new as u64;
            }
            // The scheduled tokens are in the cache now, and so are the accepted drafts (all
            // tokens but the last); a rejected draft's keys and values are simply overwritten
            // when its position is computed again.
            let accepted = toks.len().saturating_sub(1);
            seq.num_computed += item.num_new + accepted;
            seq.draft.clear();
            seq.draft_q.clear();
            stats.spec.record(item.num_draft, accepted);
            let mut finished = false;
            for tok in toks {
                let u = self.append_token(sched, item.id, tok, stats);
                finished = u.finish.is_some();
                updates.push(u);
                if finished {
                    break;
                }
            }
            if !finished {
                // Its newly completed blocks are final now: later prompts may share them.
                sched.publish(item.id);
                self.propose(sched, item.id);
            }
        }
        updates
    }

    /// The next step's drafts for a sequence that decodes: no more than can still be output,
    /// nor than fit in the model's context.
    fn propose(&self, sched: &mut Scheduler, id: SeqId) {
        let Some(drafter) = &self.drafter else { return };
        let Some(limit) = sched.get_mut(id).and_then(|s| self.draft_limit(s)) else { return };
        let Some(seq) = sched.get_mut(id) else { return };
        seq.draft = drafter.propose(seq.tokens(), limit);
    }

    fn append_token(&self, sched: &mut Scheduler, id: SeqId, tok: Sampled, stats: &mut EngineStats) -> SeqUpdate {
        let seq = sched.get_mut(id).expect("sampled sequence exists");
        seq.push_output(tok.token);
        stats.generated_tokens += 1;
        let p = &seq.params;
        let n_out = seq.output().len();
        let at_max_len = seq.num_tokens() >= self.max_model_len;
        let n_prompt = seq.prompt().len();
        let n_cached = seq.num_cached_tokens;
        let prompt_logprobs =
            (n_out == 1 && p.prompt_logprobs.is_some()).then(|| std::mem::take(&mut seq.prompt_logprobs));
        // The grammar takes the token (the mask allowed it); once it is complete and nothing
        // may follow, the sequence ends here as if the model had stopped.
        let mut grammar_done = false;
        let mut grammar_error = None;
        if let Some(c) = seq.constraint.as_mut() {
            match c.accept(tok.token) {
                Ok(()) => grammar_done = c.is_finished(),
                Err(e) => grammar_error = Some(FinishReason::Error(format!("structured output: {e}"))),
            }
        }
        let state = &mut seq.text;
        // The sampler keeps EOS and stop ids out until min_tokens, so any here are final.
        let ends = (!p.ignore_eos && self.eos.contains(&tok.token)) || p.stop_token_ids.contains(&tok.token);
        let mut finish = grammar_error;
        let mut text = String::new();
        if ends || finish.is_some() {
            finish = finish.or(Some(FinishReason::Stop));
        } else {
            let delta = match state.detok.push(tok.token) {
                Ok(d) => d,
                Err(e) => {
                    finish = Some(FinishReason::Error(e.to_string()));
                    String::new()
                }
            };
            let out = state.stop.push(&delta);
            text = out.emit;
            if out.stopped.is_some() && n_out > p.min_tokens {
                // Text after the stop string is dropped, as OpenAI does.
                return finish_seq(sched, id, tok, text, FinishReason::Stop, prompt_logprobs);
            }
        }
        if finish.is_none() && grammar_done {
            finish = Some(FinishReason::Stop);
        }
        if finish.is_none() && (n_out >= p.max_tokens || at_max_len) {
            finish = Some(FinishReason::Length);
        }
        match finish {
            Some(reason) => {
                // Release text held back for a character or stop string that never completed.
                let tail = state.detok.finish().unwrap_or_default();
                text.push_str(&state.stop.push(&tail).emit);
                text.push_str(&state.stop.flush());
                finish_seq(sched, id, tok, text, reason, prompt_logprobs)
            }
            None => SeqUpdate {
                id,
                token: Some(tok),
                text,
                finish: None,
                prompt_logprobs,
                num_prompt_tokens: n_prompt,
                num_output_tokens: n_out,
                num_cached_tokens: n_cached,
            },
        }
    }
}

fn finish_seq(
    sched: &mut Scheduler,
    id: SeqId,
    tok: Sampled,
    text: String,
    reason: FinishReason,
    prompt_logprobs: Option<Vec<Sampled>>,
) -> SeqUpdate {
    let seq = sched.remove(id).expect("finishing sequence exists");
    SeqUpdate {
        id,
        token: Some(tok),
        text,
        finish: Some(reason),
        prompt_logprobs,
        num_prompt_tokens: seq.prompt().len(),
        num_output_tokens: seq.output().len(),
        num_cached_tokens: seq.num_cached_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_counters_add_up_by_position_and_subtract() {
        let mut s = SpecStats::default();
        s.record(4, 2);
        let before = s.clone();
        s.record(2, 2);
        s.record(3, 0);
        s.record(0, 0); // no drafts: not a verify pass
        assert_eq!((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens), (3, 9, 4));
        assert_eq!(s.accepted_per_position, vec![2, 2, 0, 0]);
        let d = s.since(&before);
        assert_eq!((d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens), (2, 5, 2));
        assert_eq!(d.accepted_per_position, vec![1, 1, 0, 0]);
        assert_eq!((d.acceptance_rate(), d.tokens_per_verify()), (0.4, 2.0));
        assert_eq!(SpecStats::default().acceptance_rate(), 0.0);
    }
}
