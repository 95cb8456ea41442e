//! Pieces shared by the ViT towers of Qwen2-VL, GLM-4.xV and Gemma 4: where each patch sits in
//! its image, the 2-D rotary embedding of that place, and bidirectional attention within groups
//! of patches (an image, or a window of one).

use candle_core::{DType, Device, Result, Tensor};

use super::rotary::RotaryAngles;
use crate::config::RopeLayout;

/// Bound on one attention score block (heads x query rows x keys), in values: 16 MB of f32,
/// small enough for the allocator to reuse one block's memory for the next (at 2^26 every
/// block was a fresh mapping, and the kernel's page faults took a third of the time of a
/// Qwen2-VL-2B-shaped tower at 672x672).
const MAX_SCORES: usize = 1 << 22;

/// Contiguous runs of rows `(start, len)` that attend to each other.
pub type Segments = Vec<(usize, usize)>;

/// Checks that `px` is a whole number of merge blocks of `patch_dim`-value patches, as a tower
/// with this patch size and merge takes them.
pub fn check_patches(px: &crate::media::PixelValues, patch_dim: usize, merge: usize) -> Result<()> {
    let [t, gh, gw] = px.grid_thw;
    if px.cols != patch_dim || px.rows != t * gh * gw || gh % merge != 0 || gw % merge != 0 || px.rows == 0 {
        candle_core::bail!(
            "pixel values [{}, {}] with grid {:?} do not fit this vision tower (patch dim {patch_dim}, merge {merge})",
            px.rows,
            px.cols,
            px.grid_thw
        );
    }
    Ok(())
}

/// The (row, column) in the patch grid of processor row `r`. The processors emit rows merge
/// block by merge block (block row, block column, row in block, column in block), frame after
/// frame.
pub fn patch_position(r: usize, [_, gh, gw]: [usize; 3], merge: usize) -> (usize, usize) {
    let r = r % (gh * gw);
    let (block, within) = (r / (merge * merge), r % (merge * merge));
    let blocks_per_row = gw / merge;
    ((block / blocks_per_row) * merge + within / merge, (block % blocks_per_row) * merge + within % merge)
}

/// 2-D rotary embedding: the first half of each head's frequencies follows the patch row, the
/// second half its column (`rotate_half` layout over the whole head).
#[derive(Debug, Clone)]
pub struct PatchRotary {
    /// Frequencies of one axis: a quarter of the head's dimensions.
    inv_freq: Vec<f32>,
}

impl PatchRotary {
    pub fn new(head_dim: usize, theta: f64) -> Self {
        let spatial = head_dim / 2;
        let theta = theta as f32;
        PatchRotary { inv_freq: (0..spatial / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / spatial as f32)).collect() }
    }

    /// Angles for patches at `positions` (row, column).
    pub fn angles(&self, positions: &[(usize, usize)], device: &Device, dtype: DType) -> Result<RotaryAngles> {
        let mut angles = Vec::with_capacity(positions.len() * 2 * self.inv_freq.len());
        for &(h, w) in positions {
            angles.extend(self.inv_freq.iter().map(|&f| h as f32 * f));
            angles.extend(self.inv_freq.iter().map(|&f| w as f32 * f));
        }
        RotaryAngles::from_angles(&angles, positions.len(), RopeLayout::Half, device, dtype)
    }

    /// Gemma 4's axial layout of the same frequencies: the first half of each head turns by
    /// each place's first coordinate, the second half by its second, each half in
    /// `rotate_half` pairs of its own.
    pub fn split_angles(&self, places: &[(usize, usize)], device: &Device, dtype: DType) -> Result<SplitAngles> {
        let axis = |pick: fn(&(usize, usize)) -> usize| {
            let angles: Vec<f32> =
                places.iter().flat_map(|p| self.inv_freq.iter().map(move |&f| pick(p) as f32 * f)).collect();
            RotaryAngles::from_angles(&angles, places.len(), RopeLayout::Half, device, dtype)
        };
        Ok(SplitAngles { first: axis(|p| p.0)?, second: axis(|p| p.1)? })
    }
}

/// Rotations of the two halves of each head (`PatchRotary::split_angles`).
pub struct SplitAngles {
    first: RotaryAngles,
    second: RotaryAngles,
}

impl SplitAngles {
    /// Rotates `[n, heads, head_dim]`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let half = x.dim(2)? / 2;
        let a = self.first.apply(&x.narrow(2, 0, half)?.contiguous()?)?;
        let b = self.second.apply(&x.narrow(2, half, half)?.contiguous()?)?;
        Tensor::cat(&[a, b], 2)
    }
}

