//! The routed experts of a mixture-of-experts layer on CUDA, over the layer's experts stacked
//! at load (`gate_up` `[E, 2I, H]`, `down` `[E, H, I]`): grouping of the (token, slot) pairs by
//! expert, the gate/up projection with act(gate) * up, the down projection and the weighted sum
//! over each token's slots, all on the device (`cuda/moe_experts.cu`), so a decode step needs
//! no host round trip and can be captured in a graph. The reference is the layer's grouped
//! computation on the CPU (`layers::moe`), which tests/cuda_ops.rs compares it to.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Result, Storage, Tensor, WithDType};

use super::cuda::{dtype_name, Kernel, MOE_EXPERTS};

/// Warps per block of the projection kernels (`MOE_WARPS`).
const WARPS: usize = 8;

pub struct MoeExperts {
    /// GELU (tanh approximation) instead of SiLU.
    pub gelu: bool,
}

impl MoeExperts {
    /// `sum_j weights[t, j] MLP_{experts[t, j]}(x[t])` for rows `x` (`[T, H]`, the experts'
    /// dtype), `experts` `[T, k]` u32 and `weights` `[T, k]` f32 (a `Routing`).
    pub fn forward(
        &self,
        x: &Tensor,
        experts: &Tensor,
        weights: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
    ) -> Result<Tensor> {
        let (t, h) = x.dims2()?;
        let (e, two_i, h2) = gate_up.dims3()?;
        let i = two_i / 2;
        let k = experts.dim(1)?;
        let dt = x.dtype();
        if h2 != h
            || two_i % 2 != 0
            || down.dims() != [e, h, i]
            || experts.dims() != [t, k]
            || weights.dims() != [t, k]
            || gate_up.dtype() != dt
            || down.dtype() != dt
            || experts.dtype() != DType::U32
            || weights.dtype() != DType::F32
        {
            candle_core::bail!(
                "moe-experts: x {:?} {dt:?}, experts {:?}, weights {:?}, gate_up {:?} {:?}, down {:?} {:?}",
                x.shape(),
                experts.shape(),
                weights.shape(),
                gate_up.shape(),
                gate_up.dtype(),
                down.shape(),
                down.dtype()
            );
        }
        if e == 0 || e > 8192 || k == 0 {
            candle_core::bail!("moe-experts: {e} experts, {k} per token");
        }
        if t == 0 {
            return Tensor::zeros((0, h), dt, x.device());
        }
        let (x, experts, weights) = (x.contiguous()?, experts.contiguous()?, weights.contiguous()?);
        let (gate_up, down) = (gate_up.contiguous()?, down.contiguous()?);
        let dev = x.device().as_cuda_device()?.clone();
        let dims = Dims { t, h, i, e, k, gelu: self.gelu };
        let ts = [&x, &gate_up, &down];
        let y = match dt {
            DType::F32 => launch::<f32>(&dev, &ts, &experts, &weights, dims)?,
            DType::BF16 => launch::<half::bf16>(&dev, &ts, &experts, &weights, dims)?,
            DType::F16 => launch::<half::f16>(&dev, &ts, &experts, &weights, dims)?,
            other => candle_core::bail!("moe-experts: no kernel for {other:?}"),
        };
        Ok(Tensor::from_storage(Storage::Cuda(y), (t, h), BackpropOp::none(), false))
    }
}

#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    h: usize,
    i: usize,
    e: usize,
    k: usize,
    gelu: bool,
}

/// A contiguous tensor's device slice (from its start) and start offset, in elements.
fn with_slice<T: CudaDType, R>(t: &Tensor, f: impl FnOnce(&CudaSlice<T>, usize) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(s.as_cuda_slice::<T>()?, layout.start_offset()),
        _ => candle_core::bail!("moe-experts: a tensor is not on the CUDA device"),
    }
}

