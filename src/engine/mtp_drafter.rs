//! Drafts from the target's own MTP head (`layers::mtp`).
//!
//! After each step the head runs over every row the step kept (prompt chunks, the decoded
//! token, accepted drafts), pairing each row's final hidden state with the token after it, so
//! that its cache layer holds, at each position p, the head's keys for (h_p, t_{p+1}), as the
//! target's layers hold theirs (vLLM's alignment). Rejected drafts' rows are simply left out
//! and their positions written again later: nothing to roll back. The last kept row of a
//! sequence that decodes gives its first draft; each further draft runs the head on its own
//! previous output and draft one position on (writing rows the next catch-up rewrites).
//! Greedy requests draft the head's argmax; sampled ones draw from the head's distribution and
//! hand it to verification (the p/q rule), which keeps the target's output exactly as it
//! would be without drafts, or its distribution.

use candle_core::{Result, Tensor};

use super::sampler::{DraftDist, Sampled};
use super::scheduler::{Scheduler, SchedulerOutput};
use super::sequence::{SeqId, Sequence};
use crate::batch::{Batch, Positions, SeqSlice};
use crate::kv::KvCache;
use crate::models::TextModel;

/// A sequence's drafts and the distribution each was drawn from (point masses for greedy
/// requests).
pub type Drafts = (Vec<u32>, Vec<DraftDist>);

/// What the catch-up pass leaves for drafting: per sequence, its last head row and position.
pub struct CaughtUp {
    /// The head's hidden rows of every kept row, in pass order.
    rows: Tensor,
    /// (sequence, its last row in `rows`, that row's position).
    last: Vec<(SeqId, usize, usize)>,
}

/// One pass's rows, flattened for a batch.
#[derive(Default)]
struct PassRows {
    tokens: Vec<u32>,
    positions: Vec<[u32; 3]>,
    slices: Vec<SeqSlice>,
    /// Rows of the input hidden states to read, in order.
    hidden_rows: Vec<u32>,
    mrope: bool,
}

impl PassRows {
    /// `seq`'s rows at positions `start..start + next.len()`, the token after each in `next`.
    fn push(&mut self, seq: &Sequence, start: usize, next: &[u32], hidden_rows: impl Iterator<Item = u32>) {
        let q_start = self.tokens.len();
        self.tokens.extend_from_slice(next);
        let range = start..start + next.len();
        match &seq.mm {
            Some(mm) => {
                self.mrope = true;
                self.positions.extend(range.clone().map(|p| mm.position(p)));
            }
            None => self.positions.extend(range.clone().map(|p| [p as u32; 3])),
        }
        self.slices.push(SeqSlice {
            q_start,
            q_len: next.len(),
            context_len: range.end,
            block_table: seq.block_table.ids(),
        });
        self.hidden_rows.extend(hidden_rows);
    }

    /// Runs the head over the rows: its hidden rows.
    fn run(self, model: &dyn TextModel, kv: &KvCache, hidden: &Tensor, mrope_model: bool) -> Result<Tensor> {
        let positions = if self.mrope && mrope_model {
            Positions::MRope(self.positions)
        } else {
            Positions::Flat(self.positions.iter().map(|p| p[0]).collect())
        };
        let dev = hidden.device();
        let mut batch =
            Batch::new(&candle_core::Device::Cpu, kv.spec().block_size, self.slices, &self.tokens, positions, None)?;
        batch.to_device(dev)?;
        let h = hidden.index_select(&Tensor::new(self.hidden_rows.as_slice(), dev)?, 0)?;
        model.mtp_forward(&batch, &h, kv)
    }
}

/// Each drafting sequence's draft from its head row in `h` (row i for `ids[i]`): the argmax
/// for greedy requests; for sampled ones a draw from the head's distribution under the
/// request's temperature and filters (`SequenceSampler::draw_draft`), handed on with the draft
/// for the p/q rule. A draft vocabulary's logits are spread over the whole vocabulary first.
fn draw(model: &dyn TextModel, sched: &mut Scheduler, ids: &[SeqId], h: &Tensor) -> Result<Vec<(u32, DraftDist)>> {
    let (logits, vocab) = model.mtp_logits(h)?;
    let token = |i: u32| vocab.map_or(i, |v| v[i as usize]);
    let best: Vec<u32> = logits.argmax(1)?.to_vec1()?;
    let sampled = |id: &SeqId| sched.get(*id).is_some_and(|s| !s.params.is_greedy());
    let rows: Vec<Vec<f32>> = if ids.iter().any(sampled) { logits.to_vec2()? } else { Vec::new() };
    let mut out = Vec::with_capacity(ids.len());
    for (r, id) in ids.iter().enumerate() {
        let Some(seq) = sched.get_mut(*id).filter(|s| !s.params.is_greedy()) else {
            out.push((token(best[r]), DraftDist::point()));
            continue;
        };
        let mut full = match vocab {
            Some(v) => {
                let mut f = vec![f32::NEG_INFINITY; model.config().vocab_size];
                for (&t, &l) in v.iter().zip(&rows[r]) {
                    f[t as usize] = l;
                }
                f
            }
            None => rows[r].clone(),
        };
        out.push(seq.sampler.draw_draft(&mut full, &seq.params));
    }
    Ok(out)
}

