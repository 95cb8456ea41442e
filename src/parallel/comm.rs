//! What ranks share: the collectives their layers call, and what completes a divided product.

use std::sync::Arc;

use candle_core::{Result, Tensor};

/// The collectives a rank's layers call. Every rank calls the same collectives in the same
/// order (the layers are the same), each with its own tensor.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// The elementwise sum of every rank's `x` (the same shape and dtype on each): the same
    /// values on every rank.
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor>;
    /// Every rank's `x` side by side along the last axis, in rank order.
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;
    /// Fails every collective in progress or to come (a rank failed), so that no rank waits
    /// forever for one that will not come.
    fn abort(&self);
}

/// What completes the output of a divided product.
#[derive(Clone)]
pub enum Collective {
    /// Partial sums (a row-parallel product): added up across ranks.
    Sum(Arc<dyn Communicator>),
    /// A range of the outputs (the vocabulary-parallel output head): put side by side.
    Gather(Arc<dyn Communicator>),
}

impl Collective {
    pub fn apply(&self, y: &Tensor) -> Result<Tensor> {
        match self {
            Collective::Sum(c) => c.all_reduce(y),
            Collective::Gather(c) => c.all_gather(y),
        }
    }
}
