//! One pass from a fused q/k/v projection to the attention inputs: split into heads, add the
//! bias, apply the optional per-head RMSNorm of q and k, rotate q and k.
//!
//! The layer computes the same thing op by op (the CPU path does); on CUDA this replaces about
//! eight launches per layer with one.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::kv_write::KvWrite;
use super::tq_write::TqWrite;
use super::turboquant::TqLayerCache;
use crate::batch::AttentionMeta;

pub struct QkvRope<'a> {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `[(heads + 2 kv_heads) * head_dim]`.
    pub bias: Option<&'a Tensor>,
    /// `[T, head_dim / 2]` (any shape of that many elements), the model's type.
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    /// Per-head RMSNorm weights of q and k (`[head_dim]` each) and epsilon.
    pub qk_norm: Option<(&'a Tensor, &'a Tensor, f32)>,
    /// Rotary pairs (2i, 2i + 1) instead of (i, i + head_dim / 2).
    pub interleaved: bool,
}

impl QkvRope<'_> {
    /// `y`: `[T, (heads + 2 kv_heads) * head_dim]` -> q `[T, heads, d]`, k and v `[T, kv_heads, d]`.
    pub fn forward(&self, y: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        self.split(&y.apply_op1_no_bwd(self)?, y.dim(0)?)
    }

    /// The kernel's output for `t` rows, q then k then v, as three tensors.
    fn split(&self, out: &Tensor, t: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = out.narrow(0, 0, t * hq * d)?.reshape((t, hq, d))?;
        let k = out.narrow(0, t * hq * d, t * hkv * d)?.reshape((t, hkv, d))?;
        let v = out.narrow(0, t * (hq + hkv) * d, t * hkv * d)?.reshape((t, hkv, d))?;
        Ok((q, k, v))
    }

    /// `forward`, then k and v written to their slots of a dense cache (`[slots, kv_heads,
    /// head_dim]` each) as `KvWrite` does: returns q. On CUDA with a cache of y's type, one launch
    /// (`IRIS_CUDA_FUSED_KV_WRITE=0`: three, to compare).
    pub fn forward_into_cache(&self, y: &Tensor, kc: &Tensor, vc: &Tensor, meta: &AttentionMeta) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if Self::fused_write()
            && y.device().is_cuda()
            && kc.dtype() == y.dtype()
            && vc.dtype() == y.dtype()
            && meta.device.is_some()
        {
            let t = y.dim(0)?;
            let op = IntoCache { rope: self, dst: CacheDst::Dense(kc, vc), meta };
            return y.apply_op1_no_bwd(&op)?.reshape((t, self.num_heads, self.head_dim));
        }
        let (q, k, v) = self.forward(y)?;
        let write = KvWrite::step(meta);
        kc.inplace_op2(&k.contiguous()?, &write)?;
        vc.inplace_op2(&v.contiguous()?, &write)?;
        Ok(q)
    }

    /// `forward`, then k and v encoded into their slots of a TurboQuant cache as `TqWrite` does:
    /// returns q, and for a cache with a float window (which reads them) k and v too. On CUDA
    /// one launch, bit-identical to `forward` and the two writes (`IRIS_CUDA_FUSED_KV_WRITE=0`:
    /// three launches, to compare).
    pub fn forward_into_tq_cache(
        &self,
        y: &Tensor,
        c: &TqLayerCache,
        meta: &AttentionMeta,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        #[cfg(feature = "cuda")]
        if Self::fused_write() && y.device().is_cuda() && meta.device.is_some() && c.device.is_some() {
            let t = y.dim(0)?;
            let op = IntoCache { rope: self, dst: CacheDst::TurboQuant(c), meta };
            let out = y.apply_op1_no_bwd(&op)?;
            if c.window.is_none() {
                return Ok((out.reshape((t, self.num_heads, self.head_dim))?, None));
            }
            let (q, k, v) = self.split(&out, t)?;
            return Ok((q, Some((k, v))));
        }
        let (q, k, v) = self.forward(y)?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let dm = meta.device.as_ref();
        c.k.inplace_op2(&k, &TqWrite::keys(c, &meta.slot_mapping, dm))?;
        c.v.inplace_op2(&v, &TqWrite::values(c, &meta.slot_mapping, dm))?;
        Ok((q, c.window.is_some().then_some((k, v))))
    }

    #[cfg(feature = "cuda")]
    fn fused_write() -> bool {
        crate::switches::switched_on!("IRIS_CUDA_FUSED_KV_WRITE")
    }

    fn width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    fn check(&self, l: &Layout) -> Result<(usize, usize)> {
        let (t, w) = l.shape().dims2()?;
        if w != self.width() || l.stride()[1] != 1 {
            candle_core::bail!("qkv-rope: expected [T, {}] rows with unit stride, got {:?}", self.width(), l.shape());
        }
        let half = self.head_dim / 2;
        if self.cos.elem_count() != t * half || self.sin.elem_count() != t * half {
            candle_core::bail!("qkv-rope: cos/sin must hold {t} x {half} values");
        }
        Ok((t, l.stride()[0]))
    }
}

