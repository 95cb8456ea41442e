//! The grammar masks of a step's constrained sequences (`Constraint::row_masks`), computed
//! while the model runs: they depend only on each sequence's output and drafts, which are
//! known before the forward pass, and a JSON schema's mask over a large vocabulary takes
//! about as long as a small model's decode step. On a GPU the host thread only waits for the
//! device meanwhile, so a thread of their own computes them (the sequences in parallel); on
//! the CPU the kernels' threads already take every core and the masks are computed before the
//! forward pass, in turn.

use std::thread::JoinHandle;

use rayon::prelude::*;

use super::grammar::{Constraint, RowMasks};
use super::scheduler::SchedulerOutput;
use super::sequence::Sequences;

/// One constrained sequence's work: its index in the plan, its constraint (taken out of the
/// sequence for the time), its drafts.
type Work = (usize, Constraint, Vec<u32>);

/// Runs `forward` (which may read `seqs`, but not their constraints) while the masks of the
/// plan's sampled rows are computed; returns its result and each plan item's masks (None:
/// the item is not constrained or samples no row). `sampled` is each item's number of
/// sampled rows. Every constraint is back in its sequence when this returns, whatever
/// `forward` returned.
pub fn masks_beside<T>(
    seqs: &mut Sequences,
    plan: &SchedulerOutput,
    sampled: &[usize],
    beside: bool,
    forward: impl FnOnce(&mut Sequences) -> T,
) -> (T, Vec<Option<RowMasks>>) {
    let mut work: Vec<Work> = Vec::new();
    for (i, (item, &n)) in plan.items.iter().zip(sampled).enumerate() {
        let seq = seqs.expect_mut(item.id);
        if n == 0 {
            continue;
        }
        if let Some(c) = seq.constraint.take() {
            work.push((i, c, seq.draft[..item.num_draft].to_vec()));
        }
    }
    // The sequences side by side (rayon's threads), as they are sampled.
    let compute = |work: Vec<Work>| -> Vec<(usize, Constraint, RowMasks)> {
        work.into_par_iter()
            .map(|(i, mut c, drafts)| {
                let m = c.row_masks(&drafts);
                (i, c, m)
            })
            .collect()
    };
    let (out, done) = if work.is_empty() {
        (forward(seqs), Vec::new())
    } else if beside {
        let handle: JoinHandle<_> = std::thread::spawn(move || compute(work));
        let out = forward(seqs);
        // A panic computing masks is the engine's, as it would be on this thread.
        (out, handle.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    } else {
        let done = compute(work);
        (forward(seqs), done)
    };
    let mut masks: Vec<Option<RowMasks>> = (0..plan.items.len()).map(|_| None).collect();
    for (i, c, m) in done {
        seqs.expect_mut(plan.items[i].id).constraint = Some(c);
        masks[i] = Some(m);
    }
    (out, masks)
}
