//! Device code for the ops in `ops/`: the `.cu` files beside this one, compiled to PTX by
//! build.rs (feature `cuda`) and loaded into candle's CUDA device on first use.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, SyncOnDrop,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Storage, Tensor};

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/iris_ptx.rs"));
}

/// The head dims the attention, projection and TurboQuant kernels are compiled for.
pub const HEAD_DIMS: [usize; 7] = [16, 32, 64, 80, 96, 128, 256];

/// The head dims of the paged-attention kernels: those and Gemma 4's 512-wide global layers
/// (which take the op-by-op projections: their value norm keeps them off the fused kernel).
pub const PAGED_HEAD_DIMS: [usize; 8] = [16, 32, 64, 80, 96, 128, 256, 512];

/// That the TurboQuant kernels take `codec` (a compiled head dim, 2-4 bits, a Hadamard rotation
/// for powers of two) and that its device table holds `table_len` values as it should; else an
/// error naming `what`.
pub fn check_tq_codec(what: &str, codec: &crate::ops::turboquant::TqCodec, table_len: usize) -> Result<()> {
    let (d, bits) = (codec.dim(), codec.bits());
    if !HEAD_DIMS.contains(&d) || !(2..=4).contains(&bits) || (!d.is_power_of_two() && !codec.rotation().is_dense()) {
        candle_core::bail!("{what}: no CUDA kernel for head_dim {d} with {bits}-bit codes");
    }
    if table_len != codec.device_table_len() {
        candle_core::bail!("{what}: the device codec table holds {table_len} values, not {}", codec.device_table_len());
    }
    Ok(())
}

/// The head dims the tensor-core prompt-chunk kernels (`prefill_attention.cu`) are compiled for.
pub const PREFILL_HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];

