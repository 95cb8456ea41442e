// Attention of the rows that compute few tokens (decodes, speculative verification, short
// chunks) over the paged KV cache on tensor cores, bf16 / f16: the same function as
// paged_attention.cu (see ops/paged_attention/mod.rs), with the arithmetic of
// prefill_attention.cu (flash.cuh).
//
// The query heads that share a KV head (GQA) are the rows of one m16 tile, so each key and value
// is read from memory once for all of them, not once per head: at long contexts the KV cache is
// most of what a decode step reads. One block per (row, KV head, tile of up to 16 of its query
// heads, split): key tiles of 64 positions go through shared memory (cp.async, GD_STAGES deep),
// and each of the 4 warps takes 16 keys of every tile with its own running softmax; at the end
// the warps' states are merged in warp order.
//
// Long contexts: a row's key tiles are split over blocks (grid z), each a contiguous run of
// tiles. How many depends on the row's own key count only (gd_splits: one block per
// `min_tiles` tiles, at most `max_splits`), never on the rest of the batch, and the split
// states are merged in split order, so a row gives the same bits in any batch. The merge is
// done by the last block of a row's splits to finish (arrival counters) or by
// gqa_decode_merge.
#include "flash.cuh"

#define GD_KEYS 64
#define GD_WARPS 4
#define GD_HEADS 16
#define GD_STAGES 3
#define GD_MAX_SPLITS 64

template <int D> struct GdLayout {
    static constexpr int LD = flash_ld(D);
    static constexpr size_t Q = 0;
    static constexpr size_t KV = Q + 2 * GD_HEADS * LD;     // then the stages of (K tile, V tile)
    static constexpr size_t STAGE = 2 * 2 * GD_KEYS * LD;   // bytes of one stage
    static constexpr size_t BYTES = KV + GD_STAGES * STAGE;  // = (32 + 256 GD_STAGES)(D + 8) (ops/cuda/mod.rs)
    // Once the keys are done, in the stages: each warp's normalised output rows (f32), then
    // their maxima (log2 units) and sums.
    static constexpr size_t O = KV;
    static constexpr size_t M = O + 4 * GD_WARPS * GD_HEADS * D;
    static constexpr size_t S = M + 4 * GD_WARPS * GD_HEADS;
    static_assert(S + 4 * GD_WARPS * GD_HEADS <= BYTES, "the warps' states fit in the stages");
};

// What a row attends to, and the blocks its keys are split over.
struct GdRow {
    int pos, lo, hi, tiles, splits;
    bool skip;  // a prompt chunk, done by prefill_attention.cu
    __device__ __forceinline__ GdRow(int t, const uint32_t* row_seq, const uint32_t* seq_info,
                                     const uint32_t* row_end, int bidi, int window, int skip_q_len, int max_splits,
                                     int min_tiles) {
        const uint32_t s = row_seq[t];
        const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
        skip = q_len >= skip_q_len;
        pos = ctx - q_len + (t - q_start);
        lo = window > 0 ? max(0, pos + 1 - window) : 0;
        hi = bidi ? max(pos, (int)row_end[t] - 1) : pos;  // the last key the row sees
        tiles = (hi - lo) / GD_KEYS + 1;
        splits = max(1, min(min(max_splits, GD_MAX_SPLITS), (tiles + min_tiles - 1) / min_tiles));
    }
};

// A split block's state of (row t, head h) in `part`: its normalised output, then its max (log2
// units) and sum.
template <int D>
__device__ __forceinline__ size_t gd_part(int t, int h, int z, int num_heads, int max_splits) {
    return (((size_t)t * num_heads + h) * max_splits + z) * (D + 2);
}

// The split states of row t's heads [h0, h0 + nh) into their outputs, in split order. The states
// may come from other blocks of this launch: read past L1.
template <typename T, int D>
__device__ void gd_merge(T* __restrict__ out, const float* part, int t, int h0, int nh, int splits, int num_heads,
                         int max_splits) {
    __shared__ float w_s[GD_HEADS][GD_MAX_SPLITS];
    __shared__ float inv_s[GD_HEADS];
    const int tid = threadIdx.x, threads = blockDim.x;
    if (tid < nh) {
        float mx = -INFINITY;
        for (int z = 0; z < splits; ++z) mx = fmaxf(mx, __ldcg(part + gd_part<D>(t, h0 + tid, z, num_heads, max_splits) + D));
        float sum = 0.f;
        for (int z = 0; z < splits; ++z) {
            const float* p = part + gd_part<D>(t, h0 + tid, z, num_heads, max_splits);
            const float l = __ldcg(p + D + 1);
            const float w = l > 0.f ? l * exp2f(__ldcg(p + D) - mx) : 0.f;
            w_s[tid][z] = w;
            sum += w;
        }
        inv_s[tid] = 1.f / sum;
    }
    __syncthreads();
    for (int i = tid; i < nh * D; i += threads) {
        const int r = i / D, c = i % D;
        float acc = 0.f;
        for (int z = 0; z < splits; ++z)
            acc = fmaf(w_s[r][z], __ldcg(part + gd_part<D>(t, h0 + r, z, num_heads, max_splits) + c), acc);
        out[((size_t)t * num_heads + h0 + r) * D + c] = from_f<T>(acc * inv_s[r]);
    }
}

