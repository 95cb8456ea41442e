// Attention for prompt chunks with tensor cores (bf16 / f16): the rows of sequences that
// compute many tokens at once, over the paged KV cache (prefill_attention: the same function as
// paged_attention.cu, see ops/paged_attention/mod.rs) or over TurboQuant codes (tq_prefill_attention:
// the same function as tq_attention.cu, see ops/tq_attention/). Scores are accumulated in f32
// from the exact products of the 16-bit inputs; probabilities are rounded to the input type for
// the P V product (as FlashAttention does); the output accumulates in f32.
//
// As FlashAttention-2: one block per (tile of up to 64 rows of one sequence, query head), 4 warps
// of 16 rows. Key tiles of 64 positions go through shared memory, the next one loading
// (cp.async) while the warps work on this one; each warp keeps its scores, probabilities and
// output rows in registers, in the layouts of the m16n8k16 tensor-core product (the scores'
// accumulator layout is the probabilities' operand layout), so nothing but K, V and Q passes
// through shared memory.
//
// Split over keys (prefill_attention): a tile whose sequence computes few rows over a long
// context would leave most of the GPU idle, so its key tiles are shared among up to 8 blocks
// (grid z), each writing its rows' partial softmax to a scratch buffer, merged in a fixed order
// by prefill_merge. How many blocks a tile takes depends on its own sequence's rows and context
// (batch.rs: prefill_splits) and on the window, never on the rest of the batch.
#include "tq_common.cuh"
#include "flash.cuh"

#define PF_ROWS 64
#define PF_KEYS 64
#define PF_WARPS 4
// Key tiles a split block takes at least.
#define PF_MIN_SPLIT_TILES 4

template <int D> struct PfLayout {
    static constexpr int LD = flash_ld(D);
    static constexpr size_t Q = 0;
    static constexpr size_t KV = Q + 2 * PF_ROWS * LD;        // then stages of (K tile, V tile)
    static constexpr size_t STAGE = 2 * 2 * PF_KEYS * LD;     // bytes of one stage
    static constexpr size_t BYTES = KV + 2 * STAGE;           // = 640 (D + 8) (ops/cuda/mod.rs)
    // tq_prefill_attention's output rows (f32) and each warp's rotation scratch (2 D floats),
    // in the stages once the keys are done.
    static constexpr int LO = D + 4;
    static constexpr size_t X = KV + 4 * PF_ROWS * LO;
    static_assert(X + PF_WARPS * 2 * D * 4 <= BYTES, "the output rows and rotation scratch fit in the stages");
};

// A tile's position bounds: its sequence's rows and this block's rows of it, and the most
// blocks its keys may be split over (1: none) and where its partial states start (in units of
// 64 rows of every head).
struct PfTile {
    int s, q_start, r0, n_rows, pos0, max_splits, part;
};

__device__ __forceinline__ PfTile pf_tile(const uint32_t* tiles, const uint32_t* seq_info, int tile) {
    PfTile t;
    t.s = tiles[4 * tile];
    t.r0 = tiles[4 * tile + 1];
    t.max_splits = tiles[4 * tile + 2];
    t.part = tiles[4 * tile + 3];
    t.q_start = seq_info[4 * t.s];
    const int q_len = seq_info[4 * t.s + 1], ctx = seq_info[4 * t.s + 2];
    t.n_rows = min(PF_ROWS, t.q_start + q_len - t.r0);
    t.pos0 = ctx - q_len + (t.r0 - t.q_start);  // position of the tile's first row
    return t;
}

// The key tiles a tile reads (from position `lo`), and the blocks they are split over: at
// most max_splits, each taking PF_MIN_SPLIT_TILES tiles or more.
struct PfKeys {
    int lo, tiles, splits;
    __device__ __forceinline__ PfKeys(const PfTile& t, int window) {
        const int hi = t.pos0 + t.n_rows - 1;
        lo = window > 0 ? max(0, t.pos0 + 1 - window) : 0;
        tiles = (hi - lo) / PF_KEYS + 1;
        splits = max(1, min(t.max_splits, tiles / PF_MIN_SPLIT_TILES));
    }
    // Split z's key tiles, [first(z), first(z + 1)).
    __device__ __forceinline__ int first(int z) const { return z * tiles / splits; }
};

