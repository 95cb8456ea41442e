// Attention over a paged KV cache for a flat batch of any mix of prefill chunks and decodes
// (see ops/paged_attention.rs, the reference). Row t of sequence s sits at position
// p = context_len - q_len + (t - q_start) and attends to cached positions [lo, p].
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
                                int num_heads, int num_kv_heads, int hb, int block_size, float scale, int window,
                                float softcap, int skip_q_len) {
    constexpr int V = Vec16<TC>::N;
    constexpr int NV = D / V;                 // 16-byte vectors per head row
    constexpr int KG = PA_THREADS / NV;       // keys accumulated at once in the value phase
    static_assert(D % V == 0, "head_dim must be a whole number of 16-byte vectors");

    const int t = blockIdx.x;
    const int group = num_heads / num_kv_heads;
    const int per_kv = group / hb;
    const int kvh = blockIdx.y / per_kv;
    const int h0 = kvh * group + (blockIdx.y % per_kv) * hb;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    const uint32_t s = row_seq[t];
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    if (q_len >= skip_q_len) return;  // a prompt chunk, done by prefill_attention.cu
    const uint32_t* bt = block_tables + seq_info[4 * s + 3];
    const int pos = ctx - q_len + (t - q_start);
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;

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

    for (int c0 = lo; c0 <= pos; c0 += PA_CHUNK) {
        const int j = c0 + tid;
        if (j <= pos) {
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
        // Running softmax: one warp per head.
        for (int h = warp; h < hb; h += PA_THREADS / 32) {
            float mx = -INFINITY;
            for (int i = lane; i < PA_CHUNK; i += 32) mx = fmaxf(mx, p_s[h][i]);
            mx = warp_max(mx);
            const float m_old = m_s[h];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int i = lane; i < PA_CHUNK; i += 32) {
                const float e = expf(p_s[h][i] - m_new);
                p_s[h][i] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                const float c = expf(m_old - m_new);
                corr_s[h] = c;
                l_s[h] = l_s[h] * c + sum;
                m_s[h] = m_new;
            }
        }
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
            const int n = min(PA_CHUNK, pos + 1 - c0);
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
    if (pv) {
#pragma unroll
        for (int h = 0; h < PA_MAXH; ++h) {
            if (h < hb) {
#pragma unroll
                for (int e = 0; e < V; ++e) atomicAdd(&o_s[h][dv * V + e], acc[h][e]);
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < hb * D; i += PA_THREADS) {
        const int h = i / D, d = i % D;
        out[((size_t)t * num_heads + h0 + h) * D + d] = from_f<TQ>(o_s[h][d] / l_s[h]);
    }
}

#define PA(NAME, TQ, TC, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(PA_THREADS)                                                   \
        NAME(TQ* out, const TQ* q, const TC* kc, const TC* vc, const uint32_t* row_seq,                        \
             const uint32_t* seq_info, const uint32_t* block_tables, int num_heads, int num_kv_heads, int hb,  \
             int block_size, float scale, int window, float softcap, int skip_q_len) {                         \
        paged_attention<TQ, TC, D>(out, q, kc, vc, row_seq, seq_info, block_tables, num_heads, num_kv_heads,   \
                                   hb, block_size, scale, window, softcap, skip_q_len);                        \
    }

#define PA_DIMS(TN, CN, TQ, TC)                                                                                \
    PA(paged_attention_##TN##_##CN##_16, TQ, TC, 16)                                                           \
    PA(paged_attention_##TN##_##CN##_32, TQ, TC, 32)                                                           \
    PA(paged_attention_##TN##_##CN##_64, TQ, TC, 64)                                                           \
    PA(paged_attention_##TN##_##CN##_80, TQ, TC, 80)                                                           \
    PA(paged_attention_##TN##_##CN##_96, TQ, TC, 96)                                                           \
    PA(paged_attention_##TN##_##CN##_128, TQ, TC, 128)                                                         \
    PA(paged_attention_##TN##_##CN##_256, TQ, TC, 256)

PA_DIMS(f32, f32, float, float)
PA_DIMS(f32, bf16, float, __nv_bfloat16)
PA_DIMS(f32, f16, float, __half)
PA_DIMS(bf16, bf16, __nv_bfloat16, __nv_bfloat16)
PA_DIMS(f16, f16, __half, __half)
