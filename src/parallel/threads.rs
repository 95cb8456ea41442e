//! A communicator among threads of one process, for ranks on the CPU (and for testing the
//! division of a model without GPUs). Each collective: every rank leaves its tensor in its
//! slot, all meet, each computes the result from all the slots in rank order (so every rank
//! gets the same bits, whatever the timing), all meet again before the slots are reused.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use candle_core::{Result, Tensor};

use super::comm::Communicator;

struct State {
    slots: Vec<Option<Tensor>>,
    /// Ranks waiting at the current meeting.
    arrived: usize,
    /// Meetings completed.
    generation: u64,
    aborted: bool,
}

struct Group {
    world: usize,
    state: Mutex<State>,
    met: Condvar,
}

/// One rank of a [`thread_group`].
pub struct ThreadRank {
    rank: usize,
    group: Arc<Group>,
}

/// `world` communicators that work among threads, one per rank, rank order.
pub fn thread_group(world: usize) -> Vec<Arc<dyn Communicator>> {
    let state = State { slots: vec![None; world], arrived: 0, generation: 0, aborted: false };
    let group = Arc::new(Group { world, state: Mutex::new(state), met: Condvar::new() });
    (0..world).map(|rank| Arc::new(ThreadRank { rank, group: group.clone() }) as Arc<dyn Communicator>).collect()
}

fn aborted() -> candle_core::Error {
    candle_core::Error::Msg("tensor parallel: another rank failed; this group is out of service".into())
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked holding the lock left the slots as they were: still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until every rank has arrived at this meeting.
    fn meet<'a>(&'a self, mut s: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>> {
        if s.aborted {
            return Err(aborted());
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.world {
            s.arrived = 0;
            s.generation += 1;
            self.met.notify_all();
            return Ok(s);
        }
        while s.generation == generation && !s.aborted {
            s = self.met.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.aborted {
            return Err(aborted());
        }
        Ok(s)
    }
}

impl ThreadRank {
    /// Every rank's `x`, in rank order, combined by `f` on each rank.
    fn collect(&self, x: &Tensor, f: impl FnOnce(&[Tensor]) -> Result<Tensor>) -> Result<Tensor> {
        let g = &self.group;
        let mut s = g.lock();
        s.slots[self.rank] = Some(x.clone());
        let s = g.meet(s)?;
        let all: Vec<Tensor> = s.slots.iter().map(|t| t.clone().ok_or_else(aborted)).collect::<Result<_>>()?;
        drop(s);
        let out = f(&all);
        // Nobody reuses the slots before everyone has read them.
        drop(g.meet(g.lock())?);
        out
    }
}

impl Communicator for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        self.collect(x, |all| {
            let mut sum = all[0].clone();
            for t in &all[1..] {
                sum = (sum + t)?;
            }
            Ok(sum)
        })
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.collect(x, |all| Tensor::cat(all, x.rank().saturating_sub(1)))
    }

    fn abort(&self) {
        self.group.lock().aborted = true;
        self.group.met.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn ranks_get_the_same_sum_and_the_gathered_parts() {
        let comms = thread_group(3);
        let outs: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let x = Tensor::new(&[[r, 10.0 * r]], &Device::Cpu).unwrap();
                        let mut sum = Vec::new();
                        // Many rounds: the slots are reused safely.
                        for _ in 0..50 {
                            sum = c.all_reduce(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                        }
                        let gathered = c.all_gather(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                        (sum, gathered)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, gathered) in outs {
            assert_eq!(sum, vec![3.0, 30.0]);
            assert_eq!(gathered, vec![0.0, 0.0, 1.0, 10.0, 2.0, 20.0]);
        }
    }

    #[test]
    fn an_aborted_group_fails_instead_of_waiting() {
        let comms = thread_group(2);
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| comms[0].all_reduce(&x));
            // Rank 1 fails before its collective.
            comms[1].abort();
            assert!(waiting.join().unwrap().is_err());
        });
        assert!(comms[1].all_reduce(&x).is_err());
    }
}