// The block's query heads: [h0, h0 + nh), of KV head kvh.
struct GdHeads {
    int kvh, h0, nh;
    __device__ __forceinline__ GdHeads(int y, int num_heads, int num_kv_heads) {
        const int group = num_heads / num_kv_heads;
        const int per_kv = (group + GD_HEADS - 1) / GD_HEADS;
        kvh = y / per_kv;
        const int g0 = (y % per_kv) * GD_HEADS;
        nh = min(GD_HEADS, group - g0);
        h0 = kvh * group + g0;
    }
};

template <typename T, int D>
__device__ void gqa_decode(T* __restrict__ out, uint32_t* __restrict__ counters, float* __restrict__ part,
                           const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                           const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ seq_info,
                           const uint32_t* __restrict__ block_tables, const uint32_t* __restrict__ row_end, int bidi,
                           int num_heads, int num_kv_heads, int block_size, float scale, int window, float softcap,
                           int skip_q_len, int max_splits, int min_tiles) {
    using L = GdLayout<D>;
    constexpr int V16 = 8;  // 16-bit elements per 16-byte vector
    extern __shared__ __align__(128) unsigned char smem[];
    pdl_launch_dependents();  // the output projection may start streaming its weights
    pdl_wait();               // launched as a dependent (ops/paged_attention/mod.rs): q, the cache after this
    const int t = blockIdx.x, z = blockIdx.z, tid = threadIdx.x, warp = tid / 32;
    const GdRow row(t, row_seq, seq_info, row_end, bidi, window, skip_q_len, max_splits, min_tiles);
    if (row.skip || z >= row.splits) return;
    const GdHeads hd(blockIdx.y, num_heads, num_kv_heads);
    const uint32_t s = row_seq[t];
    const uint32_t* bt = block_tables + seq_info[4 * s + 3];

    T* Q_s = reinterpret_cast<T*>(smem + L::Q);
    for (int i = tid; i < GD_HEADS * (D / V16); i += GD_WARPS * 32) {
        const int r = i / (D / V16), c = (i % (D / V16)) * V16;
        cp_async16(Q_s + r * L::LD + c, q + ((size_t)t * num_heads + hd.h0 + min(r, hd.nh - 1)) * D + c, r < hd.nh);
    }
    // Key tile kt into stage st: K then V, zeros past the row's last key.
    auto load = [&](int kt, int st) {
        T* K_s = reinterpret_cast<T*>(smem + L::KV + st * L::STAGE);
        T* V_s = K_s + GD_KEYS * L::LD;
        const int k0 = row.lo + kt * GD_KEYS;
        for (int i = tid; i < GD_KEYS * (D / V16); i += GD_WARPS * 32) {
            const int r = i / (D / V16), c = (i % (D / V16)) * V16;
            const int j = k0 + r;
            const size_t slot = j <= row.hi ? (size_t)bt[j / block_size] * block_size + j % block_size : 0;
            const size_t off = (slot * num_kv_heads + hd.kvh) * D + c;
            cp_async16(K_s + r * L::LD + c, kc + off, j <= row.hi);
            cp_async16(V_s + r * L::LD + c, vc + off, j <= row.hi);
        }
    };
    const int t0 = z * row.tiles / row.splits, t1 = (z + 1) * row.tiles / row.splits;
    // The first GD_STAGES - 1 tiles in flight (the Q tile with the first); a group per tile,
    // empty past the last, so that the wait below counts tiles.
#pragma unroll
    for (int i = 0; i < GD_STAGES - 1; ++i) {
        if (t0 + i < t1) load(t0 + i, i);
        cp_async_commit_group();
    }

    FlashWarp<T, D> W(Q_s, 0);
    const int a[2] = {row.lo, row.lo}, b[2] = {row.hi, row.hi};
    for (int kt = t0; kt < t1; ++kt) {
        cp_async_wait_group<GD_STAGES - 2>();  // tile kt has landed
        __syncthreads();                       // for every warp; and all are done with tile kt - 1
        const int next = kt + GD_STAGES - 1;
        if (next < t1) load(next, (next - t0) % GD_STAGES);  // into tile kt - 1's stage
        cp_async_commit_group();
        const T* K_s = reinterpret_cast<const T*>(smem + L::KV + ((kt - t0) % GD_STAGES) * L::STAGE) + warp * 16 * L::LD;
        W.template attend<16>(K_s, K_s + GD_KEYS * L::LD, row.lo + kt * GD_KEYS + warp * 16, a, b, scale, softcap);
    }
    cp_async_wait_group<0>();
    __syncthreads();  // the stages are free for the warps' states

    float* O_s = reinterpret_cast<float*>(smem + L::O);
    float* M_s = reinterpret_cast<float*>(smem + L::M);
    float* S_s = reinterpret_cast<float*>(smem + L::S);
    W.finish();
    W.each_output([&](int i, int c, float v0, float v1) {
        *reinterpret_cast<float2*>(O_s + (warp * GD_HEADS + W.row(i)) * D + c) = make_float2(v0, v1);
    });
    if ((W.lane & 3) == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            M_s[warp * GD_HEADS + W.row(i)] = W.m[i];
            S_s[warp * GD_HEADS + W.row(i)] = W.l[i];
        }
    }
    __syncthreads();
    // The warps' states in warp order: this block's output, or its split's state.
    for (int i = tid; i < hd.nh * D; i += GD_WARPS * 32) {
        const int r = i / D, c = i % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < GD_WARPS; ++w) mx = fmaxf(mx, M_s[w * GD_HEADS + r]);
        float acc = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < GD_WARPS; ++w) {
            const float l = S_s[w * GD_HEADS + r];
            const float wt = l > 0.f ? l * exp2f(M_s[w * GD_HEADS + r] - mx) : 0.f;  // a warp with no key: 0
            acc = fmaf(wt, O_s[(w * GD_HEADS + r) * D + c], acc);
            sum += wt;
        }
        if (row.splits == 1) {
            out[((size_t)t * num_heads + hd.h0 + r) * D + c] = from_f<T>(acc / sum);
        } else {
            float* p = part + gd_part<D>(t, hd.h0 + r, z, num_heads, max_splits);
            p[c] = acc / sum;
            if (c == 0) { p[D] = mx; p[D + 1] = sum; }
        }
    }
    if (row.splits == 1 || !counters) return;  // written, or gqa_decode_merge follows
    // The last of the row's split blocks to finish merges their states and resets the counter
    // for the next launch.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    const size_t rb = (size_t)t * gridDim.y + blockIdx.y;
    if (tid == 0) last = atomicAdd(counters + rb, 1u) == (unsigned)row.splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    gd_merge<T, D>(out, part, t, hd.h0, hd.nh, row.splits, num_heads, max_splits);
    if (tid == 0) counters[rb] = 0;
}

