//! A team of spinning threads for the kernels' parallel loops.
//!
//! A decode step runs ~150 parallel loops of 10-50 us each (one per projection, attention
//! per layer), separated by a few microseconds of small sequential ops. A general pool whose
//! idle workers go to sleep (rayon) wakes them too late for loops this short: measured here,
//! a 16 us loop of 16 items ran no faster on 2 threads than on one. The team's workers spin
//! between loops and park only after `SPIN` without work, so during a step each loop starts
//! on every core at once, and between requests the threads sleep.
//!
//! Items are handed out by an atomic counter, so a thread that is descheduled (a busy shared
//! machine) delays only the items it holds. Which thread computes an item never changes the
//! result: every kernel computes each item on its own.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(200);

/// The loop body of the current job, with its lifetime erased (see `for_each`).
type Body = *const (dyn Fn(usize) + Sync);

struct Job {
    body: Body,
    items: usize,
}

struct Shared {
    /// Bumped for each job; workers watch it.
    epoch: AtomicU64,
    /// The last epoch whose items are all taken: workers must not touch its job any more.
    closed: AtomicU64,
    /// Workers inside a job's body.
    inside: AtomicUsize,
    next: AtomicUsize,
    job: std::cell::UnsafeCell<Job>,
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    /// One job at a time; a second caller meanwhile runs its loop alone.
    submit: Mutex<()>,
    /// A worker's item panicked: the job is incomplete, so its caller panics too.
    worker_panicked: AtomicBool,
}

// SAFETY: `job` is written only by the submitting thread while no worker can read it (before
// the epoch is published and after every worker has left, see `for_each`).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

thread_local! {
    static IN_TEAM: AtomicBool = const { AtomicBool::new(false) };
}

pub struct Team {
    shared: Arc<Shared>,
    threads: usize,
}

/// The process-wide team: `IRIS_THREADS` threads, else one per core.
pub fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let n = std::env::var("IRIS_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        Team::new(n)
    })
}

/// The body of "no job yet".
static NOTHING: fn(usize) = |_| {};

impl Team {
    fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            job: std::cell::UnsafeCell::new(Job { body: &NOTHING as Body, items: 0 }),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            submit: Mutex::new(()),
            worker_panicked: AtomicBool::new(false),
        });
        for i in 1..threads {
            let s = shared.clone();
            // A team without its workers still runs every loop (on the caller alone).
            let _ = std::thread::Builder::new().name(format!("iris-team-{i}")).spawn(move || worker(&s));
        }
        Team { shared, threads }
    }

    /// Threads that run a loop (the caller included).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `body(i)` for every `i < items`, spread over the team; returns when all are done.
    pub fn for_each(&self, items: usize, body: impl Fn(usize) + Sync) {
        // Loops started inside a loop body run on their caller (the team is busy).
        let nested = IN_TEAM.with(|f| f.load(Relaxed));
        let guard = if self.threads > 1 && items > 1 && !nested { self.shared.submit.try_lock().ok() } else { None };
        let Some(_guard) = guard else {
            (0..items).for_each(body);
            return;
        };
        let s = &*self.shared;
        let body: &(dyn Fn(usize) + Sync) = &body;
        // SAFETY: no worker is inside a job (the previous `for_each` waited for them) and none
        // reads `job` before seeing the new epoch, published below. The erased lifetime is
        // sound because this function does not return before every worker has left `body`.
        unsafe {
            *s.job.get() = Job { body: std::mem::transmute::<&(dyn Fn(usize) + Sync), Body>(body), items };
        }
        s.next.store(0, SeqCst);
        let epoch = s.epoch.fetch_add(1, SeqCst) + 1;
        if s.sleepers.load(SeqCst) > 0 {
            let _p = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // Closes the job even if `body` panics here, so no worker is left holding it.
        let _close = CloseOnDrop { s, epoch };
        run_items(s, body, items);
    }
}

/// Ends a job: marks it closed, then waits until no worker is inside its body.
struct CloseOnDrop<'a> {
    s: &'a Shared,
    epoch: u64,
}

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.s.closed.store(self.epoch, SeqCst);
        while self.s.inside.load(SeqCst) > 0 {
            std::hint::spin_loop();
        }
        if self.s.worker_panicked.swap(false, SeqCst) && !std::thread::panicking() {
            panic!("a compute-team worker panicked inside a parallel loop");
        }
    }
}

fn run_items(s: &Shared, body: &(dyn Fn(usize) + Sync), items: usize) {
    loop {
        let i = s.next.fetch_add(1, Relaxed);
        if i >= items {
            break;
        }
        body(i);
    }
}

fn worker(s: &Shared) {
    IN_TEAM.with(|f| f.store(true, Relaxed));
    let mut seen = s.epoch.load(SeqCst);
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = s.epoch.load(SeqCst);
        if epoch != seen {
            seen = epoch;
            // Announce before checking that the job is still open: either the submitter sees
            // us inside and waits, or we see it closed and leave its job alone.
            s.inside.fetch_add(1, SeqCst);
            if s.closed.load(SeqCst) < epoch {
                // SAFETY: the job of an open epoch stays valid while we are inside (above).
                let job = unsafe { &*s.job.get() };
                let body = unsafe { &*job.body };
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_items(s, body, job.items)));
                if run.is_err() {
                    s.worker_panicked.store(true, SeqCst);
                }
            }
            s.inside.fetch_sub(1, SeqCst);
            idle_since = Instant::now();
            continue;
        }
        std::hint::spin_loop();
        spins += 1;
        if spins % 256 == 0 && idle_since.elapsed() > SPIN {
            let guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, SeqCst);
            let guard = if s.epoch.load(SeqCst) == seen {
                s.wake.wait(guard).unwrap_or_else(|e| e.into_inner())
            } else {
                guard
            };
            s.sleepers.fetch_sub(1, SeqCst);
            drop(guard);
            idle_since = Instant::now();
        }
    }
}

/// An output buffer that a loop's items write disjoint parts of.
pub struct OutPtr<T = f32>(pub *mut T);
// SAFETY: every item writes a disjoint set of elements, and the buffer outlives the loop.
unsafe impl<T> Send for OutPtr<T> {}
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}

impl<T> OutPtr<T> {
    // A method, so closures capture the whole (Sync) wrapper rather than its raw field.
    pub fn at(self, i: usize) -> *mut T {
        // SAFETY: callers stay within the buffer.
        unsafe { self.0.add(i) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_exactly_once_across_many_jobs() {
        let t = Team::new(3);
        for items in [0, 1, 2, 7, 64, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                t.for_each(items, |i| {
                    hits[i].fetch_add(1, Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "items={items}");
            }
        }
    }

    #[test]
    fn jobs_after_workers_park_and_from_several_threads() {
        let t = Arc::new(Team::new(2));
        std::thread::sleep(SPIN * 5);
        let sum = AtomicUsize::new(0);
        t.for_each(100, |i| {
            sum.fetch_add(i, Relaxed);
        });
        assert_eq!(sum.load(Relaxed), 4950);
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        t.for_each(33, |i| {
                            sum.fetch_add(i, Relaxed);
                        });
                        assert_eq!(sum.load(Relaxed), 528);
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().expect("caller thread");
        }
    }

    #[test]
    fn a_nested_loop_runs_on_its_caller() {
        let t = Team::new(2);
        let total = AtomicUsize::new(0);
        t.for_each(4, |_| {
            t.for_each(5, |_| {
                total.fetch_add(1, Relaxed);
            });
        });
        assert_eq!(total.load(Relaxed), 20);
    }
}
