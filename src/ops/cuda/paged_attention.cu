// Attention over a paged KV cache for a flat batch of any mix of prefill chunks and decodes
// (see ops/paged_attention/mod.rs, the reference). Row t of sequence s sits at position
// p = context_len - q_len + (t - q_start) and attends to cached positions [lo, p], or [lo, end)
// on a layer marked bidirectional (`bidi`) when row_end[t] = end > p + 1 (a row inside an image
// that the config lets see the whole image; 0 for the other rows).
//
// One block per (row, group of query heads sharing one KV head): every key and value loaded is
// used by all heads of the group (GQA); with few rows, one block per (row, query head) instead,
// so that more of the GPU works on the step. Keys are visited in chunks of one per thread: each thread
// scores its key against every head, a warp per head updates the running softmax (max, sum), and
// then threads split the chunk's values into 16-byte column slices and accumulate p * v.
#include "common.cuh"

#define PA_THREADS 256
#define PA_CHUNK PA_THREADS
#define PA_MAXH 8

// seq_info: 4 u32 per sequence: q_start, q_len, context_len, offset of its block table in
// block_tables. hb: query heads per block (divides the group; at most PA_MAXH).
template <typename TQ, typename TC, int D>
__device__ void paged_attention(TQ* __restrict__ out, const TQ* __restrict__ q, const TC* __restrict__ kc,
                                const TC* __restrict__ vc, const uint32_t* __restrict__ row_seq,
                                const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                const uint32_t* __restrict__ row_end, int bidi, int num_heads, int num_kv_heads,
                                int hb, int block_size, float scale, int window, float softcap, int skip_q_len) {
    pdl_launch_dependents();  // the output projection may start streaming its weights
    pdl_wait();               // launched as a dependent (ops/paged_attention/mod.rs): q, the cache after this
    constexpr int V = Vec16<TC>::N;
    constexpr int NV = D / V;                 // 16-byte vectors per head row
    constexpr int KG = PA_THREADS / NV;       // keys accumulated at once in the value phase
    static_assert(D % V == 0, "head_dim must be a whole number of 16-byte vectors");

    const int t = blockIdx.x;
    const int group = num_heads / num_kv_heads;
    const int per_kv = group / hb;
    const int kvh = blockIdx.y / per_kv;
    const int h0 = kvh * group + (blockIdx.y % per_kv) * hb;
    const int tid = threadIdx.x;

    const uint32_t s = row_seq[t];
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    if (q_len >= skip_q_len) return;  // a prompt chunk, done by prefill_attention.cu
    const uint32_t* bt = block_tables + seq_info[4 * s + 3];
    const int pos = ctx - q_len + (t - q_start);
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int hi = bidi ? max(pos, (int)row_end[t] - 1) : pos;  // the last key the row sees

    __shared__ __align__(16) float q_s[PA_MAXH][D];
    __shared__ float p_s[PA_MAXH][PA_CHUNK];
    __shared__ int slot_s[PA_CHUNK];
    __shared__ float m_s[PA_MAXH], l_s[PA_MAXH], corr_s[PA_MAXH];
    __shared__ float o_s[PA_MAXH][D];

    for (int i = tid; i < hb * D; i += PA_THREADS) {
        const int h = i / D, d = i % D;
        q_s[h][d] = to_f(q[((size_t)t * num_heads + h0 + h) * D + d]);
        o_s[h][d] = 0.f;
    }
    if (tid < PA_MAXH) { m_s[tid] = -INFINITY; l_s[tid] = 0.f; }
    __syncthreads();

    const int kg = tid / NV, dv = tid % NV;
    const bool pv = kg < KG;
    float acc[PA_MAXH][V];
#pragma unroll
    for (int h = 0; h < PA_MAXH; ++h)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[h][e] = 0.f;

    for (int c0 = lo; c0 <= hi; c0 += PA_CHUNK) {
        const int j = c0 + tid;
        if (j <= hi) {
            const int slot = (int)bt[j / block_size] * block_size + j % block_size;
            slot_s[tid] = slot;
            const TC* kp = kc + ((size_t)slot * num_kv_heads + kvh) * D;
            float sc[PA_MAXH];
#pragma unroll
            for (int h = 0; h < PA_MAXH; ++h) sc[h] = 0.f;
#pragma unroll 8
            for (int vi = 0; vi < NV; ++vi) {
                float kf[V];
                load16(kp + vi * V, kf);
#pragma unroll
                for (int h = 0; h < PA_MAXH; ++h) {
                    if (h < hb) {
#pragma unroll
                        for (int e = 0; e < V; ++e) sc[h] = fmaf(q_s[h][vi * V + e], kf[e], sc[h]);
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < PA_MAXH; ++h) {
                if (h < hb) {
                    float x = sc[h] * scale;
                    if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
                    p_s[h][tid] = x;
                }
            }
        } else {
            for (int h = 0; h < hb; ++h) p_s[h][tid] = -INFINITY;
        }
        __syncthreads();
        softmax_chunk<PA_CHUNK, PA_CHUNK, PA_THREADS / 32>(&p_s[0][0], hb, m_s, l_s, corr_s);
        __syncthreads();
        if (pv) {
#pragma unroll
            for (int h = 0; h < PA_MAXH; ++h) {
                if (h < hb) {
                    const float c = corr_s[h];
#pragma unroll
                    for (int e = 0; e < V; ++e) acc[h][e] *= c;
                }
            }
            const int n = min(PA_CHUNK, hi + 1 - c0);
#pragma unroll 4
            for (int jj = kg; jj < n; jj += KG) {
                float vf[V];
                load16(vc + ((size_t)slot_s[jj] * num_kv_heads + kvh) * D + dv * V, vf);
#pragma unroll
                for (int h = 0; h < PA_MAXH; ++h) {
                    if (h < hb) {
                        const float p = p_s[h][jj];
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[h][e] = fmaf(p, vf[e], acc[h][e]);
                    }
                }
            }
        }
        __syncthreads();
    }
    // The key groups add their sums in group order, not by atomics, so a row gives the same
    // bits on every run (calibration, seeded sampling and the tests rely on it).
    for (int gi = 0; gi < KG; ++gi) {
        if (pv && kg == gi) {
#pragma unroll
            for (int h = 0; h < PA_MAXH; ++h) {
                if (h < hb) {
#pragma unroll
                    for (int e = 0; e < V; ++e) o_s[h][dv * V + e] += acc[h][e];
                }
            }
        }
        __syncthreads();
    }
    for (int i = tid; i < hb * D; i += PA_THREADS) {
        const int h = i / D, d = i % D;
        out[((size_t)t * num_heads + h0 + h) * D + d] = from_f<TQ>(o_s[h][d] / l_s[h]);
    }
}

// The same attention, one block per (row, query head), for steps of few rows (hb = 1), where
// the kernel above is bound by the latency of its block-wide phases (a 7B decode step at batch
// 1: 28 blocks, 15 us each). Here lanes split a key's head row (LPK lanes per key, 16-byte
// loads, coalesced), a warp scores KPW keys at once, and each group of LPK lanes keeps its own
// running softmax over the keys it visits (PD_UNROLL keys' loads in flight), so nothing waits
// on the block until the end, where the groups' states are merged in a fixed order.
// Long contexts: the positions are cut into chunks of `chunk` and block z of PD_SPLITS takes
// the chunks c with c % PD_SPLITS == z, writing its softmax state (m, l, acc) to `part`;
// paged_decode_merge adds the PD_SPLITS states in order. The split does not depend on the
// batch, so neither does a row's arithmetic.
#define PD_THREADS 256
#define PD_UNROLL 4
#define PD_SPLITS 16

// out = sum_z e^(M_z - M) acc_z / sum_z e^(M_z - M) L_z over the PD_SPLITS states of a
// (row, head) at pb, in order, a thread per element. The states may come from other blocks of
// this launch: read past L1.
template <typename TQ, int D>
__device__ void merge_splits(TQ* __restrict__ out, const float* pb, int tid, int threads) {
    float mx = -INFINITY;
    for (int z = 0; z < PD_SPLITS; ++z) mx = fmaxf(mx, __ldcg(pb + z * (D + 2)));
    for (int d = tid; d < D; d += threads) {
        float num = 0.f, den = 0.f;
        for (int z = 0; z < PD_SPLITS; ++z) {
            const float m = __ldcg(pb + z * (D + 2));
            if (m == -INFINITY) continue;  // a split with no chunk of this row
            const float w = expf(m - mx);
            num = fmaf(w, __ldcg(pb + z * (D + 2) + 2 + d), num);
            den = fmaf(w, __ldcg(pb + z * (D + 2) + 1), den);
        }
        out[d] = from_f<TQ>(num / den);
    }
}

template <typename TQ, typename TC, int D>
__device__ void paged_decode(TQ* __restrict__ out, uint32_t* __restrict__ counters, float* __restrict__ part,
                             const TQ* __restrict__ q, const TC* __restrict__ kc,
                             const TC* __restrict__ vc, const uint32_t* __restrict__ row_seq,
                             const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                             const uint32_t* __restrict__ row_end, int bidi, int num_heads, int num_kv_heads,
                             int block_size, float scale, int window, float softcap, int skip_q_len, int chunk) {
    pdl_launch_dependents();  // the output projection may start streaming its weights
    constexpr int V = Vec16<TC>::N;
    constexpr int NV = D / V;  // 16-byte vectors per head row
    constexpr int LPK = NV > 16 ? 32 : NV > 8 ? 16 : NV > 4 ? 8 : NV > 2 ? 4 : NV > 1 ? 2 : 1;
    constexpr int RPL = (NV + LPK - 1) / LPK;  // vectors per lane
    constexpr int KPW = 32 / LPK;              // keys a warp scores at once
    constexpr int WARPS = PD_THREADS / 32;
    constexpr int G = WARPS * KPW;             // lane groups, each with its own softmax state
    static_assert(D % V == 0, "head_dim must be a whole number of 16-byte vectors");

    const int t = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / LPK, kl = lane % LPK;
    const int g = warp * KPW + sub;

    const uint32_t s = row_seq[t];
    const int q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    if (q_len >= skip_q_len) return;  // a prompt chunk, done by prefill_attention.cu
    const int q_start = seq_info[4 * s];
    const uint32_t* bt = block_tables + seq_info[4 * s + 3];
    const int pos = ctx - q_len + (t - q_start);
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int hi = bidi ? max(pos, (int)row_end[t] - 1) : pos;  // the last key the row sees
    // The metadata above was copied in before the step's first kernel; q and the cache come from
    // the kernels before this one.
    pdl_wait();

    float qf[RPL][V], acc[RPL][V];
    const TQ* qh = q + ((size_t)t * num_heads + h) * D;
#pragma unroll
    for (int r = 0; r < RPL; ++r) {
        const int vi = kl + LPK * r;
#pragma unroll
        for (int e = 0; e < V; ++e) {
            qf[r][e] = vi < NV ? to_f(qh[vi * V + e]) : 0.f;
            acc[r][e] = 0.f;
        }
    }
    float m = -INFINITY, l = 0.f;

    // This block's chunks; in each, keys a + warp * KPW + sub + i * G, PD_UNROLL of them per
    // pass. The loop bounds do not depend on the lane, so every lane takes part in every shuffle.
    const int z = blockIdx.z;
    const int c_lo = lo / chunk;
    for (int c = c_lo + (z - c_lo % PD_SPLITS + PD_SPLITS) % PD_SPLITS; c <= hi / chunk; c += PD_SPLITS) {
    const int a = max(lo, c * chunk), b = min(hi, c * chunk + chunk - 1);
    for (int base = a + warp * KPW; base <= b; base += G * PD_UNROLL) {
        float kf[PD_UNROLL][RPL][V], vf[PD_UNROLL][RPL][V];
        bool ok[PD_UNROLL];
#pragma unroll
        for (int u = 0; u < PD_UNROLL; ++u) {
            const int j = base + u * G + sub;
            ok[u] = j <= b;
            if (ok[u]) {
                const size_t row = ((size_t)bt[j / block_size] * block_size + j % block_size) * num_kv_heads + kvh;
#pragma unroll
                for (int r = 0; r < RPL; ++r) {
                    const int vi = kl + LPK * r;
                    if (vi < NV) {
                        load16(kc + row * D + vi * V, kf[u][r]);
                        load16(vc + row * D + vi * V, vf[u][r]);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < PD_UNROLL; ++u) {
            float sc = 0.f;
            if (ok[u]) {
#pragma unroll
                for (int r = 0; r < RPL; ++r) {
                    if (kl + LPK * r < NV) {
#pragma unroll
                        for (int e = 0; e < V; ++e) sc = fmaf(qf[r][e], kf[u][r][e], sc);
                    }
                }
            }
#pragma unroll
            for (int o = LPK / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
            if (ok[u]) {
                float x = sc * scale;
                if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
                const float m_new = fmaxf(m, x);
                const float c = expf(m - m_new), p = expf(x - m_new);
                l = l * c + p;
#pragma unroll
                for (int r = 0; r < RPL; ++r) {
                    if (kl + LPK * r < NV) {
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[r][e] = fmaf(p, vf[u][r][e], acc[r][e] * c);
                    }
                }
                m = m_new;
            }
        }
    }
    }

    // Merge the groups' states in group order into the block's (M, L, acc) at
    // part[((t * heads + h) * PD_SPLITS + z) * (D + 2)]: M, L, then acc[D].
    __shared__ float m_s[G], l_s[G];
    __shared__ float acc_s[G][D];
    if (kl == 0) { m_s[g] = m; l_s[g] = l; }
#pragma unroll
    for (int r = 0; r < RPL; ++r) {
        const int vi = kl + LPK * r;
        if (vi < NV) {
#pragma unroll
            for (int e = 0; e < V; ++e) acc_s[g][vi * V + e] = acc[r][e];
        }
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int i = 0; i < G; ++i) mx = fmaxf(mx, m_s[i]);
    float* pb = part + (((size_t)t * num_heads + h) * PD_SPLITS + z) * (D + 2);
    for (int d = tid; d < D + 1; d += PD_THREADS) {
        float num = 0.f, den = 0.f;
        for (int i = 0; i < G; ++i) {
            if (m_s[i] == -INFINITY) continue;  // a group that saw no key
            const float w = expf(m_s[i] - mx);
            if (d < D) num = fmaf(w, acc_s[i][d], num);
            den = fmaf(w, l_s[i], den);
        }
        if (d < D) pb[2 + d] = num;
        else { pb[0] = mx; pb[1] = den; }
    }
    if (!counters) return;  // paged_decode_merge follows
    // The last of the (row, head)'s PD_SPLITS blocks to finish merges their states, in split
    // order like the merge kernel, and resets the counter for the next launch.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    const size_t rh = (size_t)t * num_heads + h;
    if (tid == 0) last = atomicAdd(counters + rh, 1u) == PD_SPLITS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    merge_splits<TQ, D>(out + rh * D, part + rh * PD_SPLITS * (D + 2), tid, PD_THREADS);
    if (tid == 0) counters[rh] = 0;
}

// The merge as a kernel of its own (when no counters are given to paged_decode): one block
// per (row, head).
template <typename TQ, int D>
__device__ void paged_decode_merge(TQ* __restrict__ out, const float* __restrict__ part,
                                   const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ seq_info,
                                   int num_heads, int skip_q_len) {
    pdl_launch_dependents();  // the output projection may start streaming its weights
    pdl_wait();               // launched as a dependent: the split states after this
    const int t = blockIdx.x, h = blockIdx.y;
    const uint32_t s = row_seq[t];
    if ((int)seq_info[4 * s + 1] >= skip_q_len) return;  // a prompt chunk, done by prefill_attention.cu
    const size_t rh = (size_t)t * num_heads + h;
    merge_splits<TQ, D>(out + rh * D, part + rh * PD_SPLITS * (D + 2), threadIdx.x, blockDim.x);
}

#define PD(NAME, TQ, TC, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(PD_THREADS)                                                   \
        NAME(TQ* out, uint32_t* counters, float* part, const TQ* q, const TC* kc, const TC* vc,                \
             const uint32_t* row_seq, const uint32_t* seq_info, const uint32_t* block_tables,                  \
             const uint32_t* row_end, int bidi, int num_heads, int num_kv_heads, int hb, int block_size,        \
             float scale, int window, float softcap, int skip_q_len, int chunk) {                               \
        paged_decode<TQ, TC, D>(out, counters, part, q, kc, vc, row_seq, seq_info, block_tables, row_end, bidi, \
                                num_heads, num_kv_heads, block_size, scale, window, softcap, skip_q_len, chunk); \
    }
#define PDM(NAME, TQ, D)                                                                                       \
    extern "C" __global__ void NAME(TQ* out, const float* part, const uint32_t* row_seq,                       \
                                    const uint32_t* seq_info, int num_heads, int skip_q_len) {                 \
        paged_decode_merge<TQ, D>(out, part, row_seq, seq_info, num_heads, skip_q_len);                        \
    }

#define PA(NAME, TQ, TC, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(PA_THREADS)                                                   \
        NAME(TQ* out, const TQ* q, const TC* kc, const TC* vc, const uint32_t* row_seq,                        \
             const uint32_t* seq_info, const uint32_t* block_tables, const uint32_t* row_end, int bidi,        \
             int num_heads, int num_kv_heads, int hb, int block_size, float scale, int window, float softcap,   \
             int skip_q_len) {                                                                                  \
        paged_attention<TQ, TC, D>(out, q, kc, vc, row_seq, seq_info, block_tables, row_end, bidi, num_heads,  \
                                   num_kv_heads, hb, block_size, scale, window, softcap, skip_q_len);          \
    }

#define PA_BOTH(TN, CN, TQ, TC, D)                                                                             \
    PA(paged_attention_##TN##_##CN##_##D, TQ, TC, D)                                                           \
    PD(paged_decode_##TN##_##CN##_##D, TQ, TC, D)
#define PA_DIMS(TN, CN, TQ, TC)                                                                                \
    PA_BOTH(TN, CN, TQ, TC, 16)                                                                                \
    PA_BOTH(TN, CN, TQ, TC, 32)                                                                                \
    PA_BOTH(TN, CN, TQ, TC, 64)                                                                                \
    PA_BOTH(TN, CN, TQ, TC, 80)                                                                                \
    PA_BOTH(TN, CN, TQ, TC, 96)                                                                                \
    PA_BOTH(TN, CN, TQ, TC, 128)                                                                               \
    PA_BOTH(TN, CN, TQ, TC, 256)                                                                               \
    PA_BOTH(TN, CN, TQ, TC, 512)

PA_DIMS(f32, f32, float, float)
PA_DIMS(f32, bf16, float, __nv_bfloat16)
PA_DIMS(f32, f16, float, __half)
PA_DIMS(bf16, bf16, __nv_bfloat16, __nv_bfloat16)
PA_DIMS(f16, f16, __half, __half)
#define PDM_DIMS(TN, TQ)                                                                                       \
    PDM(paged_decode_merge_##TN##_16, TQ, 16) PDM(paged_decode_merge_##TN##_32, TQ, 32)                        \
    PDM(paged_decode_merge_##TN##_64, TQ, 64) PDM(paged_decode_merge_##TN##_80, TQ, 80)                        \
    PDM(paged_decode_merge_##TN##_96, TQ, 96) PDM(paged_decode_merge_##TN##_128, TQ, 128)                      \
    PDM(paged_decode_merge_##TN##_256, TQ, 256) PDM(paged_decode_merge_##TN##_512, TQ, 512)
PDM_DIMS(f32, float)
PDM_DIMS(bf16, __nv_bfloat16)
PDM_DIMS(f16, __half)
