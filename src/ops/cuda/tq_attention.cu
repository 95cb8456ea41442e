// Paged attention over TurboQuant codes for any mix of prefill chunks and decodes (see
// ops/tq_attention/, the reference). Row t of sequence s sits at position p and reads
// positions [lo, split) as codes and [split, p] from floats (the float window), where
// lo = p + 1 - window for sliding layers (else 0) and split = max(p + 1 - float_window, lo).
//
// Two kernels:
// - tq_attn_partial: one block per (row, group of query heads sharing a kv head, split of the
//   row's coded positions). It rotates its queries (divided by the key scales) once, scores
//   each key as norm * <R q, c[idx]> by codebook lookups (one thread per key), keeps a running
//   softmax, and sums p * norm * c[idx] of the values in the rotated space. It writes
//   (max, sum, rotated values) per head and split.
// - tq_attn_combine: one block per (row, query head). It merges the splits, rotates the sum
//   back once, adds the float window's positions (this step's rows, or the sequence's ring)
//   to the same softmax, and writes the output.
// Splits let a single long decode use the whole GPU; the number of splits is fixed by the
// launch (rows and heads only, so a CUDA graph replays it at any context length) and a split
// covers at least `min_chunk` positions, so short contexts leave the extra blocks idle.
//
// A decode step's attention is a chain of dependent memory round trips more than arithmetic
// (measured on an H200: ~0.5-1.5 us each), so both kernels read the tables that never change
// (codebooks, rotation signs, key scales) before waiting on the kernel before them, and issue
// their other loads in as few rounds as they can.
#include "tq_common.cuh"

#define TA_THREADS 128
#define TA_MAXH 8
#define TA_MAXSPLIT 64
#define TC_THREADS 512

// Position bounds of row t: (first position of its sequence's chunk, end = p + 1, lo, split).
struct TqRow {
    int s, q_start, first, end, lo, split;
};

__device__ __forceinline__ TqRow tq_row(int t, const uint32_t* row_seq, const uint32_t* seq_info, int window,
                                        int float_window) {
    TqRow r;
    r.s = row_seq[t];
    r.q_start = seq_info[4 * r.s];
    const int q_len = seq_info[4 * r.s + 1], ctx = seq_info[4 * r.s + 2];
    r.first = ctx - q_len;
    r.end = r.first + (t - r.q_start) + 1;
    r.lo = window > 0 ? max(0, r.end - window) : 0;
    r.split = max(r.end - float_window, r.lo);
    return r;
}

__device__ __forceinline__ float tq_logit(float dot, float scale, float softcap) {
    float x = dot * scale;
    if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
    return x;
}