/// The values of a small f32 tensor (bias, angles, norm weights) as a host vector.
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()
}

impl CustomOp1 for QkvRope<'_> {
    fn name(&self) -> &'static str {
        "qkv-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (t, stride) = self.check(l)?;
        let y = match s {
            CpuStorage::F32(d) => &d[l.start_offset()..],
            other => candle_core::bail!("qkv-rope: the CPU reference takes f32, got {:?}", other.dtype()),
        };
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let half = d / 2;
        let bias = self.bias.map(host_f32).transpose()?;
        let (cos, sin) = (host_f32(self.cos)?, host_f32(self.sin)?);
        let norms = match self.qk_norm {
            Some((qn, kn, eps)) => Some((host_f32(qn)?, host_f32(kn)?, eps)),
            None => None,
        };
        let mut out = vec![0f32; t * self.width()];
        let mut x = vec![0f32; d];
        for r in 0..t {
            for h in 0..hq + 2 * hkv {
                for (e, v) in x.iter_mut().enumerate() {
                    *v = y[r * stride + h * d + e] + bias.as_ref().map_or(0.0, |b| b[h * d + e]);
                }
                let dst = if h < hq {
                    (r * hq + h) * d
                } else if h < hq + hkv {
                    t * hq * d + (r * hkv + h - hq) * d
                } else {
                    out[t * (hq + hkv) * d + (r * hkv + h - hq - hkv) * d..][..d].copy_from_slice(&x);
                    continue;
                };
                if let Some((qn, kn, eps)) = &norms {
                    let w = if h < hq { qn } else { kn };
                    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / d as f32 + eps).sqrt();
                    x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * inv * w);
                }
                let (c, s) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
                let o = &mut out[dst..dst + d];
                for i in 0..half {
                    let (a, b) = if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
                    o[a] = x[a] * c[i] - x[b] * s[i];
                    o[b] = x[a] * s[i] + x[b] * c[i];
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from(t * self.width())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.launch_cuda(s, l, None)
    }
}

/// `QkvRope::forward_into_cache` and `forward_into_tq_cache` on CUDA: the kernel given the
/// cache and the step's slots.
#[cfg(feature = "cuda")]
struct IntoCache<'a> {
    rope: &'a QkvRope<'a>,
    dst: CacheDst<'a>,
    meta: &'a AttentionMeta,
}

/// Where the fused kernel puts k and v.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
enum CacheDst<'a> {
    /// Dense `[slots, kv_heads, head_dim]` key and value caches of y's type.
    Dense(&'a Tensor, &'a Tensor),
    TurboQuant(&'a TqLayerCache),
}