/// Softmax attention of rows `qkv` (`[n, 3 * heads * head_dim]`, q then k then v) within each
/// segment, after rotating q and k; returns `[n, heads * head_dim]`.
pub fn segment_attention(
    qkv: &Tensor,
    heads: usize,
    head_dim: usize,
    rot: &RotaryAngles,
    segs: &[(usize, usize)],
) -> Result<Tensor> {
    let n = qkv.dim(0)?;
    let qkv = qkv.reshape((n, 3, heads, head_dim))?;
    // The 1/sqrt(d) scale goes on the queries: n x d values rather than every score.
    let q = (rot.apply(&qkv.narrow(1, 0, 1)?.squeeze(1)?)? * (head_dim as f64).powf(-0.5))?;
    let k = rot.apply(&qkv.narrow(1, 1, 1)?.squeeze(1)?)?;
    let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
    attention_within(&q, &k, &v, segs)
}

/// softmax(q k^T) v within each segment for `[n, heads, head_dim]` inputs (q carries the
/// scale) -> `[n, heads * head_dim]`.
pub fn attention_within(q: &Tensor, k: &Tensor, v: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
    let n = q.dim(0)?;
    let out = attend(q, k, v, segs, MAX_SCORES)?;
    if out.dim(0)? != n {
        candle_core::bail!("attention segments cover {} of {n} rows", out.dim(0)?);
    }
    Ok(out)
}

/// softmax(q k^T) v within each segment for `[n, heads, head_dim]` inputs (q already scaled),
/// query rows in blocks of at most `max_scores` scores -> `[rows covered, heads * head_dim]`.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, segs: &[(usize, usize)], max_scores: usize) -> Result<Tensor> {
    let (_, heads, head_dim) = q.dims3()?;
    let dtype = q.dtype();
    let mut outs = Vec::with_capacity(segs.len());
    for &(start, len) in segs {
        let heads_first = |t: &Tensor| t.narrow(0, start, len)?.transpose(0, 1)?.contiguous();
        let (qs, ks, vs) = (heads_first(q)?, heads_first(k)?, heads_first(v)?);
        let kt = ks.t()?;
        let block = (max_scores / (heads * len)).max(1);
        let mut start_q = 0;
        while start_q < len {
            let nq = block.min(len - start_q);
            let scores = qs.narrow(1, start_q, nq)?.matmul(&kt)?;
            let p = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
            outs.push(p.matmul(&vs)?.transpose(0, 1)?.reshape((nq, heads * head_dim))?);
            start_q += nq;
        }
    }
    Tensor::cat(&outs, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_run_over_merge_blocks() {
        // A 4x6 grid in 2x2 blocks: row 5 is block 1's second patch, at (0, 3).
        let grid = [1, 4, 6];
        assert_eq!(patch_position(0, grid, 2), (0, 0));
        assert_eq!(patch_position(3, grid, 2), (1, 1));
        assert_eq!(patch_position(5, grid, 2), (0, 3));
        assert_eq!(patch_position(12, grid, 2), (2, 0));
        // the next frame starts over
        assert_eq!(patch_position(24 + 5, [2, 4, 6], 2), (0, 3));
    }

    #[test]
    fn query_blocks_do_not_change_attention() {
        let dev = Device::Cpu;
        let (n, heads, hd) = (37, 3, 8);
        let r = |seed: u64| {
            let data: Vec<f32> = (0..n * heads * hd)
                .map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            Tensor::from_vec(data, (n, heads, hd), &dev).unwrap()
        };
        let (q, k, v) = (r(1), r(2), r(3));
        let segs = [(0, 20), (20, 17)];
        let whole = attend(&q, &k, &v, &segs, usize::MAX / 2).unwrap();
        // 120 scores: blocks of 2 query rows (3 heads x 20 or 17 keys each).
        let blocked = attend(&q, &k, &v, &segs, 120).unwrap();
        assert_eq!(whole.dims(), &[n, heads * hd]);
        let diff = (&whole - &blocked).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "{diff}");
        // Segments do not see each other: changing a key in the second leaves the first alone.
        let ones = Tensor::ones((1, heads, hd), DType::F32, &dev).unwrap();
        let k2 = k.slice_assign(&[36..37, 0..heads, 0..hd], &ones).unwrap();
        let other = attend(&q, &k2, &v, &segs, 120).unwrap();
        let first = |t: &Tensor| t.narrow(0, 0, 20).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(first(&blocked), first(&other));
        assert_ne!(blocked.to_vec2::<f32>().unwrap()[30], other.to_vec2::<f32>().unwrap()[30]);
    }
}