// part: [rows, num_heads, nsplit, D + 2] f32: per split its max logit m (-inf: no position),
// sum of exp(logit - m), and the values weighted by exp(logit - m) in the rotated space (zeros
// for a split without positions, so that the combine may read every split unconditionally).
template <typename TQ, int D>
__device__ void tq_attn_partial(float* __restrict__ part, const TQ* __restrict__ q, const uint8_t* __restrict__ kc,
                                const uint8_t* __restrict__ vc, const uint32_t* __restrict__ row_seq,
                                const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                const float* __restrict__ ktab, const float* __restrict__ vtab,
                                const float* __restrict__ kscale, int num_heads, int num_kv_heads, int hb,
                                int block_size, int kbits, int vbits, int kdense, float scale, int window,
                                float softcap, int float_window, int nsplit, int min_chunk) {
    constexpr int G = D / 8;             // groups of 8 coordinates (whole bytes of codes)
    constexpr int KG = TA_THREADS / G;   // keys accumulated at once in the value phase
    constexpr int VPRE = G < 16 ? G : 16;  // of a thread's G value rows per chunk, loaded ahead
    static_assert(D % 8 == 0 && G <= TA_THREADS, "head_dim must be a multiple of 8, at most 8 * TA_THREADS");

    __shared__ __align__(16) float qr_s[TA_MAXH][D];
    __shared__ float tmp_s[TA_MAXH][D];  // rotation scratch, then the block's value sums
    __shared__ float p_s[TA_MAXH][TA_THREADS];
    __shared__ int slot_s[TA_THREADS];
    __shared__ float vn_s[TA_THREADS];
    __shared__ float m_s[TA_MAXH], l_s[TA_MAXH], corr_s[TA_MAXH];
    __shared__ float ktab_s[16], vtab_s[16], sign_s[2 * D], kscale_s[D];

    pdl_launch_dependents();
    const int t = blockIdx.x, z = blockIdx.z;
    const int group = num_heads / num_kv_heads, per_kv = group / hb;
    const int kvh = blockIdx.y / per_kv;
    const int h0 = kvh * group + (blockIdx.y % per_kv) * hb;
    const int tid = threadIdx.x;
    // Written once at start-up, not by the kernels before: read before the wait.
    if (tid < 16) { ktab_s[tid] = ktab[TQ_CENTROIDS + tid]; vtab_s[tid] = vtab[TQ_CENTROIDS + tid]; }
    if (!kdense)
        for (int i = tid; i < 2 * D; i += TA_THREADS) sign_s[i] = ktab[TQ_ROTATION + i];
    for (int i = tid; i < D; i += TA_THREADS) kscale_s[i] = kscale ? kscale[kvh * D + i] : 1.f;
    pdl_wait();  // launched as a dependent (ops/tq_attention/cuda.rs): inputs after this

    const TqRow r = tq_row(t, row_seq, seq_info, window, float_window);
    const uint32_t* bt = block_tables + seq_info[4 * r.s + 3];
    const int n = r.split - r.lo;
    const int chunk = max((n + nsplit - 1) / nsplit, min_chunk);
    const int a = r.lo + z * chunk, b = min(a + chunk, r.split);
    float* out = part + (((size_t)t * num_heads + h0) * nsplit + z) * (D + 2);
    const size_t head_stride = (size_t)nsplit * (D + 2);
    if (a >= b) {  // the whole block: nothing in this split
        for (int i = tid; i < hb * (D + 2); i += TA_THREADS) {
            const int h = i / (D + 2), c = i % (D + 2);
            out[h * head_stride + c] = c == 0 ? -INFINITY : 0.f;
        }
        return;
    }

    const int kcb = D * kbits / 8, vcb = D * vbits / 8;
    const int krow = kcb + 4, vrow = vcb + 4;
    const uint32_t kmask = (1u << kbits) - 1, vmask = (1u << vbits) - 1;
    const int kg = tid / G, gi = tid % G;
    const bool pv = kg < KG;
    auto slot_of = [&](int j) { return (int)bt[j / block_size] * block_size + j % block_size; };
    // A chunk's codes: this thread's key (all its groups), its value norm, and the first VPRE
    // value groups this thread accumulates, all in flight together.
    uint32_t kw[G], vw[VPRE];
    float kn = 0.f, vn = 0.f;
    int slot = 0;
    auto load_keys = [&](int c0) {
        const int j = c0 + tid;
        if (j < b) {
            slot = slot_of(j);
            const uint8_t* kr = kc + ((size_t)slot * num_kv_heads + kvh) * krow;
#pragma unroll
            for (int g = 0; g < G; ++g) kw[g] = tq_codes8(kr, g, kbits);
            kn = tq_norm(kr, kcb);
            vn = tq_norm(vc + ((size_t)slot * num_kv_heads + kvh) * vrow, vcb);
        }
    };
    auto load_values = [&](int c0) {
#pragma unroll
        for (int u = 0; u < VPRE; ++u) {
            const int j = c0 + kg + u * KG;
            vw[u] = pv && j < b ? tq_codes8(vc + ((size_t)slot_of(j) * num_kv_heads + kvh) * vrow, gi, vbits) : 0u;
        }
    };
    load_keys(a);
    load_values(a);

    // The queries, divided by the key scales and rotated (a warp per head: no block-wide
    // barrier between the butterflies' stages) while the codes are on their way.
    for (int i = tid; i < hb * D; i += TA_THREADS) {
        const int h = i / D, c = i % D;
        qr_s[h][c] = to_f(q[((size_t)t * num_heads + h0 + h) * D + c]) / kscale_s[c];
    }
    if (tid < TA_MAXH) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
    __syncthreads();
    const float* krot = kdense ? ktab + TQ_ROTATION : sign_s;
    for (int h = tid / 32; h < hb; h += TA_THREADS / 32) tq_rotate<true, D>(&qr_s[h][0], &tmp_s[h][0], 1, krot, kdense != 0);
    __syncthreads();
    for (int i = tid; i < hb * D; i += TA_THREADS) tmp_s[i / D][i % D] = 0.f;

    float acc[TA_MAXH][8];
#pragma unroll
    for (int h = 0; h < TA_MAXH; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;

    for (int c0 = a; c0 < b; c0 += TA_THREADS) {
        const int j = c0 + tid;
        if (j < b) {
            slot_s[tid] = slot;
            vn_s[tid] = vn;
            float sc[TA_MAXH];
#pragma unroll
            for (int h = 0; h < TA_MAXH; ++h) sc[h] = 0.f;
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float c = ktab_s[(kw[g] >> (e * kbits)) & kmask];
#pragma unroll
                    for (int h = 0; h < TA_MAXH; ++h)
                        if (h < hb) sc[h] = fmaf(qr_s[h][g * 8 + e], c, sc[h]);
                }
            }
#pragma unroll
            for (int h = 0; h < TA_MAXH; ++h)
                if (h < hb) p_s[h][tid] = tq_logit(kn * sc[h], scale, softcap);
        } else {
            for (int h = 0; h < hb; ++h) p_s[h][tid] = -INFINITY;
        }
        if (c0 + TA_THREADS < b) load_keys(c0 + TA_THREADS);  // the next chunk's keys, ahead
        __syncthreads();
        softmax_chunk<TA_THREADS, TA_THREADS, TA_THREADS / 32>(&p_s[0][0], hb, m_s, l_s, corr_s);
        __syncthreads();
        if (pv) {
#pragma unroll
            for (int h = 0; h < TA_MAXH; ++h) {
                if (h < hb) {
                    const float c = corr_s[h];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[h][e] *= c;
                }
            }
            const int nk = min(TA_THREADS, b - c0);
            auto add_value = [&](int jj, uint32_t w) {
                const float vnj = vn_s[jj];
                float cv[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) cv[e] = vtab_s[(w >> (e * vbits)) & vmask];
#pragma unroll
                for (int h = 0; h < TA_MAXH; ++h) {
                    if (h < hb) {
                        const float p = p_s[h][jj] * vnj;
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(p, cv[e], acc[h][e]);
                    }
                }
            };
#pragma unroll
            for (int u = 0; u < VPRE; ++u)
                if (kg + u * KG < nk) add_value(kg + u * KG, vw[u]);
            // The rest of the thread's rows (head dims past 128), loaded now, in batches.
            constexpr int VB = 8;
            for (int j0 = kg + VPRE * KG; j0 < nk; j0 += VB * KG) {
                uint32_t w[VB];
#pragma unroll
                for (int u = 0; u < VB; ++u) {
                    const int jj = j0 + u * KG;
                    w[u] = jj < nk ? tq_codes8(vc + ((size_t)slot_s[jj] * num_kv_heads + kvh) * vrow, gi, vbits) : 0u;
                }
#pragma unroll
                for (int u = 0; u < VB; ++u)
                    if (j0 + u * KG < nk) add_value(j0 + u * KG, w[u]);
            }
        }
        __syncthreads();
        if (c0 + TA_THREADS < b) load_values(c0 + TA_THREADS);
    }
    // The key groups' sums, added in a fixed order (no atomics: a row's result does not
    // depend on the threads' timing).
    for (int g = 0; g < KG; ++g) {
        if (pv && kg == g) {
#pragma unroll
            for (int h = 0; h < TA_MAXH; ++h)
                if (h < hb)
#pragma unroll
                    for (int e = 0; e < 8; ++e) tmp_s[h][gi * 8 + e] += acc[h][e];
        }
        __syncthreads();
    }
    for (int i = tid; i < hb * (D + 2); i += TA_THREADS) {
        const int h = i / (D + 2), c = i % (D + 2);
        out[h * head_stride + c] = c == 0 ? m_s[h] : c == 1 ? l_s[h] : tmp_s[h][c - 2];
    }
}