// A split block's partial state of (row, head): its normalised output row, then its max (log2
// units) and sum.
template <int D, typename F>
__device__ __forceinline__ F* pf_part(F* part, const PfTile& t, int z, int row, int head, int num_heads) {
    return part + (((size_t)(t.part + z) * PF_ROWS + row) * num_heads + head) * (D + 2);
}

// tiles: 4 u32 per tile: sequence, first row of the tile, most splits, first partial unit.
template <typename T, int D>
__device__ void prefill_attention(T* __restrict__ out, float* __restrict__ part, const T* __restrict__ q,
                                  const T* __restrict__ kc, const T* __restrict__ vc, const uint32_t* __restrict__ tiles,
                                  const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                  int num_heads, int num_kv_heads, int block_size, float scale, int window,
                                  float softcap) {
    using L = PfLayout<D>;
    constexpr int V16 = 8;  // 16-bit elements per 16-byte vector
    extern __shared__ __align__(128) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem + L::Q);
    const int tid = threadIdx.x;
    const PfTile tl = pf_tile(tiles, seq_info, blockIdx.x);
    const PfKeys keys(tl, window);
    const int z = blockIdx.z;
    if (z >= keys.splits) return;
    const uint32_t* bt = block_tables + seq_info[4 * tl.s + 3];
    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int hi = tl.pos0 + tl.n_rows - 1;

    // Key tile t into stage st: K then V, zeros past the last row's position.
    auto load = [&](int t, int st) {
        T* K_s = reinterpret_cast<T*>(smem + L::KV + st * L::STAGE);
        T* V_s = K_s + PF_KEYS * L::LD;
        const int k0 = keys.lo + t * PF_KEYS;
        for (int i = tid; i < PF_KEYS * (D / V16); i += PF_WARPS * 32) {
            const int r = i / (D / V16), c = (i % (D / V16)) * V16;
            const int j = k0 + r;
            const size_t slot = j <= hi ? (size_t)bt[j / block_size] * block_size + j % block_size : 0;
            const size_t off = (slot * num_kv_heads + kvh) * D + c;
            cp_async16(K_s + r * L::LD + c, kc + off, j <= hi);
            cp_async16(V_s + r * L::LD + c, vc + off, j <= hi);
        }
    };
    // The Q tile (zero rows past the sequence) with the first key tile.
    for (int i = tid; i < PF_ROWS * (D / V16); i += PF_WARPS * 32) {
        const int r = i / (D / V16), c = (i % (D / V16)) * V16;
        cp_async16(Q_s + r * L::LD + c, q + ((size_t)(tl.r0 + min(r, tl.n_rows - 1)) * num_heads + h) * D + c,
                   r < tl.n_rows);
    }
    const int t0 = keys.first(z), t1 = keys.first(z + 1);
    load(t0, 0);
    cp_async_commit_group();

    FlashWarp<T, D> W(Q_s + (tid / 32) * 16 * L::LD, (tid / 32) * 16);
    int a[2], b[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int pos = tl.pos0 + W.row(i);
        a[i] = window > 0 ? max(0, pos + 1 - window) : 0;
        b[i] = W.row(i) < tl.n_rows ? pos : -1;
    }
    for (int t = t0; t < t1; ++t) {
        const int st = (t - t0) & 1;
        if (t + 1 < t1) {
            load(t + 1, st ^ 1);  // the stage the last iteration read, freed by its closing barrier
            cp_async_commit_group();
            cp_async_wait_group<1>();
        } else {
            cp_async_wait_group<0>();
        }
        __syncthreads();
        const T* K_s = reinterpret_cast<const T*>(smem + L::KV + st * L::STAGE);
        W.template attend<PF_KEYS>(K_s, K_s + PF_KEYS * L::LD, keys.lo + t * PF_KEYS, a, b, scale, softcap);
        __syncthreads();
    }
    W.finish();
    if (keys.splits == 1) {
        W.each_output([&](int i, int c, float v0, float v1) {
            const int r = W.row(i);
            if (r >= tl.n_rows) return;
            *reinterpret_cast<uint32_t*>(out + ((size_t)(tl.r0 + r) * num_heads + h) * D + c) = pack2<T>(v0, v1);
        });
        return;
    }
    W.each_output([&](int i, int c, float v0, float v1) {
        float* p = pf_part<D>(part, tl, z, W.row(i), h, num_heads);
        *reinterpret_cast<float2*>(p + c) = make_float2(v0, v1);
    });
    if ((W.lane & 3) == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float* p = pf_part<D>(part, tl, z, W.row(i), h, num_heads);
            p[D] = W.m[i];
            p[D + 1] = W.l[i];
        }
    }
}

