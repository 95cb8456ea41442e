//! Quantizes a step's new keys or values into their TurboQuant cache slots.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp2, Layout, Result};

use super::kv_elem::f32_slice;
use super::team::{team, OutPtr};
use crate::kv::turboquant::TqCodec;

/// `cache[slot_mapping[t]] = encode(new[t] * scale)` for every row t and head. The cache is
/// `[slots, kv_heads, codec.row_bytes()]` u8, `new` is `[T, kv_heads, head_dim]` f32, `scale`
/// (if any) `[kv_heads * head_dim]`.
pub struct TqWrite<'a> {
    pub slot_mapping: &'a [u32],
    pub codec: &'a TqCodec,
    pub scale: Option<&'a [f32]>,
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
        let dims = cache_l.dims();
        let (d, row) = (self.codec.dim(), self.codec.row_bytes());
        if dims.len() != 3 || !cache_l.is_contiguous() || cache_l.start_offset() != 0 || dims[2] != row {
            candle_core::bail!("tq-write: the cache must be a whole contiguous [slots, heads, {row}] tensor");
        }
        let (n_slots, heads) = (dims[0], dims[1]);
        let rows = self.slot_mapping.len();
        if new.len() != rows * heads * d {
            candle_core::bail!("tq-write: {} values for {rows} slots of {heads}x{d}", new.len());
        }
        if self.scale.is_some_and(|s| s.len() != heads * d) {
            candle_core::bail!("tq-write: scales for another shape than {heads}x{d}");
        }
        // Rows are written in parallel: their slots must be distinct and in range.
        let mut seen = self.slot_mapping.to_vec();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) || seen.last().is_some_and(|&s| s as usize >= n_slots) {
            candle_core::bail!("tq-write: slots repeat or exceed the cache's {n_slots}");
        }
        let dst = OutPtr(cache.as_mut_ptr());
        team().for_each(rows, |t| {
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
}