/// `[x, gate_up, down]` of element type T; `experts` u32 and `weights` f32 (all contiguous).
fn launch<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    ts: &[&Tensor; 3],
    experts: &Tensor,
    weights: &Tensor,
    d: Dims,
) -> Result<CudaStorage> {
    let Dims { t, h, i, e, k, gelu } = d;
    let pairs = t * k;
    let func = |name: &str| -> Result<Kernel> { MOE_EXPERTS.func(dev, &format!("{name}_{}", dtype_name(T::DTYPE)?)) };
    // SAFETY (all four): moe_group writes every offset and every order entry of a valid pair
    // (the routing holds valid expert ids); the projections write every row of every pair and
    // moe_combine every output element.
    let offsets = unsafe { dev.alloc::<u32>(e + 1)? };
    let order = unsafe { dev.alloc::<u32>(pairs)? };
    let hid = unsafe { dev.alloc::<T>(pairs * i)? };
    let out = unsafe { dev.alloc::<T>(pairs * h)? };
    let y = unsafe { dev.alloc::<T>(t * h)? };
    let v = 16 / T::DTYPE.size_in_bytes();
    let (pairs_i, e_i, h_i, i_i, k_i, t_i) = (pairs as i32, e as i32, h as i32, i as i32, k as i32, t as i32);
    let gelu = gelu as i32;

    with_slice::<u32, _>(experts, |ex, off| {
        let ex = ex.slice(off..off + pairs);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: (e * 4) as u32 };
        let f = MOE_EXPERTS.func(dev, "moe_group")?;
        let mut b = f.builder();
        b.arg(&ex).arg(&pairs_i).arg(&e_i).arg(&offsets).arg(&order);
        // SAFETY: argument types and counts match the kernel's signature.
        unsafe { b.launch(cfg) }.w()
    })?;

    let block = (32 * WARPS as u32, 1, 1);
    with_slice::<T, _>(ts[0], |x, x_off| {
        with_slice::<T, _>(ts[1], |gu, gu_off| {
            let x = x.slice(x_off..x_off + t * h);
            let gu = gu.slice(gu_off..gu_off + e * 2 * i * h);
            let vec = (h % v == 0 && x_off % v == 0 && gu_off % v == 0) as i32;
            let cfg = LaunchConfig {
                grid_dim: (i.div_ceil(WARPS) as u32, e as u32, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            };
            let f = func("moe_gate_up")?;
            let mut b = f.builder();
            b.arg(&x).arg(&h_i).arg(&gu).arg(&offsets).arg(&order).arg(&hid);
            b.arg(&h_i).arg(&i_i).arg(&k_i).arg(&vec).arg(&gelu);
            // SAFETY: argument types and counts match the kernel's signature; shapes were checked.
            unsafe { b.launch(cfg) }.w()
        })
    })?;

    with_slice::<T, _>(ts[2], |dn, dn_off| {
        let dn = dn.slice(dn_off..dn_off + e * h * i);
        let vec = (i % v == 0 && dn_off % v == 0) as i32;
        let cfg =
            LaunchConfig { grid_dim: (h.div_ceil(WARPS) as u32, e as u32, 1), block_dim: block, shared_mem_bytes: 0 };
        let f = func("moe_down")?;
        let mut b = f.builder();
        b.arg(&hid).arg(&dn).arg(&offsets).arg(&order).arg(&out).arg(&h_i).arg(&i_i).arg(&vec);
        // SAFETY: argument types and counts match the kernel's signature; shapes were checked.
        unsafe { b.launch(cfg) }.w()
    })?;

    with_slice::<f32, _>(weights, |w, w_off| {
        let w = w.slice(w_off..w_off + pairs);
        let cfg = LaunchConfig {
            grid_dim: ((t * h).div_ceil(256).clamp(1, 65535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = func("moe_combine")?;
        let mut b = f.builder();
        b.arg(&out).arg(&w).arg(&y).arg(&t_i).arg(&h_i).arg(&k_i);
        // SAFETY: argument types and counts match the kernel's signature; shapes were checked.
        unsafe { b.launch(cfg) }.w()
    })?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