template <int WARPS>
__device__ __forceinline__ float block_max(float x, float* red) {
    x = warp_max(x);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < WARPS; ++w) r = fmaxf(r, red[w]);
    __syncthreads();
    return r;
}

template <int WARPS>
__device__ __forceinline__ float block_sum(float x, float* red) {
    x = warp_sum(x);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    float r = 0.f;
    for (int w = 0; w < WARPS; ++w) r += red[w];
    __syncthreads();
    return r;
}

// A float-window vector of kv head `kvh` at position j: this step's row (rounded to the ring's
// type, so it reads the same before and after it moves into the ring) or the ring's.
template <typename TQ, typename TR>
__device__ __forceinline__ float tq_float_at(const TQ* fresh, const TR* ring, const TqRow& r, int j, int ring_idx,
                                             int float_window, int num_kv_heads, int kvh, int D, int c) {
    if (j < r.first) {
        const size_t row = (size_t)ring_idx * float_window + j % float_window;
        return to_f(ring[(row * num_kv_heads + kvh) * D + c]);
    }
    const size_t row = (size_t)r.q_start + (j - r.first);
    return to_f(from_f<TR>(to_f(fresh[(row * num_kv_heads + kvh) * D + c])));
}

template <typename TQ, typename TR, int D>
__device__ void tq_attn_combine(TQ* __restrict__ out, const TQ* __restrict__ q, const float* __restrict__ part,
                                const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ seq_info,
                                const float* __restrict__ vtab, const TQ* __restrict__ new_k,
                                const TQ* __restrict__ new_v, const TR* __restrict__ ring_k,
                                const TR* __restrict__ ring_v, const uint32_t* __restrict__ window_rings,
                                int num_heads, int num_kv_heads, float scale, int window, float softcap,
                                int float_window, int nsplit, int vdense) {
    constexpr int PER = (D + TC_THREADS - 1) / TC_THREADS;  // output coordinates per thread
    constexpr int ZQ = TC_THREADS / D;                          // threads per coordinate (split ranges)
    constexpr int ZPT = (TA_MAXSPLIT + ZQ - 1) / ZQ;            // splits per thread
    static_assert(D <= TC_THREADS, "a thread per coordinate at least");
    __shared__ float o_s[D], tmp_s[D], q_s[D], p_s[TC_THREADS], red_s[TC_THREADS / 32], sign_s[2 * D];
    __shared__ float m_s[TA_MAXSPLIT], w_s[TA_MAXSPLIT], sum_s[ZQ][D], ml_s[2];
    pdl_launch_dependents();
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (!vdense)  // written once at start-up: read before the wait
        for (int i = tid; i < 2 * D; i += TC_THREADS) sign_s[i] = vtab[TQ_ROTATION + i];
    pdl_wait();  // launched as a dependent: the partial states after this

    // The coded positions: every split's max and sum and this thread's coordinate of its sums
    // for its range of splits, all loaded in one round (a split without positions holds -inf,
    // 0 and zeros), then merged in split order and rotated back once.
    const float* pp = part + ((size_t)t * num_heads + h) * nsplit * (D + 2);
    const int c = tid % D, zq = tid / D;  // threads past ZQ * D only help with the rest
    float v[ZPT];
#pragma unroll
    for (int k = 0; k < ZPT; ++k) {
        const int z = zq * ZPT + k;
        v[k] = zq < ZQ && z < nsplit ? __ldcg(pp + (size_t)z * (D + 2) + 2 + c) : 0.f;
    }
    float lz = 0.f;
    if (tid < TA_MAXSPLIT) {
        m_s[tid] = tid < nsplit ? __ldcg(pp + (size_t)tid * (D + 2)) : -INFINITY;
        lz = tid < nsplit ? __ldcg(pp + (size_t)tid * (D + 2) + 1) : 0.f;
    }
    __syncthreads();
    if (tid < 32) {
        float M = -INFINITY;
        for (int z = tid; z < TA_MAXSPLIT; z += 32) M = fmaxf(M, m_s[z]);
        M = warp_max(M);
        if (tid == 0) ml_s[0] = M;
    }
    __syncthreads();
    float M = ml_s[0];
    if (tid < TA_MAXSPLIT) {
        const float e = m_s[tid] == -INFINITY ? 0.f : expf(m_s[tid] - M);
        w_s[tid] = e;
        float l = warp_sum(lz * e);  // lanes 0-31 and 32-63: two warps
        if ((tid & 31) == 0) red_s[tid >> 5] = l;
    }
    __syncthreads();
    if (tid == 0) ml_s[1] = red_s[0] + red_s[1];
    if (zq < ZQ) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < ZPT; ++k)
            if (zq * ZPT + k < TA_MAXSPLIT) s = fmaf(v[k], w_s[zq * ZPT + k], s);
        sum_s[zq][c] = s;
    }
    __syncthreads();
    float L = ml_s[1];
    if (tid < D) {
        float o = 0.f;
        for (int g = 0; g < ZQ; ++g) o += sum_s[g][tid];
        o_s[tid] = o;
    }
    tq_rotate_inverse<false, D>(o_s, tmp_s, 1, vdense ? vtab + TQ_ROTATION : sign_s, vdense != 0);
    float acc[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) acc[k] = tid + k * TC_THREADS < D ? o_s[tid + k * TC_THREADS] : 0.f;

    // The float window's positions, folded into the same softmax.
    const TqRow r = tq_row(t, row_seq, seq_info, window, float_window);
    const int kvh = h / (num_heads / num_kv_heads);
    if (r.split < r.end) {
        const int ring_idx = window_rings[r.s];
        for (int c = tid; c < D; c += TC_THREADS) q_s[c] = to_f(q[((size_t)t * num_heads + h) * D + c]);
        __syncthreads();
        for (int c0 = r.split; c0 < r.end; c0 += TC_THREADS) {
            const int j = c0 + tid;
            float x = -INFINITY;
            if (j < r.end) {
                float dot = 0.f;
                for (int c = 0; c < D; ++c)
                    dot = fmaf(q_s[c], tq_float_at(new_k, ring_k, r, j, ring_idx, float_window, num_kv_heads, kvh, D, c),
                               dot);
                x = tq_logit(dot, scale, softcap);
            }
            const float mn = fmaxf(M, block_max<TC_THREADS / 32>(x, red_s));
            const float corr = expf(M - mn);
            const float p = j < r.end ? expf(x - mn) : 0.f;
            p_s[tid] = p;
            L = L * corr + block_sum<TC_THREADS / 32>(p, red_s);  // its barrier also publishes p_s
            M = mn;
            const int nk = min(TC_THREADS, r.end - c0);
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const int c = tid + k * TC_THREADS;
                if (c >= D) continue;
                float a = acc[k] * corr;
                for (int jj = 0; jj < nk; ++jj)
                    a = fmaf(p_s[jj],
                             tq_float_at(new_v, ring_v, r, c0 + jj, ring_idx, float_window, num_kv_heads, kvh, D, c), a);
                acc[k] = a;
            }
            __syncthreads();
        }
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int c = tid + k * TC_THREADS;
        if (c < D) out[((size_t)t * num_heads + h) * D + c] = from_f<TQ>(acc[k] / L);
    }
}

