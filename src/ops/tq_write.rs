//! Quantizes a step's new keys or values into their TurboQuant cache slots.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};

use super::kv_elem::f32_slice;
use super::kv_write::check_slot_range;
use super::team::{team, OutPtr};
use super::turboquant::{TqCodec, TqLayerCache};
use crate::batch::{DeviceAttentionMeta, NO_SLOT};

/// `cache[slot_mapping[t]] = encode(new[t] * scale)` for every row t and head. The cache is
/// `[slots, kv_heads, codec.row_bytes()]` u8, `new` is `[T, kv_heads, head_dim]` (f32 on the
/// CPU; f32, bf16 or f16 on CUDA), `scale` (if any) `[kv_heads * head_dim]`. On CUDA, rows
/// whose slot is `NO_SLOT` are skipped (decode graphs' padding rows).
pub struct TqWrite<'a> {
    pub slot_mapping: &'a [u32],
    pub codec: &'a TqCodec,
    pub scale: Option<&'a [f32]>,
    /// For a cache on a GPU: the slots, codec and scales in device memory.
    pub device: Option<TqWriteDevice<'a>>,
}

pub struct TqWriteDevice<'a> {
    /// Its first rows are `slot_mapping`.
    pub meta: &'a DeviceAttentionMeta,
    /// `codec.device_table()`.
    pub table: &'a Tensor,
    pub scale: Option<&'a Tensor>,
}

impl<'a> TqWrite<'a> {
    /// A layer's keys into `slot_mapping` (`device_meta`: the same slots on the device, for a
    /// cache there).
    pub fn keys(c: &'a TqLayerCache, slot_mapping: &'a [u32], device_meta: Option<&'a DeviceAttentionMeta>) -> Self {
        let device = c.device.as_ref().zip(device_meta).map(|(d, meta)| TqWriteDevice {
            meta,
            table: &d.key,
            scale: d.key_scale.as_ref(),
        });
        TqWrite { slot_mapping, codec: &c.codecs.key, scale: c.codecs.key_scale.as_deref(), device }
    }

    /// A layer's values, as `keys`.
    pub fn values(c: &'a TqLayerCache, slot_mapping: &'a [u32], device_meta: Option<&'a DeviceAttentionMeta>) -> Self {
        let device =
            c.device.as_ref().zip(device_meta).map(|(d, meta)| TqWriteDevice { meta, table: &d.value, scale: None });
        TqWrite { slot_mapping, codec: &c.codecs.value, scale: None, device }
    }

    /// Checks the cache's shape; returns its (slots, heads).
    fn check(&self, cache_l: &Layout, new_len: usize) -> Result<(usize, usize)> {
        let dims = cache_l.dims();
        let (d, row) = (self.codec.dim(), self.codec.row_bytes());
        if dims.len() != 3 || !cache_l.is_contiguous() || cache_l.start_offset() != 0 || dims[2] != row {
            candle_core::bail!("tq-write: the cache must be a whole contiguous [slots, heads, {row}] tensor");
        }
        let (n_slots, heads) = (dims[0], dims[1]);
        let rows = self.slot_mapping.len();
        if new_len != rows * heads * d {
            candle_core::bail!("tq-write: {new_len} values for {rows} slots of {heads}x{d}");
        }
        if self.scale.is_some_and(|s| s.len() != heads * d) {
            candle_core::bail!("tq-write: scales for another shape than {heads}x{d}");
        }
        check_slot_range("tq-write", self.slot_mapping, n_slots)?;
        Ok((n_slots, heads))
    }
}