#[cfg(feature = "cuda")]
impl CustomOp1 for IntoCache<'_> {
    fn name(&self) -> &'static str {
        "qkv-rope-into-cache"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("qkv-rope-into-cache: CUDA only (QkvRope::forward_into_cache goes op by op elsewhere)")
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.rope.launch_cuda(s, l, Some((self.dst, self.meta)))
    }
}

impl QkvRope<'_> {
    /// Launches the kernel on y; with a cache, it writes k and v there and returns q only (q, k
    /// and v for a TurboQuant cache with a float window).
    #[cfg(feature = "cuda")]
    fn launch_cuda(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        cache: Option<(CacheDst, &AttentionMeta)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
        use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S};
        use candle_core::Storage;

        use super::cuda::{dtype_name, QKV_ROPE};

        let (t, stride) = self.check(l)?;
        let d = self.head_dim;
        if !super::cuda::HEAD_DIMS.contains(&d) {
            candle_core::bail!("qkv-rope: no CUDA kernel for head_dim {d}");
        }
        let dev = s.device().clone();
        let tq = matches!(cache, Some((CacheDst::TurboQuant(_), _)));
        let func =
            QKV_ROPE.func(&dev, &format!("qkv_rope_{}_{d}{}", dtype_name(s.dtype())?, if tq { "_tq" } else { "" }))?;
        let heads = self.num_heads + 2 * self.num_kv_heads;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, heads.div_ceil(4) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };

        // The small inputs, as device slices of y's type (None: a null pointer).
        struct Guards<'g>(Vec<(candle_core::StorageRef<'g>, &'g Layout)>);
        let mut small = vec![Some(self.cos), Some(self.sin), self.bias];
        small.extend(match self.qk_norm {
            Some((q, k, _)) => [Some(q), Some(k)],
            None => [None, None],
        });
        let guards = Guards(small.iter().flatten().map(|t| t.storage_and_layout()).collect());
        for (st, l) in &guards.0 {
            if !l.is_contiguous() || st.dtype() != s.dtype() || !matches!(&**st, Storage::Cuda(_)) {
                candle_core::bail!("qkv-rope: bias, angles and norms must be contiguous {:?} on the GPU", s.dtype());
            }
        }

        // The cache: two whole [slots, kv_heads, row] tensors (row: head_dim values of y's type,
        // or a TurboQuant row of codes and norm), the step's slots (the first rows of its device
        // metadata), and for TurboQuant the codecs' device tables, each checked.
        let hkv = self.num_kv_heads;
        let cache_guards = match cache {
            Some((dst, meta)) => {
                let (kc, vc, rows) = match dst {
                    CacheDst::Dense(kc, vc) => (kc, vc, [d; 2]),
                    CacheDst::TurboQuant(c) => (&c.k, &c.v, [c.codecs.key.row_bytes(), c.codecs.value.row_bytes()]),
                };
                let want = if tq { candle_core::DType::U8 } else { s.dtype() };
                let (ks, kl) = kc.storage_and_layout();
                let (vs, vl) = vc.storage_and_layout();
                for ((st, cl), row) in [(&ks, kl), (&vs, vl)].into_iter().zip(rows) {
                    let dims = cl.dims();
                    if dims.len() != 3
                        || dims[1] * dims[2] != hkv * row
                        || dims[0] != kl.dims()[0]
                        || !cl.is_contiguous()
                        || cl.start_offset() != 0
                        || st.dtype() != want
                    {
                        candle_core::bail!("qkv-rope: the cache must be whole [slots, {hkv}, {row}] {want:?} tensors");
                    }
                }
                if meta.slot_mapping.len() != t {
                    candle_core::bail!("qkv-rope: {} slots for {t} rows", meta.slot_mapping.len());
                }
                super::kv_write::check_slot_range("qkv-rope", &meta.slot_mapping, kl.dims()[0])?;
                let dm = meta.device.as_ref().ok_or_else(|| {
                    candle_core::Error::Msg("qkv-rope: the step's metadata is not on the device".into())
                })?;
                let (ms, ml) = dm.data.storage_and_layout();
                if !ml.is_contiguous() || ml.start_offset() != 0 {
                    candle_core::bail!("qkv-rope: step metadata must be a whole contiguous tensor");
                }
                let codecs = match dst {
                    CacheDst::Dense(..) => None,
                    CacheDst::TurboQuant(c) => Some(TqArgs::check(c, d, hkv)?),
                };
                Some((ks, vs, ms, codecs))
            }
            None => None,
        };

        #[allow(clippy::too_many_arguments)]
        fn launch<T: CudaDType + DeviceRepr>(
            op: &QkvRope,
            func: &super::cuda::Kernel,
            cfg: LaunchConfig,
            dev: &candle_core::cuda_backend::CudaDevice,
            y: &CudaSlice<T>,
            (off, t, stride, out_len): (usize, usize, usize, usize),
            small: &[Option<&Tensor>],
            guards: &[(candle_core::StorageRef, &Layout)],
            cache: Option<(&Storage, &Storage, &Storage, Option<&TqArgs>)>,
        ) -> Result<CudaStorage> {
            use super::cuda::cuda_slice;
            let mut ptrs = Vec::new();
            let mut g = guards.iter();
            for present in small {
                ptrs.push(match present {
                    Some(_) => {
                        let (st, l) = g.next().expect("one guard per present tensor");
                        let Storage::Cuda(c) = &**st else { unreachable!("checked above") };
                        Some(c.as_cuda_slice::<T>()?.slice(l.start_offset()..))
                    }
                    None => None,
                });
            }
            // SAFETY: the kernel writes every element.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(out_len)? };
            let y = y.slice(off..);
            let ints = [stride as i32, t as i32, op.num_heads as i32, op.num_kv_heads as i32, op.interleaved as i32];
            let eps = op.qk_norm.map_or(0.0, |n| n.2);
            // Views the launch borrows, set below.
            let slots;
            let tq_tabs;
            let mut b = func.dependent();
            b.mem(&out).mem(&y).scalar(&ints[0]);
            // Order of the kernel's pointer arguments: bias, cos, sin, q norm, k norm.
            for i in [2, 0, 1, 3, 4] {
                match &ptrs[i] {
                    Some(p) => b.mem(p),
                    None => b.null(),
                };
            }
            b.scalar(&eps).scalar(&ints[1]).scalar(&ints[2]).scalar(&ints[3]).scalar(&ints[4]);
            match cache {
                Some((ks, vs, ms, None)) => {
                    slots = cuda_slice::<u32>(ms, "the step's metadata")?.slice(0..t);
                    b.mem(cuda_slice::<T>(ks, "the key cache")?).mem(cuda_slice::<T>(vs, "the value cache")?);
                    b.mem(&slots);
                }
                Some((ks, vs, ms, Some(tq))) => {
                    slots = cuda_slice::<u32>(ms, "the step's metadata")?.slice(0..t);
                    b.mem(cuda_slice::<u8>(ks, "the key codes")?).mem(cuda_slice::<u8>(vs, "the value codes")?);
                    b.mem(&slots);
                    tq_tabs = tq.slices()?;
                    b.mem(tq_tabs.0).mem(tq_tabs.1);
                    match tq_tabs.2 {
                        Some(s) => b.mem(s),
                        None => b.null(),
                    };
                    for i in &tq.ints {
                        b.scalar(i);
                    }
                }
                None => {
                    b.null().null().null();
                }
            }
            // SAFETY: argument types and counts match the kernel's signature (qkv_rope_*, or
            // qkv_rope_*_tq for a TurboQuant cache); shapes, slots and codec tables were
            // checked; the kernel reads only the codec tables and key scales (written at
            // start-up) before it waits (pdl_wait), everything else after.
            unsafe { b.launch(cfg) }?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let cache = cache_guards.as_ref().map(|(k, v, m, c)| (&**k, &**v, &**m, c.as_ref()));
        // q alone when k and v go to a cache, unless a float window also reads them.
        let len = if cache.is_some_and(|c| !c.3.is_some_and(|tq| tq.keeps())) {
            t * self.num_heads * d
        } else {
            t * self.width()
        };
        let args = (l.start_offset(), t, stride, len);
        let out = match &s.slice {
            S::F32(y) => launch(self, &func, cfg, &dev, y, args, &small, &guards.0, cache)?,
            S::BF16(y) => launch(self, &func, cfg, &dev, y, args, &small, &guards.0, cache)?,
            S::F16(y) => launch(self, &func, cfg, &dev, y, args, &small, &guards.0, cache)?,
            _ => candle_core::bail!("qkv-rope: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, Shape::from(len)))
    }
}

#[cfg(feature = "cuda")]
type F32Slice = candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>;

/// A TurboQuant cache's codec tables on the device, checked against the codecs, and the
/// kernel's integer arguments.
#[cfg(feature = "cuda")]
struct TqArgs<'a> {
    key: candle_core::StorageRef<'a>,
    value: candle_core::StorageRef<'a>,
    scale: Option<candle_core::StorageRef<'a>>,
    /// Key bits, value bits, whether each rotation is dense, whether k and v are also returned.
    ints: [i32; 5],
}