// The split tiles' partial states into their output rows, in split order (so a row's result is
// the same bits however the blocks ran). Grid: (tiles, query heads); tiles not split return.
template <typename T, int D>
__device__ void prefill_merge(T* __restrict__ out, const float* __restrict__ part, const uint32_t* __restrict__ tiles,
                              const uint32_t* __restrict__ seq_info, int num_heads, int window) {
    const PfTile tl = pf_tile(tiles, seq_info, blockIdx.x);
    const PfKeys keys(tl, window);
    if (keys.splits == 1) return;
    const int h = blockIdx.y;
    for (int r = threadIdx.y; r < tl.n_rows; r += blockDim.y) {
        float mx = -INFINITY;
        for (int z = 0; z < keys.splits; ++z) mx = fmaxf(mx, pf_part<D>(part, tl, z, r, h, num_heads)[D]);
        for (int c = threadIdx.x; c < D; c += blockDim.x) {
            float acc = 0.f, sum = 0.f;
            for (int z = 0; z < keys.splits; ++z) {
                const float* p = pf_part<D>(part, tl, z, r, h, num_heads);
                const float w = p[D + 1] > 0.f ? p[D + 1] * exp2f(p[D] - mx) : 0.f;
                acc += w * p[c];
                sum += w;
            }
            out[((size_t)(tl.r0 + r) * num_heads + h) * D + c] = from_f<T>(acc / sum);
        }
    }
}

// One head vector through a rotation by the calling warp: in(c) for c < D, rotated (R, or R^T
// with INVERSE), then out(c, value) for each c. Hadamard rotations in registers
// (tq_rotate_regs); dense ones (head dims that are not powers of two) through `x`, the warp's
// scratch of 2 D floats.
template <int D, bool INVERSE, typename In, typename Out>
__device__ __forceinline__ void pf_rotate(In in, Out out, const float* rot, bool dense, float* x) {
    const int lane = threadIdx.x & 31;
    if constexpr ((D & (D - 1)) == 0) {
        if (!dense) {
            float v[D / 32];
#pragma unroll
            for (int j = 0; j < D / 32; ++j) v[j] = in(32 * j + lane);
            tq_rotate_regs<D, INVERSE>(v, rot);
#pragma unroll
            for (int j = 0; j < D / 32; ++j) out(32 * j + lane, v[j]);
            return;
        }
    }
    for (int c = lane; c < D; c += 32) x[c] = in(c);
    tq_rotate<true, D, INVERSE>(x, x + D, 1, rot, dense);
    for (int c = lane; c < D; c += 32) out(c, x[c]);
    __syncwarp();
}

// Attention on TurboQuant codes for the prompt chunks of tq_attention.cu's rows (those it
// skips: sequences computing `skip` tokens or more). Row t at position p reads [lo, split) as
// codes and [split, p] as floats (tq_attention.cu says how they are found).
//
// All in the rotated spaces: a key's codes dequantize to norm * c[idx], about R (s k) with s
// the key scales, so queries enter as R (q / s) and scores are unchanged; values' sums stay
// rotated until each output row is rotated back once (R_v^T). The float window's keys and
// values are rotated the same way, so one running softmax takes both: a key tile holds either
// codes or floats, and each row's bounds pick what it reads as which (tiles where the rows
// disagree are visited twice, once as each).
//
// Two kernels, for each group of the step's prompt chunks (groups bound the scratch).
// tq_prefill_stage dequantizes the positions they read, once per kv head, into scratch buffers
// in the input type (and rotates their float-window positions); tq_prefill_attention then reads
// those like a dense cache, a block per (tile of rows, query head). Dequantizing in the
// attention kernel itself did it once per query head (7 times per kv head on a 7B), which made
// a 1,024-token prompt's attention ~1.5x the dense cache's on an H200.

// A prompt chunk's bounds: the position of its first row, and where its codes start and end
// and its float positions start, [lo(first), split(last)) and [split(first), ctx).
struct TqStaged {
    int first, ctx, code_lo, code_end, float_lo;
    __device__ __forceinline__ int codes() const { return max(code_end - code_lo, 0); }
    __device__ __forceinline__ int floats(int float_window) const { return float_window > 0 ? ctx - float_lo : 0; }
};