// The merge as a kernel of its own (when gqa_decode had no counters): grid (rows, KV heads x
// head tiles), as gqa_decode's first two dimensions.
template <typename T, int D>
__device__ void gqa_decode_merge(T* __restrict__ out, const float* __restrict__ part,
                                 const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ seq_info,
                                 const uint32_t* __restrict__ row_end, int bidi, int num_heads, int num_kv_heads,
                                 int window, int skip_q_len, int max_splits, int min_tiles) {
    pdl_launch_dependents();
    pdl_wait();  // launched as a dependent: the split states after this
    const int t = blockIdx.x;
    const GdRow row(t, row_seq, seq_info, row_end, bidi, window, skip_q_len, max_splits, min_tiles);
    if (row.skip || row.splits == 1) return;
    const GdHeads hd(blockIdx.y, num_heads, num_kv_heads);
    gd_merge<T, D>(out, part, t, hd.h0, hd.nh, row.splits, num_heads, max_splits);
}

#define GD(T, TN, D)                                                                                           \
    extern "C" __global__ void __launch_bounds__(GD_WARPS * 32)                                                \
        gqa_decode_##TN##_##D(T* out, uint32_t* counters, float* part, const T* q, const T* kc, const T* vc,   \
                              const uint32_t* row_seq, const uint32_t* seq_info, const uint32_t* block_tables, \
                              const uint32_t* row_end, int bidi, int num_heads, int num_kv_heads, int block_size, \
                              float scale, int window, float softcap, int skip_q_len, int max_splits,         \
                              int min_tiles) {                                                                 \
        gqa_decode<T, D>(out, counters, part, q, kc, vc, row_seq, seq_info, block_tables, row_end, bidi,        \
                         num_heads, num_kv_heads, block_size, scale, window, softcap, skip_q_len, max_splits,   \
                         min_tiles);                                                                           \
    }                                                                                                          \
    extern "C" __global__ void gqa_decode_merge_##TN##_##D(                                                    \
        T* out, const float* part, const uint32_t* row_seq, const uint32_t* seq_info, const uint32_t* row_end, \
        int bidi, int num_heads, int num_kv_heads, int window, int skip_q_len, int max_splits, int min_tiles) {  \
        gqa_decode_merge<T, D>(out, part, row_seq, seq_info, row_end, bidi, num_heads, num_kv_heads, window,    \
                               skip_q_len, max_splits, min_tiles);                                             \
    }
#define GD_DIMS(T, TN) GD(T, TN, 64) GD(T, TN, 80) GD(T, TN, 96) GD(T, TN, 128) GD(T, TN, 256)

GD_DIMS(__nv_bfloat16, bf16)
GD_DIMS(__half, f16)