impl InplaceOp2 for TqWrite<'_> {
    fn name(&self) -> &'static str {
        "tq-write"
    }

    fn cpu_fwd(&self, cache: &mut CpuStorage, cache_l: &Layout, new: &CpuStorage, new_l: &Layout) -> Result<()> {
        let new = f32_slice(new, new_l, "tq-write new")?;
        let CpuStorage::U8(cache) = cache else {
            candle_core::bail!("tq-write: the cache must be u8 codes, got {:?}", cache.dtype());
        };
        // check(): every slot is in range or NO_SLOT (a row that writes nothing).
        let (_, heads) = self.check(cache_l, new.len())?;
        let (d, row) = (self.codec.dim(), self.codec.row_bytes());
        let rows = self.slot_mapping.len();
        // Rows are written in parallel: the slots they write must be distinct.
        let mut seen: Vec<u32> = self.slot_mapping.iter().copied().filter(|&s| s != NO_SLOT).collect();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            candle_core::bail!("tq-write: two rows of a step write the same slot");
        }
        let dst = OutPtr(cache.as_mut_ptr());
        team().for_each(rows, |t| {
            if self.slot_mapping[t] == NO_SLOT {
                return;
            }
            let slot = self.slot_mapping[t] as usize;
            // SAFETY: slot rows are distinct (checked above), so items write disjoint bytes.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.at(slot * heads * row), heads * row) };
            let (mut y, mut scaled) = (vec![0f32; d], vec![0f32; d]);
            for (h, dst_row) in out.chunks_exact_mut(row).enumerate() {
                let x = &new[(t * heads + h) * d..][..d];
                let x = match self.scale {
                    Some(s) => {
                        scaled.iter_mut().zip(x.iter().zip(&s[h * d..][..d])).for_each(|(o, (a, b))| *o = a * b);
                        &scaled
                    }
                    None => x,
                };
                self.codec.encode(x, dst_row, &mut y);
            }
        });
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
        use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig};
        use candle_core::cuda_backend::CudaStorageSlice as S;

        use super::cuda::{cuda_slice, dtype_name, with_u32_slice, TQ_WRITE};

        let (_, heads) = self.check(cache_l, new_l.shape().elem_count())?;
        let dev_in = self.device.as_ref().ok_or_else(|| {
            candle_core::Error::Msg("tq-write: the slots and codec are not on the device (TqWrite::device)".into())
        })?;
        let rows = self.slot_mapping.len();
        let (d, bits) = (self.codec.dim(), self.codec.bits());
        if rows == 0 {
            return Ok(());
        }
        if dev_in.scale.is_some() != self.scale.is_some() {
            candle_core::bail!("tq-write: key scales on the host and the device disagree");
        }
        let Some((a, b)) = new_l.contiguous_offsets() else {
            candle_core::bail!("tq-write: new values must be contiguous")
        };
        let table_g = dev_in.table.storage_and_layout().0;
        let table = cuda_slice::<f32>(&table_g, "tq-write codec table")?;
        let scale_g = dev_in.scale.map(|s| s.storage_and_layout().0);
        let scale = scale_g.as_ref().map(|g| cuda_slice::<f32>(g, "tq-write key scales")).transpose()?;
        super::cuda::check_tq_codec("tq-write", self.codec, table.len())?;
        if scale.is_some_and(|s| s.len() != heads * d) {
            candle_core::bail!("tq-write: device key scales of the wrong size");
        }
        let dev = cache.device().clone();
        let func = TQ_WRITE.func(&dev, &format!("tq_write_{}", dtype_name(new.dtype())?))?;
        // A warp per (row, head), TW_WARPS = 4 of them per block.
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, heads.div_ceil(4) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let ints = [heads as i32, d as i32, bits as i32, self.codec.rotation().is_dense() as i32];
        let S::U8(codes) = &mut cache.slice else { candle_core::bail!("tq-write: the cache must be u8 codes") };
        fn launch<N>(
            func: &super::cuda::Kernel,
            cfg: LaunchConfig,
            codes: &mut CudaSlice<u8>,
            (new, (a, b)): (&CudaSlice<N>, (usize, usize)),
            slots: &candle_core::cuda_backend::cudarc::driver::CudaView<u32>,
            (table, scale): (&CudaSlice<f32>, Option<&CudaSlice<f32>>),
            ints: [i32; 4],
        ) -> Result<()> {
            let new = new.slice(a..b);
            let mut b = func.dependent();
            b.mem(&*codes).mem(&new).mem(slots).mem(table);
            match scale {
                Some(s) => b.mem(s),
                None => b.null(),
            };
            for i in &ints {
                b.scalar(i);
            }
            // SAFETY: argument types and counts match the kernel's signature; every slot and
            // the tables' sizes were checked; the kernel waits (pdl_wait) before it reads or writes.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
        with_u32_slice(&dev_in.meta.data, |meta| {
            if meta.len() < rows {
                candle_core::bail!("tq-write: the device metadata holds fewer than {rows} slots");
            }
            let slots = meta.slice(0..rows);
            let tabs = (table, scale);
            match &new.slice {
                S::F32(n) => launch(&func, cfg, codes, (n, (a, b)), &slots, tabs, ints),
                S::BF16(n) => launch(&func, cfg, codes, (n, (a, b)), &slots, tabs, ints),
                S::F16(n) => launch(&func, cfg, codes, (n, (a, b)), &slots, tabs, ints),
                _ => candle_core::bail!("tq-write: {:?} values are not supported", new.dtype()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::ops::turboquant::{Codebook, LayerCodecs};

    /// Rows whose slot is NO_SLOT write nothing; two rows writing one slot, or a slot past the
    /// cache, are errors (rows are written in parallel).
    #[test]
    fn slots_are_checked_and_padding_rows_skipped() {
        let (d, heads, n_slots) = (64, 2, 4);
        let cb = Arc::new(Codebook::lloyd_max(d, 4));
        let codecs = LayerCodecs::for_layer(0, d, &cb, &cb);
        let codec = &codecs.key;
        let write = |slots: &[u32]| -> Result<Vec<u8>> {
            let cache = Tensor::zeros((n_slots, heads, codec.row_bytes()), DType::U8, &Device::Cpu)?;
            let new = Tensor::ones((slots.len(), heads, d), DType::F32, &Device::Cpu)?;
            cache.inplace_op2(&new, &TqWrite { slot_mapping: slots, codec, scale: None, device: None })?;
            cache.flatten_all()?.to_vec1::<u8>()
        };
        let row = heads * codec.row_bytes();
        let written = write(&[2, NO_SLOT]).unwrap();
        assert!(written[2 * row..3 * row].iter().any(|&b| b != 0), "slot 2 was not written");
        let untouched = |i: usize| written[i * row..(i + 1) * row].iter().all(|&b| b == 0);
        assert!([0, 1, 3].into_iter().all(untouched), "a padding row wrote a slot");
        let err = write(&[1, 1]).unwrap_err().to_string();
        assert!(err.contains("same slot"), "{err}");
        let err = write(&[0, 4]).unwrap_err().to_string();
        assert!(err.contains("slot 4 out of range"), "{err}");
    }
}