__device__ __forceinline__ int tq_lo_of(int p, int window) { return window > 0 ? max(0, p + 1 - window) : 0; }
__device__ __forceinline__ int tq_split_of(int p, int window, int float_window) {
    return max(p + 1 - float_window, tq_lo_of(p, window));
}

__device__ __forceinline__ TqStaged tq_staged(const uint32_t* seq_info, int s, int window, int float_window) {
    TqStaged g;
    g.ctx = seq_info[4 * s + 2];
    g.first = g.ctx - (int)seq_info[4 * s + 1];
    g.code_lo = tq_lo_of(g.first, window);
    g.code_end = tq_split_of(g.ctx - 1, window, float_window);
    g.float_lo = tq_split_of(g.first, window, float_window);
    return g;
}

// Where prompt chunk s's positions sit in the scratch buffers: after those of the prompt
// chunks staged with it before it, from sequence seq0 on, each its codes() and floats()
// positions in order. ops/tq_attention/cuda.rs (StageGroup) sizes the buffers the same way.
__device__ __forceinline__ void tq_stage_offsets(const uint32_t* seq_info, int seq0, int s, int skip, int window,
                                                 int float_window, int& code_off, int& float_off) {
    code_off = 0, float_off = 0;
    for (int i = seq0; i < s; ++i) {
        if ((int)seq_info[4 * i + 1] < skip) continue;
        const TqStaged g = tq_staged(seq_info, i, window, float_window);
        code_off += g.codes();
        float_off += g.floats(float_window);
    }
}

