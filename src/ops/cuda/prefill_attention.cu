// Attention for prompt chunks with tensor cores (bf16 / f16): the rows of sequences that
// compute many tokens at once, over the paged KV cache (prefill_attention: the same function as
// paged_attention.cu, see ops/paged_attention/mod.rs) or over TurboQuant codes (tq_prefill_attention:
// the same function as tq_attention.cu, see ops/tq_attention/). Scores are accumulated in f32
// from the exact products of the 16-bit inputs; probabilities are rounded to the input type for
// the P V product (as FlashAttention does); the output accumulates in f32.
//
// One block per (tile of up to 64 rows of one sequence, query head); 4 warps of 16 rows. Key
// tiles of 64 positions go through shared memory; each warp keeps its rows' running max and
// sum and its output rows (f32) in shared memory, rescaled when the max grows.
#include "tq_common.cuh"
#include <mma.h>

using namespace nvcuda;

#define PF_ROWS 64
#define PF_KEYS 64
#define PF_WARPS 4

template <int D> struct PfLayout {
    static constexpr int LD = D + 8;          // 16-bit rows of K, V, Q
    static constexpr int LS = PF_KEYS + 4;    // f32 score rows
    static constexpr int LP = PF_KEYS + 8;    // 16-bit probability rows
    static constexpr int LO = D + 4;          // f32 output rows
    static constexpr size_t K = 0;
    static constexpr size_t V = K + 2 * PF_KEYS * LD;
    static constexpr size_t Q = V + 2 * PF_KEYS * LD;
    static constexpr size_t S = Q + 2 * PF_ROWS * LD;
    static constexpr size_t P = S + 4 * PF_ROWS * LS;
    static constexpr size_t O = P + 2 * PF_ROWS * LP;
    static constexpr size_t BYTES = O + 4 * PF_ROWS * LO;  // = 640 D + 30720 (ops/paged_attention/mod.rs)
    // A warp's rotation scratch (tq_prefill_attention; 2 D floats) is its score rows, free
    // outside a tile's softmax.
    static_assert(16 * LS >= 2 * D, "the rotation scratch fits in a warp's score rows");
};

// A block's shared memory and the state of its warp's rows, as both kernels use them.
template <typename T, int D> struct PfBlock {
    using L = PfLayout<D>;
    T *K_s, *V_s, *Q_s, *P_w;
    float *S_w, *O_w;
    int warp, lane, half, row;  // row: this lane's row of the tile (two lanes per row)
    float m = -INFINITY, l = 0.f;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa[D / 16];

    __device__ __forceinline__ explicit PfBlock(unsigned char* smem) {
        K_s = reinterpret_cast<T*>(smem + L::K);
        V_s = reinterpret_cast<T*>(smem + L::V);
        Q_s = reinterpret_cast<T*>(smem + L::Q);
        const int tid = threadIdx.x;
        warp = tid / 32, lane = tid % 32, half = lane % 2, row = warp * 16 + lane / 2;
        S_w = reinterpret_cast<float*>(smem + L::S) + warp * 16 * L::LS;
        P_w = reinterpret_cast<T*>(smem + L::P) + warp * 16 * L::LP;
        O_w = reinterpret_cast<float*>(smem + L::O) + warp * 16 * L::LO;
    }

    // After Q_s is written and the block has synchronised: output rows zeroed, this warp's
    // query rows into fragments.
    __device__ __forceinline__ void start() {
        for (int i = lane; i < 16 * L::LO; i += 32) O_w[i] = 0.f;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) wmma::load_matrix_sync(qa[k], Q_s + (warp * 16) * L::LD + k * 16, L::LD);
        __syncwarp();
    }

    // The key tile at positions [k0, k0 + 64) (in K_s and V_s) joins this warp's rows'
    // softmax; this lane's row reads positions [a, b] of it (none when the row is past the
    // tile's rows: a > b).
    __device__ __forceinline__ void attend(int k0, int a, int b, float scale, float softcap) {
        // S = Q K^T for this warp's 16 rows.
#pragma unroll
        for (int n = 0; n < PF_KEYS / 16; ++n) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int k = 0; k < D / 16; ++k) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kb;
                wmma::load_matrix_sync(kb, K_s + (n * 16) * L::LD + k * 16, L::LD);
                wmma::mma_sync(acc, qa[k], kb, acc);
            }
            wmma::store_matrix_sync(S_w + n * 16, acc, L::LS, wmma::mem_row_major);
        }
        __syncwarp();
        // Running softmax over this key tile: each lane takes half a row.
        float x[PF_KEYS / 2];
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < PF_KEYS / 2; ++c) {
            const int col = half * (PF_KEYS / 2) + c;
            const int j = k0 + col;
            float v = S_w[(lane / 2) * L::LS + col] * scale;
            if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
            x[c] = j >= a && j <= b ? v : -INFINITY;
            mx = fmaxf(mx, x[c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float base = m_new == -INFINITY ? 0.f : m_new;
        const float corr = expf(m - base);
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < PF_KEYS / 2; ++c) {
            const float p = expf(x[c] - base);
            sum += p;
            P_w[(lane / 2) * L::LP + half * (PF_KEYS / 2) + c] = from_f<T>(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * corr + sum;
        m = m_new;
        for (int c = half; c < D; c += 2) O_w[(lane / 2) * L::LO + c] *= corr;
        __syncwarp();
        // O += P V.
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
            wmma::load_matrix_sync(o, O_w + dt * 16, L::LO, wmma::mem_row_major);
#pragma unroll
            for (int k = 0; k < PF_KEYS / 16; ++k) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
                wmma::load_matrix_sync(pa, P_w + k * 16, L::LP);
                wmma::load_matrix_sync(vb, V_s + (k * 16) * L::LD + dt * 16, L::LD);
                wmma::mma_sync(o, pa, vb, o);
            }
            wmma::store_matrix_sync(O_w + dt * 16, o, L::LO, wmma::mem_row_major);
        }
    }
};