#[cfg(feature = "cuda")]
impl<'a> TqArgs<'a> {
    fn check(c: &'a TqLayerCache, d: usize, hkv: usize) -> Result<Self> {
        let dc = c
            .device
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("qkv-rope: the TurboQuant codecs are not on the device".into()))?;
        let (kcodec, vcodec) = (&c.codecs.key, &c.codecs.value);
        for (codec, table) in [(kcodec, &dc.key), (vcodec, &dc.value)] {
            if codec.dim() != d {
                candle_core::bail!("qkv-rope: {}-dim codes for {d}-dim heads", codec.dim());
            }
            super::cuda::check_tq_codec("qkv-rope", codec, table.elem_count())?;
        }
        if dc.key_scale.is_some() != c.codecs.key_scale.is_some()
            || dc.key_scale.as_ref().is_some_and(|s| s.elem_count() != hkv * d)
        {
            candle_core::bail!("qkv-rope: device key scales disagree with the codecs");
        }
        for t in [Some(&dc.key), Some(&dc.value), dc.key_scale.as_ref()].into_iter().flatten() {
            if t.dtype() != candle_core::DType::F32 || !t.is_contiguous() || t.layout().start_offset() != 0 {
                candle_core::bail!("qkv-rope: device codec tables must be contiguous f32");
            }
        }
        Ok(TqArgs {
            key: dc.key.storage_and_layout().0,
            value: dc.value.storage_and_layout().0,
            scale: dc.key_scale.as_ref().map(|s| s.storage_and_layout().0),
            ints: [
                kcodec.bits() as i32,
                vcodec.bits() as i32,
                kcodec.rotation().is_dense() as i32,
                vcodec.rotation().is_dense() as i32,
                c.window.is_some() as i32,
            ],
        })
    }

    /// Whether the kernel also returns k and v (a float window reads them).
    fn keeps(&self) -> bool {
        self.ints[4] != 0
    }

    /// The key table, the value table, the key scales.
    #[allow(clippy::type_complexity)]
    fn slices(&self) -> Result<(&F32Slice, &F32Slice, Option<&F32Slice>)> {
        use super::cuda::cuda_slice;
        Ok((
            cuda_slice::<f32>(&self.key, "the key codec")?,
            cuda_slice::<f32>(&self.value, "the value codec")?,
            self.scale.as_ref().map(|s| cuda_slice::<f32>(s, "the key scales")).transpose()?,
        ))
    }
}