/// Runs the head over the rows the step kept (`tokens[i]`: what the runner gave `plan.items[i]`;
/// `hidden`: the step's final hidden rows, all of them), before the output processor applies
/// them. Returns None when no row was kept.
pub fn catch_up(
    model: &dyn TextModel,
    kv: &KvCache,
    sched: &Scheduler,
    plan: &SchedulerOutput,
    tokens: &[Vec<Sampled>],
    hidden: &Tensor,
) -> Result<Option<CaughtUp>> {
    let mut pass = PassRows::default();
    let mut last = Vec::new();
    let mut q_start = 0u32;
    for (item, toks) in plan.items.iter().zip(tokens) {
        let first_row = q_start;
        q_start += item.num_rows() as u32;
        let Some(seq) = sched.get(item.id) else { continue };
        // The scheduled tokens and the accepted drafts (every returned token but the last).
        let kept = item.num_new + toks.len().saturating_sub(1);
        let start = seq.num_computed;
        let n = seq.num_tokens();
        // The token after each kept row: known, or the step's (accepted drafts, then the last).
        let next: Option<Vec<u32>> = (start + 1..start + kept + 1)
            .map(|q| if q < n { Some(seq.token(q)) } else { toks.get(q - n).map(|s| s.token) })
            .collect();
        let Some(next) = next.filter(|n| !n.is_empty()) else { continue };
        pass.push(seq, start, &next, first_row..first_row + kept as u32);
        last.push((item.id, pass.tokens.len() - 1, start + kept - 1));
    }
    if last.is_empty() {
        return Ok(None);
    }
    let mrope = model.config().rope.mrope_section.is_some();
    Ok(Some(CaughtUp { rows: pass.run(model, kv, hidden, mrope)?, last }))
}

/// The next step's drafts, up to `limit(seq)` tokens each (None: that sequence does not
/// draft), for the sequences the catch-up saw that still run. Each draft after the first
/// writes the head's row one position on, so its block is reserved now (it is the next step's
/// anyway); where none is free, the sequence drafts fewer.
pub fn propose(
    model: &dyn TextModel,
    kv: &KvCache,
    sched: &mut Scheduler,
    caught: CaughtUp,
    limit: impl Fn(&Sequence) -> Option<usize>,
) -> Result<Vec<(SeqId, Drafts)>> {
    // (sequence, its row in `caught.rows`, its last position, how many drafts).
    let mut drafting = Vec::new();
    for (id, row, pos) in caught.last {
        let Some(k) = sched.get(id).and_then(&limit).filter(|&k| k > 0) else { continue };
        // Draft j (1-based) is made by a head row at position pos + j - 1.
        let k = (1..=k).rev().find(|&k| sched.reserve(id, pos + k)).unwrap_or(1);
        drafting.push((id, row, pos, k));
    }
    if drafting.is_empty() {
        return Ok(Vec::new());
    }
    // Longest first: the sequences still drafting at each step are then a prefix.
    drafting.sort_by_key(|d| std::cmp::Reverse(d.3));
    let ids: Vec<SeqId> = drafting.iter().map(|d| d.0).collect();
    let dev = caught.rows.device().clone();
    let rows: Vec<u32> = drafting.iter().map(|d| d.1 as u32).collect();
    let mut h = caught.rows.index_select(&Tensor::new(rows.as_slice(), &dev)?, 0)?;
    let mut last = draw(model, sched, &ids, &h)?;
    let mut drafts: Vec<Drafts> = last.iter().map(|(t, q)| (vec![*t], vec![q.clone()])).collect();
    let mrope = model.config().rope.mrope_section.is_some();
    for j in 1..drafting[0].3 {
        let live = drafting.iter().take_while(|d| d.3 > j).count();
        let mut pass = PassRows::default();
        for (i, &(id, _, pos, _)) in drafting[..live].iter().enumerate() {
            let seq = sched.get(id).expect("drafting sequences run");
            pass.push(seq, pos + j, &[last[i].0], std::iter::once(i as u32));
        }
        h = pass.run(model, kv, &h, mrope)?;
        last = draw(model, sched, &ids[..live], &h)?;
        for ((d, q), (t, dq)) in drafts.iter_mut().zip(last.iter().cloned()) {
            d.push(t);
            q.push(dq);
        }
    }
    Ok(ids.into_iter().zip(drafts).collect())
}
