//! The Gated DeltaNet recurrence of a step's rows on a CUDA device (`cuda/gated_delta.cu`):
//! the causal conv with its state, then the gated delta rule with its state, every sequence of
//! the step at once, each from its own state slot. The CPU reference is `ops::gated_delta`;
//! `tests/cuda_ops.rs` holds the two together.
//!
//! The kernels read every sequence's rows, context and state slot from the step's device
//! metadata (`batch::MetaLayout`), so a decode step replays in a CUDA graph by rewriting that
//! buffer. The states are written in place: `RecurrentState`'s device tensors, allocated at
//! start, are held (read-locked) through the launches, and kernels on one stream run in order.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cuda::{cuda_slice, with_u32_slice, GATED_DELTA};
use crate::batch::DeviceAttentionMeta;
use crate::config::LinearAttnConfig;

/// A layer's fixed parameters on the device, f32: the conv weight `[conv_dim, K]`, `-exp(A_log)`
/// and `dt_bias` `[Hv]`.
pub struct DeviceDeltaParams {
    pub conv_weight: Tensor,
    pub neg_a: Tensor,
    pub dt_bias: Tensor,
}

/// The largest key head dim the recurrence kernel takes (a warp per 32 key rows, 8 warps).
const MAX_KEY_DIM: usize = 256;

/// Runs a step's rows through the conv and the delta rule: `qkv` `[T, conv_dim]`, `a`, `b`
/// `[T, Hv]` (any float type); `conv_state` `[slots, K - 1, conv_dim]` and `ssm_state`
/// `[slots, Hv, Dk, Dv]` f32 are advanced past each sequence's rows. Returns `o` `[T, Hv * Dv]`
/// f32 (zero on a graph's padding rows).
#[allow(clippy::too_many_arguments)]
pub fn run_step(
    dims: &LinearAttnConfig,
    params: &DeviceDeltaParams,
    conv_state: &Tensor,
    ssm_state: &Tensor,
    meta: &DeviceAttentionMeta,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
) -> Result<Tensor> {
    let f32c = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    let op = DeltaStep { dims: *dims, params, conv_state, ssm_state, meta };
    f32c(qkv)?.apply_op3_no_bwd(&f32c(a)?, &f32c(b)?, &op)
}

struct DeltaStep<'a> {
    dims: LinearAttnConfig,
    params: &'a DeviceDeltaParams,
    conv_state: &'a Tensor,
    ssm_state: &'a Tensor,
    meta: &'a DeviceAttentionMeta,
}

impl DeltaStep<'_> {
    /// Checks every shape; returns the step's rows.
    fn check(&self, qkv: &Layout, a: &Layout, b: &Layout) -> Result<usize> {
        let d = &self.dims;
        let (c, hv, k) = (d.conv_dim(), d.num_value_heads, d.conv_kernel);
        let rows = self.meta.layout.rows;
        if qkv.dims() != [rows, c] || a.dims() != [rows, hv] || b.dims() != [rows, hv] {
            candle_core::bail!(
                "gated-delta: inputs {:?}, {:?}, {:?} for {rows} rows of {c} channels and {hv} value heads",
                qkv.dims(),
                a.dims(),
                b.dims()
            );
        }
        if ![qkv, a, b].iter().all(|l| l.is_contiguous()) {
            candle_core::bail!("gated-delta: inputs must be contiguous");
        }
        let slots = self.conv_state.dim(0)?;
        if self.conv_state.dims() != [slots, k - 1, c]
            || self.ssm_state.dims() != [slots, hv, d.key_head_dim, d.value_head_dim]
        {
            candle_core::bail!(
                "gated-delta: state tensors {:?}, {:?} do not fit {d:?}",
                self.conv_state.dims(),
                self.ssm_state.dims()
            );
        }
        if k < 2 || k > 9 || d.num_key_heads == 0 || hv % d.num_key_heads != 0 {
            candle_core::bail!(
                "gated-delta: no kernel for {d:?} (conv kernel 2..=9, value heads a multiple of key heads)"
            );
        }
        Ok(rows)
    }
}