// A tile's position bounds: its sequence's rows and this block's rows of it.
struct PfTile {
    int s, q_start, r0, n_rows, pos0;
};

__device__ __forceinline__ PfTile pf_tile(const uint32_t* tiles, const uint32_t* seq_info, int tile) {
    PfTile t;
    t.s = tiles[2 * tile];
    t.r0 = tiles[2 * tile + 1];
    t.q_start = seq_info[4 * t.s];
    const int q_len = seq_info[4 * t.s + 1], ctx = seq_info[4 * t.s + 2];
    t.n_rows = min(PF_ROWS, t.q_start + q_len - t.r0);
    t.pos0 = ctx - q_len + (t.r0 - t.q_start);  // position of the tile's first row
    return t;
}

// tiles: 2 u32 per tile: sequence, first row of the tile.
template <typename T, int D>
__device__ void prefill_attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc,
                                  const T* __restrict__ vc, const uint32_t* __restrict__ tiles,
                                  const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                  int num_heads, int num_kv_heads, int block_size, float scale, int window,
                                  float softcap) {
    using L = PfLayout<D>;
    constexpr int V16 = 8;  // 16-bit elements per 16-byte vector
    extern __shared__ __align__(128) unsigned char smem[];
    PfBlock<T, D> B(smem);
    const int tid = threadIdx.x;
    const PfTile tl = pf_tile(tiles, seq_info, blockIdx.x);
    const uint32_t* bt = block_tables + seq_info[4 * tl.s + 3];
    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int hi = tl.pos0 + tl.n_rows - 1;
    const int lo = window > 0 ? max(0, tl.pos0 + 1 - window) : 0;

    // Q tile (zero rows past the sequence).
    for (int i = tid; i < PF_ROWS * (D / V16); i += PF_WARPS * 32) {
        const int r = i / (D / V16), c = (i % (D / V16)) * V16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < tl.n_rows) v = *reinterpret_cast<const uint4*>(q + ((size_t)(tl.r0 + r) * num_heads + h) * D + c);
        *reinterpret_cast<uint4*>(B.Q_s + r * L::LD + c) = v;
    }
    __syncthreads();
    B.start();

    const int pos = tl.pos0 + B.row;
    const int row_lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int row_hi = B.row < tl.n_rows ? pos : -1;
    for (int k0 = lo; k0 <= hi; k0 += PF_KEYS) {
        for (int i = tid; i < PF_KEYS * (D / V16); i += PF_WARPS * 32) {
            const int r = i / (D / V16), c = (i % (D / V16)) * V16;
            const int j = k0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (j <= hi) {
                const size_t slot = (size_t)bt[j / block_size] * block_size + j % block_size;
                const size_t off = (slot * num_kv_heads + kvh) * D + c;
                kv = *reinterpret_cast<const uint4*>(kc + off);
                vv = *reinterpret_cast<const uint4*>(vc + off);
            }
            *reinterpret_cast<uint4*>(B.K_s + r * L::LD + c) = kv;
            *reinterpret_cast<uint4*>(B.V_s + r * L::LD + c) = vv;
        }
        __syncthreads();
        B.attend(k0, row_lo, row_hi, scale, softcap);
        __syncthreads();
    }
    if (B.row < tl.n_rows) {
        const float inv = 1.f / B.l;
        T* dst = out + ((size_t)(tl.r0 + B.row) * num_heads + h) * D;
        for (int c = B.half; c < D; c += 2) dst[c] = from_f<T>(B.O_w[(B.lane / 2) * L::LO + c] * inv);
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
    PfBlock<T, D> B(smem);
    pdl_launch_dependents();
    const int tid = threadIdx.x, warp = B.warp;
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
    float* x = B.S_w;  // this warp's rotation scratch (dense rotations): x[0, D), tmp[D, 2 D)
    __syncthreads();  // the tables

    // Q tile: each warp rotates its 16 rows, divided by the key scales (zero rows past the sequence).
    for (int r = warp * 16; r < warp * 16 + 16; ++r) {
        const T* qr = q + ((size_t)(tl.r0 + r) * num_heads + h) * D;
        const bool in = r < tl.n_rows;
        pf_rotate<D, false>([&](int c) { return in ? to_f(qr[c]) / kscale_s[c] : 0.f; },
                            [&](int c, float v) { B.Q_s[r * L::LD + c] = from_f<T>(v); }, krot, kdense != 0, x);
    }
    __syncthreads();
    B.start();

    const int pos = tl.pos0 + B.row;
    const bool live = B.row < tl.n_rows;
    const int row_split = tq_split_of(pos, window, float_window);

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
            *reinterpret_cast<uint4*>(B.K_s + r * L::LD + c) = kv;
            *reinterpret_cast<uint4*>(B.V_s + r * L::LD + c) = vv;
        }
        __syncthreads();
    };
    // The coded positions, [lo of the first row, split of the last).
    const int code_end = tq_split_of(hi, window, float_window);
    for (int k0 = tq_lo_of(tl.pos0, window); k0 < code_end; k0 += PF_KEYS) {
        load(kcs, vcs, k0, code_end, code_off - g.code_lo);
        B.attend(k0, tq_lo_of(pos, window), live ? row_split - 1 : -1, scale, softcap);
        __syncthreads();
    }
    // The float window's positions, [split of the first row, the last row's position].
    if (float_window > 0) {
        for (int k0 = tq_split_of(tl.pos0, window, float_window); k0 <= hi; k0 += PF_KEYS) {
            load(kfs, vfs, k0, hi + 1, float_off - g.float_lo);
            B.attend(k0, row_split, live ? pos : -1, scale, softcap);
            __syncthreads();
        }
    }

    // Each row's sum rotated back once (by its warp, a row at a time) and written.
    const float inv = live ? 1.f / B.l : 0.f;  // both lanes of a row hold it
    for (int rr = 0; rr < 16; ++rr) {
        const float f = __shfl_sync(0xffffffffu, inv, 2 * rr);
        const int r = warp * 16 + rr;
        T* dst = out + ((size_t)(tl.r0 + r) * num_heads + h) * D;
        pf_rotate<D, true>([&](int c) { return B.O_w[rr * L::LO + c] * f; },
                           [&](int c, float v) {
                               if (r < tl.n_rows) dst[c] = from_f<T>(v);
                           },
                           vrot, vdense != 0, x);
    }
}

#define PF(NAME, T, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32)                                                \
        NAME(T* out, const T* q, const T* kc, const T* vc, const uint32_t* tiles, const uint32_t* seq_info,    \
             const uint32_t* block_tables, int num_heads, int num_kv_heads, int block_size, float scale,        \
             int window, float softcap) {                                                                       \
        prefill_attention<T, D>(out, q, kc, vc, tiles, seq_info, block_tables, num_heads, num_kv_heads,         \
                                block_size, scale, window, softcap);                                           \
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
PF_DIMS(TQ_PF, tq_prefill_attention, bf16, __nv_bfloat16)
PF_DIMS(TQ_PF, tq_prefill_attention, f16, __half)
PF_DIMS(TQ_STAGE, tq_prefill_stage, bf16, __nv_bfloat16)
PF_DIMS(TQ_STAGE, tq_prefill_stage, f16, __half)
