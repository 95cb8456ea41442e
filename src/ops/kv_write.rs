//! Writes a step's new keys or values into their cache slots.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp2, Layout, Result};

use super::kv_elem::{f32_slice, KvElem};

/// A slot that means "do not store this row".
pub const SKIP_SLOT: u32 = u32::MAX;

/// `cache[slot_mapping[t]] = new[t]` for every row t whose slot is not `SKIP_SLOT`. The cache
/// is `[slots, kv_heads, head_dim]`, `new` is `[T, kv_heads, head_dim]` f32.
pub struct KvWrite<'a> {
    pub slot_mapping: &'a [u32],
}

impl InplaceOp2 for KvWrite<'_> {
    fn name(&self) -> &'static str {
        "kv-write"
    }

    fn cpu_fwd(&self, cache: &mut CpuStorage, cache_l: &Layout, new: &CpuStorage, new_l: &Layout) -> Result<()> {
        let new = f32_slice(new, new_l, "kv-write new")?;
        let dims = cache_l.dims();
        if dims.len() != 3 || !cache_l.is_contiguous() || cache_l.start_offset() != 0 {
            candle_core::bail!("kv-write: cache must be a whole contiguous [slots, heads, dim] tensor");
        }
        let (slots, row) = (dims[0], dims[1] * dims[2]);
        if new.len() != self.slot_mapping.len() * row {
            candle_core::bail!("kv-write: {} values for {} slots of {row}", new.len(), self.slot_mapping.len());
        }
        fn write<T: KvElem>(cache: &mut [T], new: &[f32], slots: &[u32], n_slots: usize, row: usize) -> Result<()> {
            for (t, &slot) in slots.iter().enumerate() {
                if slot == SKIP_SLOT {
                    continue;
                }
                let slot = slot as usize;
                if slot >= n_slots {
                    candle_core::bail!("kv-write: slot {slot} out of range ({n_slots} slots)");
                }
                let dst = &mut cache[slot * row..(slot + 1) * row];
                for (d, s) in dst.iter_mut().zip(&new[t * row..(t + 1) * row]) {
                    *d = T::from_f32(*s);
                }
            }
            Ok(())
        }
        match cache {
            CpuStorage::F32(c) => write(c, new, self.slot_mapping, slots, row),
            CpuStorage::BF16(c) => write(c, new, self.slot_mapping, slots, row),
            CpuStorage::F16(c) => write(c, new, self.slot_mapping, slots, row),
            other => candle_core::bail!("kv-write: unsupported cache dtype {:?}", other.dtype()),
        }
    }
}