impl CustomOp3 for DeltaStep<'_> {
    fn name(&self) -> &'static str {
        "gated-delta"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("gated-delta: the device op runs on CUDA; the CPU runs ops::gated_delta")
    }

    fn cuda_fwd(
        &self,
        qkv: &CudaStorage,
        qkv_l: &Layout,
        a: &CudaStorage,
        a_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let rows = self.check(qkv_l, a_l, b_l)?;
        let d = &self.dims;
        let (c, hv, hk, dk, dv) = (d.conv_dim(), d.num_value_heads, d.num_key_heads, d.key_head_dim, d.value_head_dim);
        if dk > MAX_KEY_DIM {
            candle_core::bail!("gated-delta: no kernel for key head dim {dk} (at most {MAX_KEY_DIM})")
        }
        let dev = qkv.device().clone();
        let l = self.meta.layout;
        let seqs = l.seqs();
        fn view<'s>(s: &'s CudaStorage, l: &Layout) -> Result<CudaView<'s, f32>> {
            let (start, end) = l
                .contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg("gated-delta: input not contiguous".into()))?;
            Ok(s.as_cuda_slice::<f32>()?.slice(start..end))
        }
        let (x, a, b) = (view(qkv, qkv_l)?, view(a, a_l)?, view(b, b_l)?);
        let (cw, cw_l) = self.params.conv_weight.storage_and_layout();
        let (na, _) = self.params.neg_a.storage_and_layout();
        let (dt, _) = self.params.dt_bias.storage_and_layout();
        let (cs, _) = self.conv_state.storage_and_layout();
        let (ss, _) = self.ssm_state.storage_and_layout();
        if cw_l.dims() != [c, d.conv_kernel] {
            candle_core::bail!("gated-delta: conv weight {:?}, not [{c}, {}]", cw_l.dims(), d.conv_kernel);
        }
        let (cw, na, dt) =
            (cuda_slice::<f32>(&cw, "conv weight")?, cuda_slice::<f32>(&na, "A")?, cuda_slice::<f32>(&dt, "dt_bias")?);
        let (cs, ss) = (cuda_slice::<f32>(&cs, "conv state")?, cuda_slice::<f32>(&ss, "delta state")?);
        // SAFETY: gdn_conv writes every element of y (zero on padding rows).
        let y: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows * c)? };
        // Zeroed: padding sequences' rows are left as they are.
        let o: CudaSlice<f32> = dev.alloc_zeros::<f32>(rows * hv * dv)?;
        let (ci, ki) = (c as i32, d.conv_kernel as i32);
        let ints = [hk as i32, hv as i32, dk as i32, dv as i32];
        let channel_blocks = c.div_ceil(128) as u32;
        with_u32_slice(&self.meta.data, |meta| {
            let row_seq = meta.slice(l.row_seq..l.row_seq + rows);
            let seq_info = meta.slice(l.seq_info..l.rings);
            let slots = meta.slice(l.state_slots..l.row_end);
            if rows > 0 {
                let f = GATED_DELTA.func(&dev, "gdn_conv")?;
                let cfg = LaunchConfig {
                    grid_dim: (channel_blocks, rows as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut bld = f.builder();
                bld.arg(&y).arg(&x).arg(cw).arg(cs).arg(&row_seq).arg(&seq_info).arg(&slots).arg(&ci).arg(&ki);
                // SAFETY: arguments match gdn_conv's signature; every shape and slot range was checked.
                unsafe { bld.launch(cfg) }.w()?;
            }
            if seqs > 0 {
                let f = GATED_DELTA.func(&dev, "gdn_conv_state")?;
                let cfg = LaunchConfig {
                    grid_dim: (channel_blocks, seqs as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut bld = f.builder();
                bld.arg(cs).arg(&x).arg(&seq_info).arg(&slots).arg(&ci).arg(&ki);
                // SAFETY: as above; it runs after gdn_conv, which read the old state.
                unsafe { bld.launch(cfg) }.w()?;
                let f = GATED_DELTA.func(&dev, "gdn_recurrence")?;
                let cfg = LaunchConfig {
                    grid_dim: (hv as u32, seqs as u32, dv.div_ceil(32) as u32),
                    block_dim: (32 * dk.div_ceil(32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut bld = f.builder();
                bld.arg(&o).arg(&y).arg(&a).arg(&b).arg(na).arg(dt).arg(ss).arg(&seq_info).arg(&slots);
                for i in &ints {
                    bld.arg(i);
                }
                // SAFETY: arguments match gdn_recurrence's signature; shapes were checked.
                unsafe { bld.launch(cfg) }.w()?;
            }
            Ok(())
        })?;
        Ok((CudaStorage::wrap_cuda_slice(o, dev), Shape::from((rows, hv * dv))))
    }
}