/// Kernel `name` of `prefill_attention.cu` (`prefill_attention` or `tq_prefill_attention`, for
/// `qt` queries and `head_dim`) and its launch over a step's `num_tiles` prompt-chunk tiles,
/// `heads` query heads and `splits` blocks per tile's keys (`PrefillTile::splits`): a block of
/// 4 warps each, with the dynamic shared memory of PfLayout::BYTES there.
pub fn prefill_launch(
    dev: &CudaDevice,
    name: &str,
    qt: &str,
    head_dim: usize,
    (num_tiles, heads, splits): (usize, usize, usize),
) -> Result<(Kernel, LaunchConfig)> {
    let f = PREFILL_ATTENTION.func(dev, &format!("{name}_{qt}_{head_dim}"))?;
    let smem = (640 * (head_dim + 8)) as u32;
    f.set_max_dynamic_shared(smem)?;
    let cfg = LaunchConfig {
        grid_dim: (num_tiles as u32, heads as u32, splits as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    Ok((f, cfg))
}

/// `gqa_decode` of `decode_attention.cu` for `qt` (bf16 / f16) queries and `head_dim` (one of
/// PREFILL_HEAD_DIMS), and its launch over `rows` x `kv_heads` x (head tiles of 16 per group)
/// x `splits` blocks of 4 warps, with GdLayout::BYTES of dynamic shared memory; and the blocks
/// of that size a multiprocessor holds at once.
pub fn gqa_decode_launch(
    dev: &CudaDevice,
    qt: &str,
    head_dim: usize,
    (rows, kv_heads, group, splits): (usize, usize, usize, usize),
) -> Result<(Kernel, LaunchConfig)> {
    /// GD_STAGES in decode_attention.cu.
    const STAGES: usize = 3;
    let f = DECODE_ATTENTION.func(dev, &format!("gqa_decode_{qt}_{head_dim}"))?;
    let smem = ((32 + 256 * STAGES) * (head_dim + 8)) as u32;
    f.set_max_dynamic_shared(smem)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, (kv_heads * group.div_ceil(16)) as u32, splits as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem,
    };
    Ok((f, cfg))
}

/// Launches a product kernel of `(T* y, const T* x, const T* w, int...)` as a programmatic
/// dependent, x and W starting at element offsets `ox` and `ow` of their storage, and returns y
/// (`out_len` elements of their type): the GEMV and batch-invariant products.
///
/// # Safety
/// `func` takes exactly those parameters (as many ints as `ints`), writes every element of y,
/// reads no more of x and W than they hold under `cfg`, and calls `pdl_wait` before it reads x
/// or writes y.
pub unsafe fn launch_product(
    func: &Kernel,
    cfg: LaunchConfig,
    (sx, ox): (&candle_core::CudaStorage, usize),
    (sw, ow): (&candle_core::CudaStorage, usize),
    out_len: usize,
    ints: &[i32],
) -> Result<candle_core::CudaStorage> {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaDType, CudaStorageSlice as S};
    unsafe fn go<T: CudaDType + DeviceRepr>(
        func: &Kernel,
        cfg: LaunchConfig,
        dev: &CudaDevice,
        (x, w): (&CudaSlice<T>, &CudaSlice<T>),
        (ox, ow): (usize, usize),
        out_len: usize,
        ints: &[i32],
    ) -> Result<candle_core::CudaStorage> {
        // SAFETY (alloc): the kernel writes every element of y (the caller's promise).
        let y: CudaSlice<T> = unsafe { dev.alloc::<T>(out_len)? };
        let (x, w) = (x.slice(ox..), w.slice(ow..));
        let mut b = func.dependent();
        b.mem(&y).mem(&x).mem(&w);
        for v in ints {
            b.scalar(v);
        }
        // SAFETY: the parameters, in order and type, are the caller's promise.
        unsafe { b.launch(cfg) }?;
        Ok(candle_core::CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }
    let dev = sx.device();
    let offs = (ox, ow);
    // SAFETY: passed on from the caller.
    unsafe {
        match (&sx.slice, &sw.slice) {
            (S::F32(x), S::F32(w)) => go(func, cfg, dev, (x, w), offs, out_len, ints),
            (S::BF16(x), S::BF16(w)) => go(func, cfg, dev, (x, w), offs, out_len, ints),
            (S::F16(x), S::F16(w)) => go(func, cfg, dev, (x, w), offs, out_len, ints),
            _ => candle_core::bail!(
                "product kernel: x and W of one float type, got {:?} and {:?}",
                sx.dtype(),
                sw.dtype()
            ),
        }
    }
}

/// One compiled `.cu` file.
pub struct Module {
    name: &'static str,
    ptx: &'static str,
}

pub const ADD_RMS_NORM: Module = Module { name: "iris_add_rms_norm", ptx: ptx::ADD_RMS_NORM };
pub const GATED_ACT: Module = Module { name: "iris_gated_act", ptx: ptx::GATED_ACT };
pub const DECODE_ATTENTION: Module = Module { name: "iris_decode_attention", ptx: ptx::DECODE_ATTENTION };
pub const GATED_DELTA: Module = Module { name: "iris_gated_delta", ptx: ptx::GATED_DELTA };
pub const GEMV: Module = Module { name: "iris_gemv", ptx: ptx::GEMV };
pub const INVARIANT_MATMUL: Module = Module { name: "iris_invariant_matmul", ptx: ptx::INVARIANT_MATMUL };
pub const KV_WRITE: Module = Module { name: "iris_kv_write", ptx: ptx::KV_WRITE };
pub const MOE_EXPERTS: Module = Module { name: "iris_moe_experts", ptx: ptx::MOE_EXPERTS };
pub const MOE_ROUTE: Module = Module { name: "iris_moe_route", ptx: ptx::MOE_ROUTE };
pub const PAGED_ATTENTION: Module = Module { name: "iris_paged_attention", ptx: ptx::PAGED_ATTENTION };
pub const PREFILL_ATTENTION: Module = Module { name: "iris_prefill_attention", ptx: ptx::PREFILL_ATTENTION };
pub const QGEMV: Module = Module { name: "iris_qgemv", ptx: ptx::QGEMV };
pub const QKV_ROPE: Module = Module { name: "iris_qkv_rope", ptx: ptx::QKV_ROPE };
pub const SAMPLING: Module = Module { name: "iris_sampling", ptx: ptx::SAMPLING };
pub const TQ_ATTENTION: Module = Module { name: "iris_tq_attention", ptx: ptx::TQ_ATTENTION };
pub const TQ_WRITE: Module = Module { name: "iris_tq_write", ptx: ptx::TQ_WRITE };

/// Every kernel module iris and candle use (but candle's quantized one), loaded into `dev` now
/// rather than at first use. Tensor-parallel ranks need it: loading a module while an NCCL
/// kernel waits on the device for a peer can stall the driver until the peer comes, and the
/// peer may be stalled behind the same load (NCCL's documented hang with lazily loaded
/// kernels), so no module may load once the ranks run.
pub fn preload(dev: &CudaDevice) {
    use candle_core::cuda_backend::kernels as k;
    const OURS: [&Module; 16] = [
        &ADD_RMS_NORM,
        &DECODE_ATTENTION,
        &GATED_ACT,
        &GATED_DELTA,
        &GEMV,
        &INVARIANT_MATMUL,
        &KV_WRITE,
        &MOE_EXPERTS,
        &MOE_ROUTE,
        &PAGED_ATTENTION,
        &PREFILL_ATTENTION,
        &QGEMV,
        &QKV_ROPE,
        &SAMPLING,
        &TQ_ATTENTION,
        &TQ_WRITE,
    ];
    // A module is kept once loaded, before its function is looked up: a name it lacks loads
    // it all the same (the lookup's error says only that the name is not there).
    for m in OURS {
        let _ = dev.get_or_load_custom_func("iris_preload", m.name, m.ptx);
    }
    for m in [k::AFFINE, k::BINARY, k::CAST, k::CONV, k::FILL, k::INDEXING, k::REDUCE, k::SORT, k::TERNARY, k::UNARY] {
        let _ = dev.get_or_load_func("iris_preload", &m);
    }
}

impl Module {
    /// Kernel `name` of this module, loaded into `dev` on first use.
    pub fn func(&self, dev: &CudaDevice, name: &str) -> Result<Kernel> {
        let func = dev.get_or_load_custom_func(name, self.name, self.ptx)?.into_cuda_function();
        Ok(Kernel { func, stream: dev.cuda_stream() })
    }
}

/// A loaded kernel and the device's stream it runs on.
pub struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Blocks of `threads` (no dynamic shared memory) the whole GPU holds at once: one wave.
    /// Asked of the driver once per loaded kernel and block size (launches ask again and again).
    pub fn wave(&self, threads: u32) -> Result<usize> {
        use std::collections::HashMap;
        use std::sync::Mutex;

        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
        use candle_core::cuda_backend::WrapErr;
        static WAVES: Mutex<Option<HashMap<(usize, u32), usize>>> = Mutex::new(None);
        let key = (self.func.cu_function() as usize, threads);
        if let Some(&w) = WAVES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).get(&key) {
            return Ok(w);
        }
        let per_sm = self.func.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None).w()? as usize;
        let sms = self.stream.context().attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
        let wave = per_sm.max(1) * sms;
        WAVES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(key, wave);
        Ok(wave)
    }

    /// Arguments for a launch as a programmatic dependent (`DependentArgs::launch`).
    pub fn dependent(&self) -> DependentArgs<'_> {
        DependentArgs {
            kernel: self,
            values: [0; MAX_ARGS],
            scalars: [None; MAX_ARGS],
            guards: [const { None }; MAX_ARGS],
            len: 0,
        }
    }

    /// Launches the kernel as a programmatic dependent of the kernel before it on the stream
    /// (Hopper's programmatic dependent launch): it may start while that kernel ends, and must
    /// call `pdl_wait()` (common.cuh) before it reads anything an earlier kernel wrote and before
    /// it writes. Falls back to a plain launch where the driver refuses (older GPUs) or with
    /// `IRIS_CUDA_PDL=0`.
    ///
    /// # Safety
    /// `params` point to the kernel's arguments, in its order and types, alive for the call.
    pub unsafe fn launch_dependent(&self, cfg: LaunchConfig, params: &mut [*mut std::ffi::c_void]) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        use candle_core::cuda_backend::WrapErr;
        let pdl = crate::switches::switched_on!("IRIS_CUDA_PDL");
        self.stream.context().bind_to_thread().w()?;
        // SAFETY: a zeroed attribute is a valid "no attribute"; id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let mut config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: pdl as u32,
        };
        let f = self.func.cu_function();
        // SAFETY: the caller vouches for `params`; config and attribute live through the call.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) };
        if r != sys::CUresult::CUDA_SUCCESS && pdl {
            config.numAttrs = 0;
            // SAFETY: as above, without the attribute.
            return unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
                .result()
                .w();
        }
        r.result().w()
    }

    /// Lets a launch ask for `bytes` of dynamic shared memory (past the default 48 KiB).
    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
        use candle_core::cuda_backend::WrapErr;
        self.func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).w()
    }
}

