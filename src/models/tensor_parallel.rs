//! The ranks of a divided model as one [`TextModel`] to the engine: the engine's thread keeps
//! the scheduler and runs rank 0 (whose cache is the engine's); each other rank runs on a
//! thread of its own, made once with the model and kept for its life, over its own device and
//! cache, with the same step. The ranks meet in the layers' collectives, so they must all run
//! every pass. A rank keeps one thread because what a device binds to a thread (its context,
//! a graph being captured) must see every pass of that rank: per-rank CUDA graphs need it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{Device, Result, Tensor};

use super::{Taps, TextModel};
use crate::batch::Batch;
use crate::config::TextConfig;
use crate::kv::KvCache;
use crate::parallel::Communicator;

/// What a rank's thread owns: its layers, its device and its cache (made at the first pass, as
/// the engine's: the same blocks, its own heads).
struct RankState {
    model: Box<dyn TextModel>,
    device: Device,
    kv: Option<KvCache>,
}

/// One pass of a rank, run on its thread.
type Job = Box<dyn FnOnce(&mut RankState) -> Result<()> + Send>;

/// One rank past rank 0: its thread, which runs the jobs it is sent in order and answers each.
struct Rank {
    device: Device,
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Rank {
    fn spawn(index: usize, model: Box<dyn TextModel>, device: Device, comm: Arc<dyn Communicator>) -> Result<Self> {
        let (jobs, inbox) = channel::<Job>();
        let (reply, done) = channel();
        let mut state = RankState { model, device: device.clone(), kv: None };
        let thread = std::thread::Builder::new()
            .name(format!("iris-rank-{index}"))
            .spawn(move || {
                let _abort = AbortOnPanic(comm.as_ref());
                for job in inbox {
                    let out = job(&mut state);
                    if out.is_err() {
                        comm.abort();
                    }
                    if reply.send(out).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| candle_core::Error::Msg(format!("tensor parallel: rank {index}'s thread: {e}")))?;
        Ok(Rank { device, jobs: Some(jobs), done, thread: Some(thread) })
    }

    /// Whether the rank's thread still runs (a panic ends it).
    fn alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Sends `job`; false when the rank's thread is gone (it panicked).
    fn send(&self, job: Job) -> bool {
        self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok())
    }

    /// The answer to the job sent last.
    fn wait(&self) -> Result<()> {
        self.done.recv().unwrap_or_else(|_| Err(candle_core::Error::Msg("tensor parallel: a rank panicked".into())))
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        // Closing the queue ends the thread's loop.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub struct TensorParallel {
    first: Box<dyn TextModel>,
    rest: Vec<Rank>,
    /// Rank 0's communicator, to fail the group when a rank fails.
    comm: Arc<dyn Communicator>,
}

impl TensorParallel {
    /// `ranks`: each rank's layers and device, in rank order (rank 0's device the engine's),
    /// and `comms` their communicators in the same order.
    pub fn new(ranks: Vec<(Box<dyn TextModel>, Device)>, comms: &[Arc<dyn Communicator>]) -> Result<Self> {
        let mut ranks = ranks.into_iter();
        let Some((first, _)) = ranks.next() else { candle_core::bail!("tensor parallel: no ranks") };
        let Some(comm) = comms.first().cloned() else { candle_core::bail!("tensor parallel: no communicators") };
        let rest = ranks
            .zip(&comms[1..])
            .enumerate()
            .map(|(i, ((model, device), c))| Rank::spawn(i + 1, model, device, c.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(TensorParallel { first, rest, comm })
    }

    pub fn world(&self) -> usize {
        1 + self.rest.len()
    }

    /// Sends each other rank the job `each` makes for it, runs `first` on this thread, and
    /// waits for every rank; rank 0's result. A failure anywhere fails the group's
    /// collectives, so no rank waits for it.
    fn together<T>(&self, first: impl FnOnce() -> Result<T>, each: impl Fn(&Rank) -> Job) -> Result<T> {
        let gone = candle_core::Error::Msg("tensor parallel: a rank's thread is gone (it panicked)".into());
        // Nothing is started while a rank is gone: the others' collectives would wait for it
        // (an NCCL group cannot be aborted).
        if !self.rest.iter().all(Rank::alive) {
            self.comm.abort();
            return Err(gone);
        }
        let mut sent = Vec::with_capacity(self.rest.len());
        for rank in &self.rest {
            let ok = rank.send(each(rank));
            sent.push(ok);
            if !ok {
                self.comm.abort();
                break;
            }
        }
        // A panic in rank 0's part is held until every rank has answered, so that no answer
        // is left queued for the next pass to take as its own.
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(first));
        if !matches!(out, Ok(Ok(_))) {
            self.comm.abort();
        }
        let mut rest_failed = None;
        for (rank, ok) in self.rest.iter().zip(&sent) {
            let r = if *ok { rank.wait() } else { Err(candle_core::Error::Msg(gone.to_string())) };
            if let Err(e) = r {
                self.comm.abort();
                rest_failed = rest_failed.or(Some(e));
            }
        }
        if sent.len() < self.rest.len() || sent.contains(&false) {
            rest_failed = rest_failed.or(Some(gone));
        }
        let out = out.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        // Which failed first is not known (the others' errors may be the abort's): both said.
        match (out, rest_failed) {
            (Ok(_), Some(e)) => Err(e),
            (Err(a), Some(b)) => Err(candle_core::Error::Msg(format!("{a}; another rank: {b}"))),
            (out, None) => out,
        }
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

impl TextModel for TensorParallel {
    fn config(&self) -> &TextConfig {
        self.first.config()
    }

    fn forward(&self, batch: &Batch, kv: &KvCache, taps: Option<&mut Taps>) -> Result<Tensor> {
        // On this thread, before rank 0 queues its first collective (see `Batch::host_parts`).
        // Image rows come from the vision tower on rank 0's device; every rank merges them
        // into its (all-reduced, so equal) token embeddings.
        let on_other_devices = self.rest.iter().any(|r| !r.device.same_device(batch.token_ids.device()));
        let host = if on_other_devices { Some(Arc::new(batch.host_parts()?)) } else { None };
        let spec = *kv.spec();
        self.together(
            || self.first.forward(batch, kv, taps),
            |rank| {
                // The rank's own handle on the step (its tensors shared, not copied), and, for
                // another device, the host parts its copy is made from on the rank's thread.
                let other = !rank.device.same_device(batch.token_ids.device());
                let (batch, host) = (batch.clone(), host.clone().filter(|_| other));
                Box::new(move |st: &mut RankState| {
                    if st.kv.as_ref().is_none_or(|c| c.spec().num_blocks != spec.num_blocks) {
                        st.kv = Some(KvCache::new(st.model.config(), spec, &st.device)?);
                    }
                    let cache = st.kv.as_ref().expect("made above");
                    match &host {
                        Some(parts) => st.model.forward(&batch.copy_on(&st.device, parts)?, cache, None),
                        None => st.model.forward(&batch, cache, None),
                    }
                    .map(drop)
                })
            },
        )
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        // Every rank's final hidden rows are the same (each layer ends in an all-reduce): each
        // rank projects rank 0's onto its range of the vocabulary. They go through the host, in
        // order with the work that computed them (a device-to-device copy would not be).
        let on_host = hidden.to_device(&Device::Cpu)?;
        self.together(
            || self.first.logits(hidden),
            |_| {
                let h = on_host.clone();
                Box::new(move |st: &mut RankState| st.model.logits(&h.to_device(&st.device)?).map(drop))
            },
        )
    }

    fn graph_capturable(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::thread::ThreadId;

    use super::*;
    use crate::parallel::thread_group;

    /// A rank whose output head only meets the others in an all-reduce, noting the thread it
    /// runs on, and fails (an error or a panic) at a given pass.
    struct Fake {
        cfg: TextConfig,
        comm: Arc<dyn Communicator>,
        passes: AtomicUsize,
        threads: Arc<Mutex<Vec<ThreadId>>>,
        fail_at: Option<usize>,
        panic_at: Option<usize>,
    }

    impl TextModel for Fake {
        fn config(&self) -> &TextConfig {
            &self.cfg
        }
        fn forward(&self, _: &Batch, _: &KvCache, _: Option<&mut Taps>) -> Result<Tensor> {
            unreachable!("the test runs the output head only")
        }
        fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
            let pass = self.passes.fetch_add(1, Ordering::SeqCst);
            self.threads.lock().unwrap().push(std::thread::current().id());
            if self.fail_at == Some(pass) {
                candle_core::bail!("rank failed at pass {pass}");
            }
            if self.panic_at == Some(pass) {
                panic!("rank panicked at pass {pass}");
            }
            self.comm.all_reduce(hidden)
        }
    }

    fn group(fail_at: Option<usize>, panic_at: Option<usize>) -> (TensorParallel, Arc<Mutex<Vec<ThreadId>>>) {
        group_failing(1, fail_at, panic_at)
    }

    /// Two ranks, `failing` of which fails or panics at the given passes.
    fn group_failing(
        failing: usize,
        fail_at: Option<usize>,
        panic_at: Option<usize>,
    ) -> (TensorParallel, Arc<Mutex<Vec<ThreadId>>>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama/config.json");
        let cfg = TextConfig::from_hf_file(&dir).unwrap();
        let comms = thread_group(2);
        let threads = Arc::new(Mutex::new(Vec::new()));
        let ranks = comms
            .iter()
            .enumerate()
            .map(|(r, comm)| {
                let fake = Fake {
                    cfg: cfg.clone(),
                    comm: comm.clone(),
                    passes: AtomicUsize::new(0),
                    threads: if r == 1 { threads.clone() } else { Arc::default() },
                    fail_at: fail_at.filter(|_| r == failing),
                    panic_at: panic_at.filter(|_| r == failing),
                };
                (Box::new(fake) as Box<dyn TextModel>, Device::Cpu)
            })
            .collect();
        (TensorParallel::new(ranks, &comms).unwrap(), threads)
    }

    /// Rank 1 runs every pass on one thread of its own, kept between passes.
    #[test]
    fn a_rank_keeps_its_thread_from_pass_to_pass() {
        let (tp, threads) = group(None, None);
        let x = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        for _ in 0..3 {
            assert_eq!(tp.logits(&x).unwrap().to_vec1::<f32>().unwrap(), [2.0, 4.0]);
        }
        let seen = threads.lock().unwrap().clone();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|t| *t == seen[0]) && seen[0] != std::thread::current().id(), "{seen:?}");
    }

    /// A rank that fails, or panics, fails the pass instead of leaving rank 0 waiting in its
    /// all-reduce; after a panic the rank is gone and later passes fail at once.
    #[test]
    fn a_failing_rank_fails_the_pass_without_a_hang() {
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let (tp, _) = group(Some(1), None);
        assert!(tp.logits(&x).is_ok());
        let err = tp.logits(&x).unwrap_err().to_string();
        assert!(err.contains("rank failed at pass 1"), "{err}");
        let (tp, _) = group(None, Some(0));
        let err = tp.logits(&x).unwrap_err().to_string();
        assert!(err.contains("panicked"), "{err}");
        let err = tp.logits(&x).unwrap_err().to_string();
        assert!(err.contains("gone"), "{err}");
    }

    /// A panic in rank 0's part reaches the caller only after the other rank has answered the
    /// pass, so no answer is left for the next pass to take as its own.
    #[test]
    fn a_panic_on_rank_0_leaves_no_answer_queued() {
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let (tp, _) = group_failing(0, None, Some(0));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tp.logits(&x)));
        assert!(caught.is_err(), "rank 0's panic reaches the caller");
        // Rank 1 answers within milliseconds (its all-reduce fails on the abort): an answer
        // left behind would arrive in this wait.
        let late = tp.rest[0].done.recv_timeout(std::time::Duration::from_millis(500));
        assert!(late.is_err(), "rank 1's answer was left queued");
    }
}