// Grid: (chunks of 64 positions, prompt chunks from sequence seq0 on, kv heads). A prompt
// chunk's first blocks take its codes, the next its float positions; the others return. (A
// step's prompt chunks are staged in groups that bound the scratch, each group then attended.)
template <typename T, int D>
__device__ void tq_prefill_stage(T* __restrict__ kcs, T* __restrict__ vcs, T* __restrict__ kfs, T* __restrict__ vfs,
                                 const uint8_t* __restrict__ kc, const uint8_t* __restrict__ vc,
                                 const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                 const float* __restrict__ ktab, const float* __restrict__ vtab,
                                 const float* __restrict__ kscale, const T* __restrict__ new_k,
                                 const T* __restrict__ new_v, const T* __restrict__ ring_k,
                                 const T* __restrict__ ring_v, const uint32_t* __restrict__ window_rings,
                                 int num_seqs, int num_kv_heads, int block_size, int kbits, int vbits, int kdense,
                                 int vdense, int window, int float_window, int skip, int seq0) {
    __shared__ float ktab_s[16], vtab_s[16], ksign_s[2 * D], vsign_s[2 * D], kscale_s[D];
    __shared__ float x_s[PF_WARPS][2 * D];  // each warp's scratch for dense rotations
    pdl_launch_dependents();
    const int tid = threadIdx.x, warp = tid / 32, kvh = blockIdx.z;
    // Written once at start-up, not by the kernels before: read before the wait.
    if (tid < 16) { ktab_s[tid] = ktab[TQ_CENTROIDS + tid]; vtab_s[tid] = vtab[TQ_CENTROIDS + tid]; }
    for (int i = tid; i < 2 * D; i += PF_WARPS * 32) {
        if (!kdense) ksign_s[i] = ktab[TQ_ROTATION + i];
        if (!vdense) vsign_s[i] = vtab[TQ_ROTATION + i];
    }
    for (int i = tid; i < D; i += PF_WARPS * 32) kscale_s[i] = kscale ? kscale[kvh * D + i] : 1.f;
    pdl_wait();  // launched as a dependent (ops/tq_attention/cuda.rs): inputs after this
    __syncthreads();  // the tables

    // This block's prompt chunk: the blockIdx.y-th from seq0 on.
    int s = -1;
    for (int i = seq0, n = 0; i < num_seqs && s < 0; ++i)
        if ((int)seq_info[4 * i + 1] >= skip && n++ == (int)blockIdx.y) s = i;
    if (s < 0) return;
    int code_off, float_off;
    tq_stage_offsets(seq_info, seq0, s, skip, window, float_window, code_off, float_off);
    const TqStaged g = tq_staged(seq_info, s, window, float_window);
    const uint32_t* bt = block_tables + seq_info[4 * s + 3];
    const int code_chunks = (g.codes() + PF_KEYS - 1) / PF_KEYS;
    const int chunk = blockIdx.x;
    if (chunk < code_chunks) {
        // A thread per 8 coordinates of a position: dequantized to norm * centroid, in T.
        const int kcb = D * kbits / 8, vcb = D * vbits / 8;
        const uint32_t kmask = (1u << kbits) - 1, vmask = (1u << vbits) - 1;
        for (int i = tid; i < PF_KEYS * (D / 8); i += PF_WARPS * 32) {
            const int r = i / (D / 8), c = i % (D / 8);
            const int j = g.code_lo + chunk * PF_KEYS + r;
            if (j >= g.code_end) break;
            const size_t row = ((size_t)bt[j / block_size] * block_size + j % block_size) * num_kv_heads + kvh;
            const uint8_t* kr = kc + row * (kcb + 4);
            const uint8_t* vr = vc + row * (vcb + 4);
            const uint32_t kw = tq_codes8_aligned<D>(kr, c, kbits), vw = tq_codes8_aligned<D>(vr, c, vbits);
            const float kn = tq_norm_aligned(kr, kcb), vn = tq_norm_aligned(vr, vcb);
            float kv[8], vv[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                kv[e] = kn * ktab_s[(kw >> (e * kbits)) & kmask];
                vv[e] = vn * vtab_s[(vw >> (e * vbits)) & vmask];
            }
            const size_t dst = ((size_t)(code_off + j - g.code_lo) * num_kv_heads + kvh) * D + c * 8;
            store16<T>(kcs + dst, kv);
            store16<T>(vcs + dst, vv);
        }
        return;
    }
    if (float_window == 0) return;
    // Float positions: each warp rotates 16 of the chunk's keys (times the key scales) and
    // values, each a ring's (before this step) or this step's row.
    const int j0 = g.float_lo + (chunk - code_chunks) * PF_KEYS;
    const int ring_idx = window_rings[s];
    const int q_start = seq_info[4 * s];
    const float* krot = kdense ? ktab + TQ_ROTATION : ksign_s;
    const float* vrot = vdense ? vtab + TQ_ROTATION : vsign_s;
    for (int j = j0 + warp * 16; j < min(j0 + warp * 16 + 16, g.ctx); ++j) {
        const size_t src = j < g.first ? ((size_t)ring_idx * float_window + j % float_window) * num_kv_heads + kvh
                                       : ((size_t)q_start + (j - g.first)) * num_kv_heads + kvh;
        const T* kp = (j < g.first ? ring_k : new_k) + src * D;
        const T* vp = (j < g.first ? ring_v : new_v) + src * D;
        const size_t dst = ((size_t)(float_off + j - g.float_lo) * num_kv_heads + kvh) * D;
        pf_rotate<D, false>([&](int c) { return to_f(kp[c]) * kscale_s[c]; },
                            [&](int c, float v) { kfs[dst + c] = from_f<T>(v); }, krot, kdense != 0, x_s[warp]);
        pf_rotate<D, false>([&](int c) { return to_f(vp[c]); }, [&](int c, float v) { vfs[dst + c] = from_f<T>(v); },
                            vrot, vdense != 0, x_s[warp]);
    }
}

