//! The ranks of a divided model as one [`TextModel`] to the engine: the engine's thread keeps
//! the scheduler and runs rank 0 (whose cache is the engine's); each other rank runs on a
//! thread of its own over its own device and cache, with the same step. The ranks meet in the
//! layers' collectives, so they must all run every pass.

use std::sync::Mutex;

use candle_core::{Device, Result, Tensor};

use super::{Taps, TextModel};
use crate::batch::Batch;
use crate::config::TextConfig;
use crate::kv::KvCache;
use crate::parallel::Communicator;

/// One rank past rank 0: its layers, its device and its cache (made at the first pass, as the
/// engine's: the same blocks, its own heads).
struct Rank {
    model: Mutex<Box<dyn TextModel>>,
    device: Device,
    kv: Mutex<Option<KvCache>>,
}

pub struct TensorParallel {
    first: Box<dyn TextModel>,
    rest: Vec<Rank>,
    /// Rank 0's communicator, to fail the group when a rank fails.
    comm: std::sync::Arc<dyn Communicator>,
}

impl TensorParallel {
    /// `ranks`: each rank's layers and device, in rank order (rank 0's device the engine's).
    pub fn new(ranks: Vec<(Box<dyn TextModel>, Device)>, comm: std::sync::Arc<dyn Communicator>) -> Result<Self> {
        let mut ranks = ranks.into_iter();
        let Some((first, _)) = ranks.next() else { candle_core::bail!("tensor parallel: no ranks") };
        let rest =
            ranks.map(|(model, device)| Rank { model: Mutex::new(model), device, kv: Mutex::new(None) }).collect();
        Ok(TensorParallel { first, rest, comm })
    }

    pub fn world(&self) -> usize {
        1 + self.rest.len()
    }

    /// Runs `first` on this thread and `each` on every other rank's thread, at once; rank 0's
    /// result. A failure anywhere fails the group's collectives, so no rank waits for it.
    fn together<T: Send>(
        &self,
        first: impl FnOnce() -> Result<T>,
        each: impl Fn(&Rank) -> Result<T> + Sync,
    ) -> Result<T> {
        let comm = &self.comm;
        let fail = |r: Result<T>| {
            if r.is_err() {
                comm.abort();
            }
            r
        };
        let (each, fail) = (&each, &fail);
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .rest
                .iter()
                .map(|rank| {
                    s.spawn(move || {
                        let _abort = AbortOnPanic(comm.as_ref());
                        fail(each(rank))
                    })
                })
                .collect();
            let out = {
                let _abort = AbortOnPanic(comm.as_ref());
                fail(first())
            };
            let mut rest_failed = None;
            for h in handles {
                match h.join() {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => rest_failed = rest_failed.or(Some(e)),
                    Err(_) => {
                        comm.abort();
                        rest_failed =
                            rest_failed.or(Some(candle_core::Error::Msg("tensor parallel: a rank panicked".into())));
                    }
                }
            }
            match (out, rest_failed) {
                (Ok(_), Some(e)) => Err(e),
                (out, _) => out,
            }
        })
    }
}

/// Fails the group's collectives when a rank's thread unwinds from a panic, so the other
/// ranks stop waiting for it.
struct AbortOnPanic<'a>(&'a dyn Communicator);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort();
        }
    }
}

/// The rank's mutex, whatever a panicking holder left (the group is aborted then anyway).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl TextModel for TensorParallel {
    fn config(&self) -> &TextConfig {
        self.first.config()
    }

    fn forward(&self, batch: &Batch, kv: &KvCache, taps: Option<&mut Taps>) -> Result<Tensor> {
        // On this thread, before rank 0 queues its first collective (see `Batch::host_parts`).
        // Image rows come from the vision tower on rank 0's device; every rank merges them
        // into its (all-reduced, so equal) token embeddings.
        let on_other_devices = self.rest.iter().any(|r| !r.device.same_device(batch.token_ids.device()));
        let host = if on_other_devices { Some(batch.host_parts()?) } else { None };
        self.together(
            || self.first.forward(batch, kv, taps),
            |rank| {
                let model = lock(&rank.model);
                let mut cache = lock(&rank.kv);
                if cache.as_ref().is_none_or(|c| c.spec().num_blocks != kv.spec().num_blocks) {
                    *cache = Some(KvCache::new(model.config(), *kv.spec(), &rank.device)?);
                }
                let cache = cache.as_ref().expect("made above");
                match &host {
                    Some(parts) if !rank.device.same_device(batch.token_ids.device()) => {
                        model.forward(&batch.copy_on(&rank.device, parts)?, cache, None)
                    }
                    _ => model.forward(batch, cache, None),
                }
            },
        )
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        // Every rank's final hidden rows are the same (each layer ends in an all-reduce): each
        // rank projects rank 0's onto its range of the vocabulary. They go through the host, in
        // order with the work that computed them (a device-to-device copy would not be).
        let on_host = hidden.to_device(&Device::Cpu)?;
        self.together(|| self.first.logits(hidden), |rank| lock(&rank.model).logits(&on_host.to_device(&rank.device)?))
    }

    fn graph_capturable(&self) -> bool {
        false
    }
}
