//! Whether speculation pays at the batch size running now. A verify step computes K + 1 rows
//! per sequence and a drafter model costs passes of its own, so drafts pay only while enough of
//! them are accepted, which depends on the requests (acceptance) and on the batch (a large one
//! is compute-bound, where extra rows are not free). Rather than a fixed threshold, each pure
//! decode step is timed: its wall time and the tokens it gave, with drafts and without, kept
//! per class of batch size (powers of two). In each class drafts are used while tokens per
//! second with them are at least those without; every `PROBE_EVERY` steps (`PROBE_RARELY`
//! when one way is far ahead) the class runs a few steps the other way, so that a change
//! (other requests, other acceptance) is seen.
//! Each change of mind is logged with the two rates.

/// Steps between re-measurements of the way not taken, per class, while the two ways are
/// within `CLOSE` of each other; `PROBE_RARELY` when one is far ahead (a probe of a way that
/// is several times slower costs more than it can find).
const PROBE_EVERY: u64 = 64;
const PROBE_RARELY: u64 = 512;
const CLOSE: f64 = 1.25;
/// Steps each re-measurement takes.
const PROBE_STEPS: u64 = 3;
/// Samples each way before the two are compared.
const WARM: u32 = 3;
/// Batch-size classes: 1, 2-3, 4-7, ..., 2048 and more.
const CLASSES: usize = 12;

/// Running means of a step's seconds and tokens (exponential once warm).
#[derive(Debug, Default, Clone, Copy)]
struct Rate {
    secs: f64,
    tokens: f64,
    n: u32,
}

impl Rate {
    fn add(&mut self, secs: f64, tokens: f64) {
        self.n += 1;
        let a = 1.0 / f64::from(self.n.min(8));
        self.secs += a * (secs - self.secs);
        self.tokens += a * (tokens - self.tokens);
    }

    fn tokens_per_sec(&self) -> f64 {
        self.tokens / self.secs.max(1e-9)
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Class {
    with: Rate,
    without: Rate,
    steps: u64,
    /// The last choice outside probes (for logging changes).
    drafting: Option<bool>,
}

#[derive(Debug, Default)]
pub struct SpecGovernor {
    classes: [Class; CLASSES],
}

fn class(batch: usize) -> usize {
    (usize::BITS - batch.max(1).leading_zeros() - 1).min(CLASSES as u32 - 1) as usize
}

impl SpecGovernor {
    /// Whether the next step, with about `batch` decoding sequences, verifies drafts.
    pub fn wants_drafts(&mut self, batch: usize) -> bool {
        let c = &mut self.classes[class(batch)];
        c.steps += 1;
        if c.with.n < WARM {
            return true;
        }
        if c.without.n < WARM {
            return false;
        }
        let (w, o) = (c.with.tokens_per_sec(), c.without.tokens_per_sec());
        let choice = w >= o;
        if c.drafting != Some(choice) {
            tracing::info!(
                "speculation {} at batch ~{batch}: {w:.1} tok/s with drafts, {o:.1} without",
                if choice { "on" } else { "off" }
            );
            c.drafting = Some(choice);
        }
        let every = if w.max(o) < CLOSE * w.min(o) { PROBE_EVERY } else { PROBE_RARELY };
        choice ^ (c.steps % every < PROBE_STEPS)
    }

    /// A step in which every scheduled sequence decoded: `batch` of them, whether it verified
    /// any draft, its wall time and the tokens it appended.
    pub fn record(&mut self, batch: usize, drafted: bool, secs: f64, tokens: usize) {
        let c = &mut self.classes[class(batch)];
        let r = if drafted { &mut c.with } else { &mut c.without };
        r.add(secs, tokens as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drafting at 1.8 tokens per sequence and step for 1.3x a plain step's time wins; at 1.1 tokens it
    /// loses; each class decides on its own; probes take the other way now and then.
    #[test]
    fn drafts_while_they_pay_per_batch_class() {
        let mut g = SpecGovernor::default();
        let run = |g: &mut SpecGovernor, batch: usize, spec_tokens: f64, steps: usize| -> usize {
            let mut drafted = 0;
            for _ in 0..steps {
                let d = g.wants_drafts(batch);
                drafted += usize::from(d);
                let (secs, tokens) = if d { (1.3, spec_tokens * batch as f64) } else { (1.0, batch as f64) };
                g.record(batch, d, secs, tokens as usize);
            }
            drafted
        };
        let d = run(&mut g, 10, 1.8, 200);
        assert!(d > 180, "batch 10 at 1.8 tokens per verify drafts ({d} of 200)");
        let d = run(&mut g, 80, 1.1, 200);
        assert!(d < 20, "batch 80 at 1.1 tokens per verify does not ({d} of 200)");
        assert_eq!(class(64), class(100));
        assert_ne!(class(1), class(2));
        assert_ne!(class(10), class(80));
        // Acceptance falls at batch 10: the probes see it and drafting stops.
        let d = run(&mut g, 10, 1.0, 300);
        assert!(d < 60, "after acceptance fell ({d} of 300)");
    }
}
