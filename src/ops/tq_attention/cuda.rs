//! The CUDA side of attention on TurboQuant codes: checks, device buffers and the launches of
//! `cuda/tq_attention.cu` (partial scores over position splits, then the combine).

use candle_core::backend::BackendStorage;
use candle_core::{Layout, Result, Shape, Storage, Tensor};

use super::op::TqAttention;

/// `TqAttention`'s forward pass on CUDA.
pub(super) fn forward(
    op: &TqAttention<'_>,
    q: &candle_core::CudaStorage,
    q_l: &Layout,
    k: &candle_core::CudaStorage,
    k_l: &Layout,
    v: &candle_core::CudaStorage,
    v_l: &Layout,
) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice as S};
    use candle_core::DType;

    use crate::batch::PREFILL_MIN_ROWS;
    use crate::ops::cuda::{
        cuda_slice, dtype_name, prefill_launch, with_u32_slice, PREFILL_ATTENTION, PREFILL_HEAD_DIMS, TQ_ATTENTION,
    };

    let a = &op.attn;
    let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
    let rows = a.meta.num_rows();
    let shape = Shape::from((rows, hq, d));
    for (l, row) in [(k_l, op.key.row_bytes()), (v_l, op.value.row_bytes())] {
        if l.dims().len() != 3
            || !l.is_contiguous()
            || l.start_offset() != 0
            || l.dims()[1] != hkv
            || l.dims()[2] != row
        {
            candle_core::bail!("tq-attention: caches must be whole contiguous [slots, {hkv}, row bytes] tensors");
        }
    }
    if k_l.dims()[0] != v_l.dims()[0] {
        candle_core::bail!("tq-attention: key and value caches differ in slots");
    }
    op.check(q_l.shape().elem_count(), k_l.dims()[0])?;
    let Some((qa, qb)) = q_l.contiguous_offsets() else { candle_core::bail!("tq-attention: q must be contiguous") };
    let dev = q.device().clone();
    if rows == 0 {
        // SAFETY: nothing is read from an empty allocation.
        let empty = unsafe { dev.alloc::<f32>(0)? };
        return Ok((CudaStorage::wrap_cuda_slice(empty, dev), shape));
    }
    let bits = [op.key.bits(), op.value.bits()];
    let codecs = op.device.ok_or_else(|| {
        candle_core::Error::Msg("tq-attention: the codecs are not on the device (TqLayerCache::device)".into())
    })?;
    if codecs.key_scale.is_some() != op.key_scale.is_some() {
        candle_core::bail!("tq-attention: key scales on the host and the device disagree");
    }
    let dm = a.meta.device.as_ref().ok_or_else(|| {
        candle_core::Error::Msg("tq-attention: the step's metadata is not on the device (AttentionMeta::upload)".into())
    })?;
    let l = dm.layout;
    if l.rows != rows {
        candle_core::bail!("tq-attention: device metadata has {} rows, the step {rows}", l.rows);
    }
    let group = hq / hkv;
    // Query heads per block: the largest divisor of the group the kernel holds (GQA: the
    // block copies the codes into shared memory once for all of them; one head per block
    // measured 0.88x / 0.76x / 0.65x of this at 1k / 8k / 32k tokens on an H200).
    let hb = (1..=group.min(8)).rev().find(|h| group % h == 0).unwrap_or(1);
    // A warp per query head, or 8 / hb of them (TL_WARPS in the kernels: at most 8 warps).
    let partial_threads = 32 * hb * (8 / hb).max(1);
    let blocks_y = hkv * group / hb;
    // Prompt chunks of 16-bit models go to the tensor-core kernel (prefill_attention.cu) when
    // their rings, if any, are in q's type too; the other rows to tq_attn_partial and
    // tq_attn_combine. Which kernel takes a row depends on its own sequence alone.
    let float_dtype = op.float.as_ref().map(|f| f.ring_k.dtype());
    let prefill = l.num_tiles > 0
        && !crate::device::batch_invariant()
        && q.dtype() != DType::F32
        && float_dtype.is_none_or(|t| t == q.dtype())
        && PREFILL_HEAD_DIMS.contains(&d);
    let skip = if prefill { PREFILL_MIN_ROWS } else { usize::MAX };
    // Splits of each of those rows' coded positions (a split covers >= min_chunk() positions).
    // Steps of few such rows (up to 64 blocks per split, e.g. 16 rows of a 7B model) always
    // take 64 (the most the kernels take over codes): a row's split points then depend on its own
    // context only, so its result does not depend on the rest of the batch (batch
    // invariance), and one long decode still fills the GPU. Larger steps take enough splits
    // to fill it (~130 multiprocessors, two blocks each).
    let untiled = a.meta.seqs.iter().filter(|s| s.q_len < skip);
    let decode_rows: usize = untiled.clone().map(|s| s.q_len).sum();
    // Those kernels run over the span of rows from the first such row to the last (the
    // scheduler puts running sequences, mostly decodes, first).
    let span = untiled.fold(None, |acc: Option<(usize, usize)>, s| {
        let (a, b) = (s.q_start, s.q_start + s.q_len);
        Some(acc.map_or((a, b), |(x, y)| (x.min(a), y.max(b))))
    });
    let (row0, span_rows) = span.map_or((0, 0), |(a, b)| (a, b - a));
    // Splits by the batch's decode rows fill the GPU; with `--batch-invariant` a row's splits
    // (and so its sum's order) must not depend on the other rows.
    let nsplit = match decode_rows * blocks_y {
        _ if crate::device::batch_invariant() => 64,
        0..=64 => 64,
        n => 264usize.div_ceil(n).clamp(1, 64),
    };

    fn guard(t: &Tensor) -> impl std::ops::Deref<Target = Storage> + '_ {
        t.storage_and_layout().0
    }
    let (ktab_g, vtab_g) = (guard(&codecs.key), guard(&codecs.value));
    let (ktab, vtab) =
        (cuda_slice::<f32>(&ktab_g, "key codec table")?, cuda_slice::<f32>(&vtab_g, "value codec table")?);
    crate::ops::cuda::check_tq_codec("tq-attention", op.key, ktab.len())?;
    crate::ops::cuda::check_tq_codec("tq-attention", op.value, vtab.len())?;
    let scale_g = codecs.key_scale.as_ref().map(guard);
    let kscale = scale_g.as_ref().map(|g| cuda_slice::<f32>(g, "key scales")).transpose()?;
    if kscale.is_some_and(|s| s.len() != hkv * d) {
        candle_core::bail!("tq-attention: device key scales of the wrong size");
    }

    // The float window: this step's rows (q's type) and the rings.
    struct FloatArgs<G> {
        len: usize,
        new: [(G, (usize, usize)); 2],
        ring: [(G, usize); 2],
        ring_dtype: DType,
    }
    let fl = match &op.float {
        None => None,
        Some(f) => {
            let new = |t: &'_ Tensor| -> Result<(usize, usize)> {
                let (_, l) = t.storage_and_layout();
                if t.dims() != [rows, hkv, d] || t.dtype() != q.dtype() {
                    candle_core::bail!("tq-attention: float window rows must be [{rows}, {hkv}, {d}] in q's type");
                }
                l.contiguous_offsets()
                    .ok_or_else(|| candle_core::Error::Msg("tq-attention: float rows must be contiguous".into()))
            };
            let ring = |t: &'_ Tensor| -> Result<usize> {
                let (_, l) = t.storage_and_layout();
                if !l.is_contiguous() || t.dims().len() != 3 || t.dims()[1..] != [hkv, d] {
                    candle_core::bail!("tq-attention: float rings must be contiguous [rings * {}, {hkv}, {d}]", f.len);
                }
                f.rings(a.meta, t.dims()[0])?;
                Ok(l.start_offset())
            };
            if f.ring_k.dtype() != f.ring_v.dtype() {
                candle_core::bail!("tq-attention: key and value rings of different types");
            }
            let (nk, nv, rk, rv) = (new(f.new_k)?, new(f.new_v)?, ring(f.ring_k)?, ring(f.ring_v)?);
            Some(FloatArgs {
                len: f.len,
                new: [(guard(f.new_k), nk), (guard(f.new_v), nv)],
                ring: [(guard(f.ring_k), rk), (guard(f.ring_v), rv)],
                ring_dtype: f.ring_k.dtype(),
            })
        }
    };

    let (qt, rt) = (dtype_name(q.dtype())?, dtype_name(fl.as_ref().map_or(q.dtype(), |f| f.ring_dtype))?);
    let partial = TQ_ATTENTION.func(&dev, &format!("tq_attn_partial_{qt}_{rt}_{d}"))?;
    let combine = TQ_ATTENTION.func(&dev, &format!("tq_attn_combine_{qt}_{d}"))?;
    let prefill = match prefill {
        true => {
            let (attend, cfg) = prefill_launch(&dev, "tq_prefill_attention", qt, d, (l.num_tiles, hq, 1))?;
            let stage = PREFILL_ATTENTION.func(&dev, &format!("tq_prefill_stage_{qt}_{d}"))?;
            let fw = op.float.as_ref().map_or(0, |f| f.len);
            // Keys and values, in q's type.
            let position_bytes = 2 * hkv * d * q.dtype().size_in_bytes();
            let groups =
                StageGroup::split(&a.meta.seqs, skip, a.window.unwrap_or(0), fw, position_bytes, stage_limit());
            Some(TqPrefill { stage, attend, cfg, groups, num_seqs: a.meta.seqs.len(), vector: hkv * d })
        }
        false => None,
    };
    let ints_partial = [
        hq as i32,
        hkv as i32,
        hb as i32,
        a.meta.block_size as i32,
        bits[0] as i32,
        bits[1] as i32,
        op.key.rotation().is_dense() as i32,
    ];
    let (scale, window, softcap) = (a.scale, a.window.map_or(0, |w| w as i32), a.softcap.unwrap_or(0.0));
    let fw = fl.as_ref().map_or(0, |f| f.len as i32);
    // The float window's splits: at most 32 (TA_MAXSPLIT = 64 + 32 in the kernels) of at
    // least 16 positions, fixed by the window's length alone (batch invariance; a CUDA graph
    // replays them at any context length).
    let wchunk = (fw.max(1) as usize).div_ceil(32).max(16);
    let wsplit = (fw as usize).div_ceil(wchunk);
    let ntot = nsplit + wsplit;
    // TA_MAXSPLIT in the kernels: the combine merges at most 96 splits.
    if ntot > 96 {
        candle_core::bail!("tq-attention: {nsplit} coded and {wsplit} float-window splits, more than the kernels take");
    }
    let cfg_partial = LaunchConfig {
        grid_dim: (span_rows as u32, blocks_y as u32, ntot as u32),
        block_dim: (partial_threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // TC_THREADS in the kernels.
    let cfg_combine =
        LaunchConfig { grid_dim: (span_rows as u32, hq as u32, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
    let vdense = op.value.rotation().is_dense() as i32;
    let (kc, vc) = match (&k.slice, &v.slice) {
        (S::U8(k), S::U8(v)) => (k, v),
        _ => candle_core::bail!("tq-attention: the caches must be u8 codes"),
    };
    // SAFETY: the partial kernel writes every (row, head, split) entry of its span's rows that
    // the combine kernel reads.
    let part: CudaSlice<f32> = unsafe { dev.alloc::<f32>((span_rows * hq * ntot * (d + 2)).max(1))? };

    /// The kernels' pointer arguments that depend on the element types.
    struct Typed<'v, Q, R> {
        q: CudaView<'v, Q>,
        new: Option<[CudaView<'v, Q>; 2]>,
        ring: Option<[CudaView<'v, R>; 2]>,
    }
    use crate::ops::cuda::Kernel;
    #[allow(clippy::too_many_arguments)]
    fn launch<Q: CudaDType + DeviceRepr, R: DeviceRepr>(
        dev: &candle_core::cuda_backend::CudaDevice,
        (partial, combine, prefill): (&Kernel, &Kernel, Option<&TqPrefill>),
        (cfg_partial, cfg_combine): (LaunchConfig, LaunchConfig),
        typed: Typed<Q, R>,
        (kc, vc, part): (&CudaSlice<u8>, &CudaSlice<u8>, &CudaSlice<f32>),
        (ktab, vtab, kscale): (&CudaSlice<f32>, &CudaSlice<f32>, Option<&CudaSlice<f32>>),
        meta: [CudaView<u32>; 4],
        rings: Option<CudaView<u32>>,
        ints_partial: [i32; 7],
        (scale, window, softcap, fw, vdense, row0, skip): (f32, i32, f32, i32, i32, i32, i32),
        (nsplit, ntot, wchunk): (i32, i32, i32),
        n_out: usize,
    ) -> Result<CudaStorage> {
        let [row_seq, seq_info, block_tables, tiles] = &meta;
        // SAFETY: the kernels below together write every row of the output: the combine
        // kernel those of its span it does not skip, the prefill kernel the others (the same
        // `skip`).
        let alloc_out = || unsafe { dev.alloc::<Q>(n_out) };
        let (hq, hkv) = (ints_partial[0], ints_partial[1]);
        // Nothing but prompt chunks: no span.
        let out = if cfg_partial.grid_dim.0 == 0 {
            alloc_out()?
        } else {
            let min_chunk = min_chunk();
            let mut b = partial.dependent();
            b.mem(part).mem(&typed.q).mem(kc).mem(vc).mem(row_seq).mem(seq_info).mem(block_tables);
            b.mem(ktab).mem(vtab);
            match kscale {
                Some(s) => b.mem(s),
                None => b.null(),
            };
            match &typed.new {
                Some([k, v]) => b.mem(k).mem(v),
                None => b.null().null(),
            };
            match &typed.ring {
                Some([k, v]) => b.mem(k).mem(v),
                None => b.null().null(),
            };
            match &rings {
                Some(r) => b.mem(r),
                None => b.null(),
            };
            for i in &ints_partial {
                b.scalar(i);
            }
            b.scalar(&scale).scalar(&window).scalar(&softcap).scalar(&fw).scalar(&nsplit).scalar(&min_chunk);
            b.scalar(&wchunk).scalar(&row0).scalar(&skip);
            // SAFETY: argument types and counts match tq_attn_partial; block tables, table
            // sizes, the float inputs' shapes, the rings' sizes and the partial buffer's size
            // were checked or made above (window splits only where the float inputs exist);
            // the kernel reads only the codec tables and key scales (written at start-up)
            // before it waits (pdl_wait), everything else after.
            unsafe { b.launch(cfg_partial) }?;
            // Allocated here, between the two launches (a stream-ordered allocation), which
            // keeps the combine from starting while the partial kernel runs: launched right
            // after it, steps with a 512-token float window ran 15% slower on an H200 (the
            // combine 97 against 53 us per layer, CUPTI, a 7B at 1k tokens).
            let out = alloc_out()?;
            let mut b = combine.dependent();
            b.mem(&out).mem(part).mem(row_seq).mem(seq_info).mem(vtab);
            b.scalar(&hq).scalar(&nsplit).scalar(&ntot).scalar(&vdense).scalar(&row0).scalar(&skip);
            // SAFETY: argument types and counts match tq_attn_combine; the partial buffer holds
            // `ntot` splits per (row, head) of the span; the kernel waits (pdl_wait) before it
            // reads or writes anything the step wrote.
            unsafe { b.launch(cfg_combine) }?;
            out
        };
        if let Some(p) = prefill {
            let [_, _, _, bs, kbits, vbits, kdense] = &ints_partial;
            for g in &p.groups {
                // The positions the group's prompt chunks read, once per kv head, in q's type
                // (the rings share it here: checked where the kernel was chosen).
                let scratch = |n: usize| unsafe { dev.alloc::<Q>((n * p.vector).max(1)) };
                // SAFETY (these four): tq_prefill_stage writes every position
                // tq_prefill_attention reads, [lo, split) of codes and [split, p] of floats of
                // each of the group's rows.
                let (kcs, vcs) = (scratch(g.codes)?, scratch(g.codes)?);
                let (kfs, vfs) = (scratch(g.floats)?, scratch(g.floats)?);
                let mut b = p.stage.dependent();
                b.mem(&kcs).mem(&vcs).mem(&kfs).mem(&vfs).mem(kc).mem(vc).mem(seq_info).mem(block_tables);
                b.mem(ktab).mem(vtab);
                match kscale {
                    Some(s) => b.mem(s),
                    None => b.null(),
                };
                match (&typed.new, &typed.ring) {
                    (Some([nk, nv]), Some([rk, rv])) => b.mem(nk).mem(nv).mem(rk).mem(rv),
                    _ => b.null().null().null().null(),
                };
                match &rings {
                    Some(r) => b.mem(r),
                    None => b.null(),
                };
                let (num_seqs, seq0, tile0) = (p.num_seqs as i32, g.seq0 as i32, g.tile0 as i32);
                b.scalar(&num_seqs).scalar(&hkv).scalar(bs).scalar(kbits).scalar(vbits).scalar(kdense);
                b.scalar(&vdense).scalar(&window).scalar(&fw).scalar(&skip).scalar(&seq0);
                let stage_cfg = LaunchConfig {
                    grid_dim: (g.chunks.max(1) as u32, g.seqs as u32, hkv as u32),
                    block_dim: (128, 1, 1), // PF_WARPS warps
                    shared_mem_bytes: 0,
                };
                // SAFETY: argument types and counts match tq_prefill_stage; the scratch buffers
                // hold the positions `StageGroup` counts, as the kernel lays them out; it reads
                // only the codec tables and key scales before it waits (pdl_wait), and writes
                // the scratch after (so not while the group before reads its own).
                unsafe { b.launch(stage_cfg) }?;
                let mut b = p.attend.dependent();
                b.mem(&out).mem(&typed.q).mem(&kcs).mem(&vcs).mem(&kfs).mem(&vfs).mem(tiles).mem(seq_info);
                b.mem(ktab).mem(vtab);
                match kscale {
                    Some(s) => b.mem(s),
                    None => b.null(),
                };
                b.scalar(&hq).scalar(&hkv).scalar(kdense).scalar(&vdense);
                b.scalar(&scale)
                    .scalar(&window)
                    .scalar(&softcap)
                    .scalar(&fw)
                    .scalar(&skip)
                    .scalar(&tile0)
                    .scalar(&seq0);
                let cfg = LaunchConfig { grid_dim: (g.tiles as u32, p.cfg.grid_dim.1, 1), ..p.cfg };
                // SAFETY: argument types and counts match tq_prefill_attention; its shared
                // memory was allowed above; the groups' tiles together cover exactly the rows
                // the kernels above skip; it reads only the codec tables and key scales before
                // it waits (pdl_wait) on the staging kernel.
                unsafe { b.launch(cfg) }?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    let out = with_u32_slice(&dm.data, |data| {
        let meta = [
            data.slice(l.row_seq..l.row_seq + rows),
            data.slice(l.seq_info..l.rings),
            data.slice(l.block_tables..),
            data.slice(l.tiles..l.block_tables),
        ];
        // Each sequence's ring (the step's metadata holds them; checked above).
        let rings = fl.as_ref().map(|_| data.slice(l.rings..l.tiles));
        let common =
            ((&partial, &combine, prefill.as_ref()), (cfg_partial, cfg_combine), (kc, vc, &part), (ktab, vtab, kscale));
        let skip = skip.min(i32::MAX as usize) as i32;
        let floats = (scale, window, softcap, fw, vdense, row0 as i32, skip);
        let splits = (nsplit as i32, ntot as i32, wchunk as i32);
        let n = rows * hq * d;
        // The typed views of q, this step's float rows and the rings.
        macro_rules! go {
            ($q:ident, $qs:expr, $r:ty) => {{
                let new = match &fl {
                    Some(f) => Some([
                        cuda_slice::<$q>(&f.new[0].0, "new keys")?.slice(f.new[0].1 .0..f.new[0].1 .1),
                        cuda_slice::<$q>(&f.new[1].0, "new values")?.slice(f.new[1].1 .0..f.new[1].1 .1),
                    ]),
                    None => None,
                };
                let ring = match &fl {
                    Some(f) => Some([
                        cuda_slice::<$r>(&f.ring[0].0, "key ring")?.slice(f.ring[0].1..),
                        cuda_slice::<$r>(&f.ring[1].0, "value ring")?.slice(f.ring[1].1..),
                    ]),
                    None => None,
                };
                let typed = Typed::<$q, $r> { q: $qs.slice(qa..qb), new, ring };
                let (fns, cfgs, codes, tabs) = common;
                launch(&dev, fns, cfgs, typed, codes, tabs, meta, rings, ints_partial, floats, splits, n)
            }};
        }
        use half::{bf16, f16};
        match (&q.slice, fl.as_ref().map(|f| f.ring_dtype)) {
            (S::F32(qs), None | Some(DType::F32)) => go!(f32, qs, f32),
            (S::F32(qs), Some(DType::BF16)) => go!(f32, qs, bf16),
            (S::F32(qs), Some(DType::F16)) => go!(f32, qs, f16),
            (S::BF16(qs), None | Some(DType::BF16)) => go!(bf16, qs, bf16),
            (S::F16(qs), None | Some(DType::F16)) => go!(f16, qs, f16),
            (_, r) => candle_core::bail!("tq-attention: {qt} queries with float rings of {r:?} are not supported"),
        }
    })?;
    Ok((out, shape))
}

/// The fewest coded positions a split of tq_attn_partial takes: 32 (`IRIS_TQ_MIN_CHUNK=N` to
/// compare; on an H200 a 7B decode at 1k tokens ran at 214 / 222 / 221 tok/s with 64 / 32 / 16).
fn min_chunk() -> i32 {
    crate::switches::tuned!("IRIS_TQ_MIN_CHUNK", i32, 32)
}

/// The tensor-core kernels for prompt chunks: for each group of them, tq_prefill_stage, then
/// tq_prefill_attention.
struct TqPrefill {
    stage: crate::ops::cuda::Kernel,
    attend: crate::ops::cuda::Kernel,
    cfg: candle_core::cuda_backend::cudarc::driver::LaunchConfig,
    groups: Vec<StageGroup>,
    /// The step's sequences (the kernels scan them for the prompt chunks).
    num_seqs: usize,
    /// Elements per staged position (all kv heads).
    vector: usize,
}

/// The most bytes of scratch one group of prompt chunks stages (`IRIS_TQ_STAGE_MIB`, default
/// 256 MiB; a prompt chunk that needs more is staged alone). At 0 each prompt chunk is a group
/// of its own, which `scripts/gpu-check.sh` runs the CUDA tests with too.
fn stage_limit() -> usize {
    crate::switches::tuned!("IRIS_TQ_STAGE_MIB", usize, 256).saturating_mul(1 << 20)
}

/// Prompt chunks (sequences computing `skip` rows or more) staged together, and what
/// tq_prefill_stage writes for them, counted as the kernels count it (`tq_staged`,
/// `tq_stage_offsets` in prefill_attention.cu): each chunk's coded positions, from its first
/// row's `lo` to its last row's split, then its float positions, from its first row's split to
/// the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StageGroup {
    /// The step's sequence the group starts at, and its first tile of 64 rows.
    seq0: usize,
    tile0: usize,
    /// Prompt chunks and their tiles.
    seqs: usize,
    tiles: usize,
    /// Positions in the code and float scratch buffers (per kv head).
    codes: usize,
    floats: usize,
    /// The most blocks of 64 positions one prompt chunk stages.
    chunks: usize,
}

impl StageGroup {
    /// The step's prompt chunks in order, in groups whose scratch (`position_bytes` per
    /// position) stays within `limit` bytes where one chunk alone does.
    fn split(
        seqs: &[crate::batch::SeqSlice],
        skip: usize,
        window: usize,
        float_window: usize,
        position_bytes: usize,
        limit: usize,
    ) -> Vec<StageGroup> {
        use crate::batch::PREFILL_TILE_ROWS;
        let lo_of = |p: usize| if window > 0 { (p + 1).saturating_sub(window) } else { 0 };
        let split_of = |p: usize| (p + 1).saturating_sub(float_window).max(lo_of(p));
        let mut groups: Vec<StageGroup> = Vec::new();
        let mut tile = 0;
        for (i, s) in seqs.iter().enumerate().filter(|(_, s)| s.q_len >= skip && s.q_len > 0) {
            let (ctx, first) = (s.context_len, s.context_len - s.q_len);
            let codes = split_of(ctx - 1).saturating_sub(lo_of(first));
            let floats = if float_window > 0 { ctx - split_of(first) } else { 0 };
            let tiles = s.q_len.div_ceil(PREFILL_TILE_ROWS);
            let fits = |g: &StageGroup| (g.codes + codes + g.floats + floats).saturating_mul(position_bytes) <= limit;
            match groups.last_mut() {
                Some(g) if fits(g) => {
                    g.seqs += 1;
                    g.tiles += tiles;
                    g.codes += codes;
                    g.floats += floats;
                    g.chunks = g.chunks.max(codes.div_ceil(64) + floats.div_ceil(64));
                }
                _ => groups.push(StageGroup {
                    seq0: i,
                    tile0: tile,
                    seqs: 1,
                    tiles,
                    codes,
                    floats,
                    chunks: codes.div_ceil(64) + floats.div_ceil(64),
                }),
            }
            tile += tiles;
        }
        groups
    }
}

#[cfg(test)]
mod tests {
    use super::StageGroup;
    use crate::batch::SeqSlice;

    fn seq(q_len: usize, context_len: usize) -> SeqSlice {
        SeqSlice { q_start: 0, q_len, context_len, block_table: vec![] }
    }

    #[test]
    fn stage_groups_count_what_the_prompt_chunks_read() {
        // A decode (not staged), a 40-token prompt, a 45-row chunk after 255 positions, a
        // 130-row chunk (3 tiles) after 70.
        let seqs = [seq(1, 700), seq(40, 40), seq(45, 300), seq(130, 200)];
        let g = |seq0, tile0, seqs, tiles, codes, floats, chunks| StageGroup {
            seq0,
            tile0,
            seqs,
            tiles,
            codes,
            floats,
            chunks,
        };
        let all = StageGroup::split(&seqs, 16, 0, 0, 1, usize::MAX);
        assert_eq!(all, [g(1, 0, 3, 5, 540, 0, 5)]);
        // A float window of 16: each chunk's codes end at its last row's split (the prompt's at
        // 39 + 1 - 16 = 24, the others' at 284 and 184), its floats start at its first row's (0,
        // 255 + 1 - 16 = 240, 70 + 1 - 16 = 55).
        let w = StageGroup::split(&seqs, 16, 0, 16, 1, usize::MAX);
        assert_eq!(w, [g(1, 0, 3, 5, 24 + 284 + 184, 40 + 60 + 145, 5 + 1)]);
        // A sliding window of 32 starts the second chunk's codes at 255 + 1 - 32 = 224 (to
        // 284: one block), the third's at 70 + 1 - 32 = 39 (to 184: three blocks, and three of
        // floats from 55).
        let sw = StageGroup::split(&seqs, 16, 32, 16, 1, usize::MAX);
        assert_eq!(sw, [g(1, 0, 3, 5, 24 + 60 + 145, 245, 3 + 3)]);
        // Groups of at most 400 positions: the first two chunks (340), then the third; with no
        // room at all, each chunk alone.
        let some = StageGroup::split(&seqs, 16, 0, 0, 2, 800);
        assert_eq!(some, [g(1, 0, 2, 2, 340, 0, 5), g(3, 2, 1, 3, 200, 0, 4)]);
        let each = StageGroup::split(&seqs, 16, 0, 0, 2, 0);
        assert_eq!(each, [g(1, 0, 1, 1, 40, 0, 1), g(2, 1, 1, 1, 300, 0, 5), g(3, 2, 1, 3, 200, 0, 4)]);
    }
}
