//! Writes a step's new keys or values into their cache slots.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp2, Layout, Result};

use super::kv_elem::{f32_slice, KvElem};
use crate::batch::{AttentionMeta, DeviceAttentionMeta, NO_SLOT};

/// `cache[slot_mapping[t]] = new[t]` for every row t whose slot is not `NO_SLOT`. The cache
/// is `[slots, kv_heads, head_dim]`, `new` is `[T, kv_heads, head_dim]`: f32 on the CPU; f32
/// or the cache's type on CUDA.
pub struct KvWrite<'a> {
    pub slot_mapping: &'a [u32],
    /// On CUDA: the step's metadata on the device, holding `slot_mapping` from `device_at`.
    pub device_meta: Option<&'a DeviceAttentionMeta>,
    pub device_at: usize,
}

impl<'a> KvWrite<'a> {
    /// Writes a step's rows to the slots its metadata assigns.
    pub fn step(meta: &'a AttentionMeta) -> Self {
        KvWrite { slot_mapping: &meta.slot_mapping, device_meta: meta.device.as_ref(), device_at: 0 }
    }

    /// Writes the rows that stay in a float window of `len` positions to their sequences'
    /// rings (`AttentionMeta::set_float_window`).
    pub fn to_ring(meta: &'a AttentionMeta, len: usize) -> Result<Self> {
        match &meta.window {
            Some(w) if w.len == len => Ok(KvWrite {
                slot_mapping: &w.slots,
                device_meta: meta.device.as_ref(),
                device_at: meta.device.as_ref().map_or(0, |d| d.layout.ring_slots),
            }),
            _ => {
                candle_core::bail!("kv-write: a float window of {len} positions needs its rings in the step's metadata")
            }
        }
    }

    /// Writes rows to slots given on the host, and for a GPU cache the same slots in device
    /// memory (`DeviceAttentionMeta::slots`).
    pub fn to_slots(slot_mapping: &'a [u32], device_meta: Option<&'a DeviceAttentionMeta>) -> Self {
        KvWrite { slot_mapping, device_meta, device_at: 0 }
    }

    /// Checks the shapes and every slot; returns (slots in the cache, values per slot).
    fn check(&self, cache_l: &Layout, new_len: usize) -> Result<(usize, usize)> {
        let dims = cache_l.dims();
        if dims.len() != 3 || !cache_l.is_contiguous() || cache_l.start_offset() != 0 {
            candle_core::bail!("kv-write: cache must be a whole contiguous [slots, heads, dim] tensor");
        }
        let (slots, row) = (dims[0], dims[1] * dims[2]);
        let mapping = self.slot_mapping;
        if new_len != mapping.len() * row {
            candle_core::bail!("kv-write: {new_len} values for {} slots of {row}", mapping.len());
        }
        check_slot_range("kv-write", mapping, slots)?;
        Ok((slots, row))
    }
}

/// Every slot of a step's `mapping` lies in a cache of `slots` slots, or is `NO_SLOT` (a row
/// that writes nothing). Shared by the cache writers.
pub(crate) fn check_slot_range(op: &str, mapping: &[u32], slots: usize) -> Result<()> {
    match mapping.iter().find(|&&s| s as usize >= slots && s != NO_SLOT) {
        Some(&slot) => candle_core::bail!("{op}: slot {slot} out of range ({slots} slots)"),
        None => Ok(()),
    }
}

impl InplaceOp2 for KvWrite<'_> {
    fn name(&self) -> &'static str {
        "kv-write"
    }

    fn cpu_fwd(&self, cache: &mut CpuStorage, cache_l: &Layout, new: &CpuStorage, new_l: &Layout) -> Result<()> {
        let new = f32_slice(new, new_l, "kv-write new")?;
        let (_, row) = self.check(cache_l, new.len())?;
        fn write<T: KvElem>(cache: &mut [T], new: &[f32], slots: &[u32], row: usize) {
            for (t, &slot) in slots.iter().enumerate().filter(|(_, &s)| s != NO_SLOT) {
                let slot = slot as usize;
                let dst = &mut cache[slot * row..(slot + 1) * row];
                for (d, s) in dst.iter_mut().zip(&new[t * row..(t + 1) * row]) {
                    *d = T::from_f32(*s);
                }
            }
        }
        let slots = self.slot_mapping;
        match cache {
            CpuStorage::F32(c) => write(c, new, slots, row),
            CpuStorage::BF16(c) => write(c, new, slots, row),
            CpuStorage::F16(c) => write(c, new, slots, row),
            other => candle_core::bail!("kv-write: unsupported cache dtype {:?}", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cache_l: &Layout,
        new: &candle_core::CudaStorage,
        new_l: &Layout,
    ) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};

        use super::cuda::{dtype_name, with_u32_slice, KV_WRITE};

        let (_, row) = self.check(cache_l, new_l.shape().elem_count())?;
        let rows = self.slot_mapping.len();
        if rows == 0 {
            return Ok(());
        }
        let Some((a, b)) = new_l.contiguous_offsets() else {
            candle_core::bail!("kv-write: new values must be contiguous")
        };
        let dm = self.device_meta.ok_or_else(|| {
            candle_core::Error::Msg("kv-write: the step's metadata is not on the device (AttentionMeta::upload)".into())
        })?;
        let dev = cache.device().clone();
        let name = format!("kv_write_{}_{}", dtype_name(new.dtype())?, dtype_name(cache.dtype())?);
        let func = KV_WRITE.func(&dev, &name)?;
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (row.min(256) as u32, 1, 1), shared_mem_bytes: 0 };
        let row = row as i32;
        fn launch<C, N>(
            func: &super::cuda::Kernel,
            cfg: LaunchConfig,
            cache: &mut CudaSlice<C>,
            new: &CudaSlice<N>,
            (a, b): (usize, usize),
            slots: &CudaView<u32>,
            row: i32,
        ) -> Result<()> {
            let new = new.slice(a..b);
            let mut builder = func.builder();
            builder.arg(cache).arg(&new).arg(slots).arg(&row);
            // SAFETY: argument types and counts match the kernel's signature; every slot was checked.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(())
        }
        with_u32_slice(&dm.data, |meta| {
            let at = self.device_at;
            let slots = meta.slice(at..at + rows);
            match (&mut cache.slice, &new.slice) {
                (S::F32(c), S::F32(n)) => launch(&func, cfg, c, n, (a, b), &slots, row),
                (S::BF16(c), S::F32(n)) => launch(&func, cfg, c, n, (a, b), &slots, row),
                (S::F16(c), S::F32(n)) => launch(&func, cfg, c, n, (a, b), &slots, row),
                (S::BF16(c), S::BF16(n)) => launch(&func, cfg, c, n, (a, b), &slots, row),
                (S::F16(c), S::F16(n)) => launch(&func, cfg, c, n, (a, b), &slots, row),
                _ => candle_core::bail!("kv-write: {name} is not supported"),
            }
        })
    }
}