#define TQ_PARTIAL(NAME, TQ, D)                                                                                \
    extern "C" __global__ void __launch_bounds__(TA_THREADS) NAME(                                            \
        float* part, const TQ* q, const uint8_t* kc, const uint8_t* vc, const uint32_t* row_seq,              \
        const uint32_t* seq_info, const uint32_t* block_tables, const float* ktab, const float* vtab,         \
        const float* kscale, int num_heads, int num_kv_heads, int hb, int block_size, int kbits, int vbits,   \
        int kdense, float scale, int window, float softcap, int float_window, int nsplit, int min_chunk) {    \
        tq_attn_partial<TQ, D>(part, q, kc, vc, row_seq, seq_info, block_tables, ktab, vtab, kscale,          \
                               num_heads, num_kv_heads, hb, block_size, kbits, vbits, kdense, scale, window,  \
                               softcap, float_window, nsplit, min_chunk);                                     \
    }

#define TQ_COMBINE(NAME, TQ, TR, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) NAME(                                            \
        TQ* out, const TQ* q, const float* part, const uint32_t* row_seq, const uint32_t* seq_info,           \
        const float* vtab, const TQ* new_k, const TQ* new_v, const TR* ring_k, const TR* ring_v,              \
        const uint32_t* window_rings, int num_heads, int num_kv_heads, float scale, int window, float softcap, \
        int float_window, int nsplit, int vdense) {                                                           \
        tq_attn_combine<TQ, TR, D>(out, q, part, row_seq, seq_info, vtab, new_k, new_v, ring_k, ring_v,       \
                                   window_rings, num_heads, num_kv_heads, scale, window, softcap,             \
                                   float_window, nsplit, vdense);                                             \
    }