template <typename T, int D>
__device__ void tq_prefill_attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kcs,
                                     const T* __restrict__ vcs, const T* __restrict__ kfs, const T* __restrict__ vfs,
                                     const uint32_t* __restrict__ tiles, const uint32_t* __restrict__ seq_info,
                                     const float* __restrict__ ktab, const float* __restrict__ vtab,
                                     const float* __restrict__ kscale, int num_heads, int num_kv_heads, int kdense,
                                     int vdense, float scale, int window, float softcap, int float_window, int skip,
                                     int tile0, int seq0) {
    using L = PfLayout<D>;
    constexpr int V16 = 8;  // 16-bit elements per 16-byte vector
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float ksign_s[2 * D], vsign_s[2 * D], kscale_s[D];
    T* Q_s = reinterpret_cast<T*>(smem + L::Q);
    T* K_s = reinterpret_cast<T*>(smem + L::KV);  // one stage: these loads are not pipelined
    T* V_s = K_s + PF_KEYS * L::LD;
    pdl_launch_dependents();
    const int tid = threadIdx.x, warp = tid / 32;
    // Written once at start-up, not by the kernels before: read before the wait.
    for (int i = tid; i < 2 * D; i += PF_WARPS * 32) {
        if (!kdense) ksign_s[i] = ktab[TQ_ROTATION + i];
        if (!vdense) vsign_s[i] = vtab[TQ_ROTATION + i];
    }
    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    for (int i = tid; i < D; i += PF_WARPS * 32) kscale_s[i] = kscale ? kscale[kvh * D + i] : 1.f;
    const float* krot = kdense ? ktab + TQ_ROTATION : ksign_s;
    const float* vrot = vdense ? vtab + TQ_ROTATION : vsign_s;
    pdl_wait();  // launched after tq_prefill_stage, as a dependent: inputs after this
    const PfTile tl = pf_tile(tiles, seq_info, tile0 + blockIdx.x);
    const TqStaged g = tq_staged(seq_info, tl.s, window, float_window);
    int code_off, float_off;
    tq_stage_offsets(seq_info, seq0, tl.s, skip, window, float_window, code_off, float_off);
    const int hi = tl.pos0 + tl.n_rows - 1;
    // This warp's rotation scratch (dense rotations): x[0, D), tmp[D, 2 D).
    float* x = reinterpret_cast<float*>(smem + L::X) + warp * 2 * D;
    __syncthreads();  // the tables

    // Q tile: each warp rotates its 16 rows, divided by the key scales (zero rows past the sequence).
    for (int r = warp * 16; r < warp * 16 + 16; ++r) {
        const T* qr = q + ((size_t)(tl.r0 + r) * num_heads + h) * D;
        const bool in = r < tl.n_rows;
        pf_rotate<D, false>([&](int c) { return in ? to_f(qr[c]) / kscale_s[c] : 0.f; },
                            [&](int c, float v) { Q_s[r * L::LD + c] = from_f<T>(v); }, krot, kdense != 0, x);
    }
    __syncthreads();

    FlashWarp<T, D> W(Q_s + (tid / 32) * 16 * L::LD, (tid / 32) * 16);
    int lo[2], split[2], pos[2];
    bool live[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        pos[i] = tl.pos0 + W.row(i);
        live[i] = W.row(i) < tl.n_rows;
        lo[i] = tq_lo_of(pos[i], window);
        split[i] = tq_split_of(pos[i], window, float_window);
    }

    // A tile of 64 staged positions from k0, those before `end` (zeros past it), into K_s / V_s.
    auto load = [&](const T* ks, const T* vs, int k0, int end, int base) {
        for (int i = tid; i < PF_KEYS * (D / V16); i += PF_WARPS * 32) {
            const int r = i / (D / V16), c = (i % (D / V16)) * V16;
            const int j = k0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (j < end) {
                const size_t off = ((size_t)(base + j) * num_kv_heads + kvh) * D + c;
                kv = *reinterpret_cast<const uint4*>(ks + off);
                vv = *reinterpret_cast<const uint4*>(vs + off);
            }
            *reinterpret_cast<uint4*>(K_s + r * L::LD + c) = kv;
            *reinterpret_cast<uint4*>(V_s + r * L::LD + c) = vv;
        }
        __syncthreads();
    };
    // The coded positions, [lo of the first row, split of the last).
    const int code_end = tq_split_of(hi, window, float_window);
    for (int k0 = tq_lo_of(tl.pos0, window); k0 < code_end; k0 += PF_KEYS) {
        load(kcs, vcs, k0, code_end, code_off - g.code_lo);
        const int b[2] = {live[0] ? split[0] - 1 : -1, live[1] ? split[1] - 1 : -1};
        W.template attend<PF_KEYS>(K_s, V_s, k0, lo, b, scale, softcap);
        __syncthreads();
    }
    // The float window's positions, [split of the first row, the last row's position].
    if (float_window > 0) {
        for (int k0 = tq_split_of(tl.pos0, window, float_window); k0 <= hi; k0 += PF_KEYS) {
            load(kfs, vfs, k0, hi + 1, float_off - g.float_lo);
            const int b[2] = {live[0] ? pos[0] : -1, live[1] ? pos[1] : -1};
            W.template attend<PF_KEYS>(K_s, V_s, k0, split, b, scale, softcap);
            __syncthreads();
        }
    }

    // Each row's normalised sum into shared memory, then rotated back once (by its warp, a
    // row at a time) and written.
    W.finish();
    float* O_s = reinterpret_cast<float*>(smem + L::KV);
    W.each_output([&](int i, int c, float v0, float v1) {
        *reinterpret_cast<float2*>(O_s + W.row(i) * L::LO + c) = make_float2(v0, v1);
    });
    __syncwarp();
    for (int r = warp * 16; r < warp * 16 + 16; ++r) {
        T* dst = out + ((size_t)(tl.r0 + r) * num_heads + h) * D;
        pf_rotate<D, true>([&](int c) { return O_s[r * L::LO + c]; },
                           [&](int c, float v) {
                               if (r < tl.n_rows) dst[c] = from_f<T>(v);
                           },
                           vrot, vdense != 0, x);
    }
}