const MAX_ARGS: usize = 32;

/// A kernel's arguments, in its order, for `Kernel::launch_dependent`: device memory (passed
/// as its address, held here) or scalars (by reference, alive as long as this). Kept on the
/// stack: a decode step launches hundreds of kernels.
pub struct DependentArgs<'a> {
    kernel: &'a Kernel,
    /// Argument i's device address (memory arguments).
    values: [u64; MAX_ARGS],
    /// Argument i's value (scalar arguments).
    scalars: [Option<*const std::ffi::c_void>; MAX_ARGS],
    guards: [Option<SyncOnDrop<'a>>; MAX_ARGS],
    /// Arguments pushed (past MAX_ARGS: counted only, and `launch` refuses).
    len: usize,
}

impl<'a> DependentArgs<'a> {
    pub fn mem<T>(&mut self, m: &'a impl DevicePtr<T>) -> &mut Self {
        let (addr, guard) = m.device_ptr(&self.kernel.stream);
        if let Some(g) = self.guards.get_mut(self.len) {
            *g = Some(guard);
        }
        self.push(addr, None)
    }

    /// A null pointer (an input the kernel does without).
    pub fn null(&mut self) -> &mut Self {
        self.push(0, None)
    }

    pub fn scalar<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.push(0, Some(v as *const T as *const _))
    }

    fn push(&mut self, addr: u64, scalar: Option<*const std::ffi::c_void>) -> &mut Self {
        if self.len < MAX_ARGS {
            (self.values[self.len], self.scalars[self.len]) = (addr, scalar);
        }
        self.len += 1;
        self
    }

    /// # Safety
    /// The arguments are the kernel's, in its order and types, and the kernel calls
    /// `pdl_wait()` before it reads what earlier kernels wrote and before it writes.
    pub unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<()> {
        if self.len > MAX_ARGS {
            candle_core::bail!("a dependent launch takes at most {MAX_ARGS} arguments");
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
        for (i, p) in params.iter_mut().enumerate().take(self.len) {
            *p = match self.scalars[i] {
                Some(v) => v as *mut _,
                None => &mut self.values[i] as *mut u64 as *mut _,
            };
        }
        // SAFETY: per the caller; `params` point into `self` and the scalars it borrows, all
        // alive until this returns; the guards drop after the launch.
        unsafe { self.kernel.launch_dependent(cfg, &mut params[..self.len]) }
    }
}