#define TQ_DIMS(M, ...)                                                                                        \
    M(16, __VA_ARGS__) M(32, __VA_ARGS__) M(64, __VA_ARGS__) M(80, __VA_ARGS__) M(96, __VA_ARGS__)            \
    M(128, __VA_ARGS__) M(256, __VA_ARGS__)

#define TQ_PARTIAL_D(D, N, TQ) TQ_PARTIAL(tq_attn_partial_##N##_##D, TQ, D)
#define TQ_COMBINE_D(D, N, R, TQ, TR) TQ_COMBINE(tq_attn_combine_##N##_##R##_##D, TQ, TR, D)

TQ_DIMS(TQ_PARTIAL_D, f32, float)
TQ_DIMS(TQ_PARTIAL_D, bf16, __nv_bfloat16)
TQ_DIMS(TQ_PARTIAL_D, f16, __half)
TQ_DIMS(TQ_COMBINE_D, f32, f32, float, float)
TQ_DIMS(TQ_COMBINE_D, f32, bf16, float, __nv_bfloat16)
TQ_DIMS(TQ_COMBINE_D, f32, f16, float, __half)
TQ_DIMS(TQ_COMBINE_D, bf16, bf16, __nv_bfloat16, __nv_bfloat16)
TQ_DIMS(TQ_COMBINE_D, f16, f16, __half, __half)