#define PF(NAME, T, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32)                                                \
        NAME(T* out, float* part, const T* q, const T* kc, const T* vc, const uint32_t* tiles,                 \
             const uint32_t* seq_info, const uint32_t* block_tables, int num_heads, int num_kv_heads,           \
             int block_size, float scale, int window, float softcap) {                                         \
        prefill_attention<T, D>(out, part, q, kc, vc, tiles, seq_info, block_tables, num_heads, num_kv_heads,   \
                                block_size, scale, window, softcap);                                           \
    }

#define PF_MERGE(NAME, T, D)                                                                                   \
    extern "C" __global__ void NAME(T* out, const float* part, const uint32_t* tiles, const uint32_t* seq_info, \
                                    int num_heads, int window) {                                               \
        prefill_merge<T, D>(out, part, tiles, seq_info, num_heads, window);                                    \
    }

#define TQ_PF(NAME, T, D)                                                                                      \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32)                                                \
        NAME(T* out, const T* q, const T* kcs, const T* vcs, const T* kfs, const T* vfs, const uint32_t* tiles, \
             const uint32_t* seq_info, const float* ktab, const float* vtab, const float* kscale, int num_heads, \
             int num_kv_heads, int kdense, int vdense, float scale, int window, float softcap, int float_window, \
             int skip, int tile0, int seq0) {                                                                  \
        tq_prefill_attention<T, D>(out, q, kcs, vcs, kfs, vfs, tiles, seq_info, ktab, vtab, kscale, num_heads,  \
                                   num_kv_heads, kdense, vdense, scale, window, softcap, float_window, skip,     \
                                   tile0, seq0);                                                               \
    }

#define TQ_STAGE(NAME, T, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32) NAME(                                          \
        T* kcs, T* vcs, T* kfs, T* vfs, const uint8_t* kc, const uint8_t* vc, const uint32_t* seq_info,          \
        const uint32_t* block_tables, const float* ktab, const float* vtab, const float* kscale, const T* new_k, \
        const T* new_v, const T* ring_k, const T* ring_v, const uint32_t* window_rings, int num_seqs,           \
        int num_kv_heads, int block_size, int kbits, int vbits, int kdense, int vdense, int window,             \
        int float_window, int skip, int seq0) {                                                                \
        tq_prefill_stage<T, D>(kcs, vcs, kfs, vfs, kc, vc, seq_info, block_tables, ktab, vtab, kscale, new_k,   \
                               new_v, ring_k, ring_v, window_rings, num_seqs, num_kv_heads, block_size, kbits,  \
                               vbits, kdense, vdense, window, float_window, skip, seq0);                        \
    }

#define PF_DIMS(M, NAME, N, T)                                                                                 \
    M(NAME##_##N##_64, T, 64) M(NAME##_##N##_80, T, 80) M(NAME##_##N##_96, T, 96)                            \
    M(NAME##_##N##_128, T, 128) M(NAME##_##N##_256, T, 256)

PF_DIMS(PF, prefill_attention, bf16, __nv_bfloat16)
PF_DIMS(PF, prefill_attention, f16, __half)
PF_DIMS(PF_MERGE, prefill_merge, bf16, __nv_bfloat16)
PF_DIMS(PF_MERGE, prefill_merge, f16, __half)
PF_DIMS(TQ_PF, tq_prefill_attention, bf16, __nv_bfloat16)
PF_DIMS(TQ_PF, tq_prefill_attention, f16, __half)
PF_DIMS(TQ_STAGE, tq_prefill_stage, bf16, __nv_bfloat16)
PF_DIMS(TQ_STAGE, tq_prefill_stage, f16, __half)