/// The kernels' name for an element type.
pub fn dtype_name(d: DType) -> Result<&'static str> {
    Ok(match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("no CUDA kernel for {other:?}"),
    })
}

/// Runs `f` on the device slice of a contiguous u32 tensor (step metadata uploaded once).
pub fn with_u32_slice<R>(t: &Tensor, f: impl FnOnce(&CudaSlice<u32>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        candle_core::bail!("step metadata must be a whole contiguous tensor");
    }
    match &*storage {
        Storage::Cuda(s) => f(s.as_cuda_slice::<u32>()?),
        _ => candle_core::bail!("step metadata is not on the CUDA device"),
    }
}

/// The device data of a tensor's storage, of element type `T` (`what` names it in errors).
pub fn cuda_slice<'s, T: candle_core::cuda_backend::CudaDType>(s: &'s Storage, what: &str) -> Result<&'s CudaSlice<T>> {
    match s {
        Storage::Cuda(c) => c.as_cuda_slice::<T>(),
        _ => candle_core::bail!("{what} is not on the CUDA device"),
    }
}

/// For the split decode attention on `dev`'s stream: zeroed u32 counters that its blocks count
/// arrivals in and leave at zero (the last block of a (row, head) merges), when the launch's
/// `blocks` of `threads` threads all fit the GPU at once (by its thread limit) and `n` counters
/// are enough; None otherwise (the caller merges with a kernel of its own). Made once per
/// stream (kernels on one stream run in order, so they never share them) and kept for the
/// process (64 KiB each).
pub fn arrival_counters(
    dev: &CudaDevice,
    n: usize,
    blocks: usize,
    threads: usize,
) -> Result<Option<&'static CudaSlice<u32>>> {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    use candle_core::cuda_backend::WrapErr;
    /// Enough for every (row, head) of a step the split decode kernel takes (rows x kv heads <
    /// 128, so rows x heads < 128 x group size) for groups of up to 128 query heads.
    const COUNTERS: usize = 1 << 14;
    /// Per stream: the counters, the GPU's multiprocessors and the threads each holds at once.
    type Entry = (&'static CudaSlice<u32>, usize, usize);
    static ALL: Mutex<Option<HashMap<usize, Entry>>> = Mutex::new(None);
    if n > COUNTERS {
        return Ok(None);
    }
    let mut all = ALL.lock().unwrap_or_else(|e| e.into_inner());
    let map = all.get_or_insert_with(HashMap::new);
    let key = dev.cuda_stream().cu_stream() as usize;
    let (counters, sms, per_sm) = match map.get(&key) {
        Some(&entry) => entry,
        None => {
            let ctx = dev.cuda_stream().context().clone();
            let sms = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
            let per_sm = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR).w()? as usize;
            let c: &'static CudaSlice<u32> = Box::leak(Box::new(dev.alloc_zeros::<u32>(COUNTERS)?));
            *map.entry(key).or_insert((c, sms, per_sm))
        }
    };
    Ok((blocks <= sms * (per_sm / threads.max(1))).then_some(counters))
}
