//! The communicator among GPUs of one host: NCCL (through cudarc), one communicator per rank,
//! each on its device's stream, so a collective runs in order with the rank's kernels and the
//! host does not wait for it. Ranks run on threads of one process (`models::tensor_parallel`).
//!
//! NCCL reads NCCL_* from the environment (on shared machines NVLink multicast stays off:
//! NCCL_NVLS_ENABLE=0). A rank's failure cannot abort the NCCL group from another thread here:
//! `abort` does nothing, and a rank that fails mid-step leaves the others to fail at their
//! next synchronization or wait (see ARCHITECTURE.md, "Tensor parallelism").

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::cudarc::nccl::{Comm, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Result, Shape, Tensor};

use super::comm::Communicator;

struct NcclRank {
    comm: Comm,
}

// SAFETY: a rank's communicator is used by its rank's thread only (the layers call its
// collectives one after another), which is how NCCL allows a communicator to be used; the
// group holds it across threads only between steps.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

/// One communicator per device, in the devices' order (rank i on `devices[i]`).
pub fn nccl_group(devices: &[Device]) -> Result<Vec<Arc<dyn Communicator>>> {
    let streams = devices.iter().map(|d| Ok(d.as_cuda_device()?.cuda_stream())).collect::<Result<Vec<_>>>()?;
    let comms = Comm::from_devices(streams).map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
    Ok(comms.into_iter().map(|comm| Arc::new(NcclRank { comm }) as Arc<dyn Communicator>).collect())
}

#[derive(Clone, Copy)]
enum Op {
    Sum,
    Gather,
}

/// A collective as an op on the rank's tensor (its CUDA storage), giving a new tensor: the sum,
/// or the ranks' tensors one after another (`[world * n]`).
struct Collective<'a> {
    comm: &'a Comm,
    op: Op,
}

fn nccl_err(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL: {e:?}"))
}

impl Collective<'_> {
    fn run<T: NcclType + DeviceRepr + CudaDType>(
        &self,
        x: &CudaSlice<T>,
        l: &Layout,
        s: &CudaStorage,
    ) -> Result<CudaStorage> {
        let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("NCCL: expected a contiguous tensor") };
        let dev = s.device().clone();
        let n = b - a;
        let world = self.comm.world_size();
        let out_len = match self.op {
            Op::Sum => n,
            Op::Gather => n * world,
        };
        // SAFETY: the collective writes every element.
        let mut out = unsafe { dev.alloc::<T>(out_len)? };
        let x = x.slice(a..b);
        match self.op {
            Op::Sum => self.comm.all_reduce(&x, &mut out, &ReduceOp::Sum).map_err(nccl_err)?,
            Op::Gather => self.comm.all_gather(&x, &mut out).map_err(nccl_err)?,
        };
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl CustomOp1 for Collective<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives run on CUDA tensors")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = match &s.slice {
            S::BF16(x) => self.run(x, l, s)?,
            S::F16(x) => self.run(x, l, s)?,
            S::F32(x) => self.run(x, l, s)?,
            _ => candle_core::bail!("NCCL: collectives over {:?} are not supported", s.dtype()),
        };
        let n = l.shape().elem_count();
        let shape = match self.op {
            Op::Sum => l.shape().clone(),
            Op::Gather => Shape::from(n * self.comm.world_size()),
        };
        Ok((out, shape))
    }
}

impl Communicator for NcclRank {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&Collective { comm: &self.comm, op: Op::Sum })
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let Some((&last, lead)) = dims.split_last() else { candle_core::bail!("NCCL: gathering a scalar") };
        let rows: usize = lead.iter().product();
        let world = self.world();
        // [world * rows * last] in rank order -> [rows, world * last].
        let flat = x.contiguous()?.apply_op1_no_bwd(&Collective { comm: &self.comm, op: Op::Gather })?;
        let side_by_side = flat.reshape((world, rows, last))?.transpose(0, 1)?.contiguous()?;
        let mut shape = lead.to_vec();
        shape.push(world * last);
        side_by_side.reshape(shape)
    }

    fn abort(&self) {}
}
