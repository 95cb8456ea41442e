// Quantized matrices on the GPU (see ops/qmatmul/cuda.rs): the CPU's packed 32-weight blocks
// (ops/qmatmul/packed.rs) split into two arrays, `words` [W][N][NB] f32 (each block's scales
// and other 32-bit words, word-major so a warp's loads of one word are contiguous) and
// `codes` [N][NB][C] bytes (16-byte aligned). Each block decodes exactly as the CPU kernels
// decode it (`q * d`, then `+ m`, two roundings), so a weight is the CPU's weight bit for bit.
//
// qgemv: y = x W^T for the few rows of a decode step, one pass over the quantized bytes. A
// warp (or wpr warps) per output row, each lane a block at a time (its codes in one or two
// 16-byte loads), the decoded weights used for all M rows of x; f32 sums in an order that does
// not depend on M. qdequant: W to a dense [N, K] matrix of T, for prompts (a GEMM follows).
#include "common.cuh"

#define QGEMV_THREADS 256

// Block formats, as ops/qmatmul/packed.rs's BlockFormat (the discriminants qmatmul/cuda.rs
// passes): words per block and code bytes per block.
#define F_Q4_0 0
#define F_Q4_1 1
#define F_Q5_0 2
#define F_Q5_1 3
#define F_Q8_0 4
#define F_Q6 5
#define F_Q3 6
#define F_A8 7

template <int F> struct Fmt;
template <> struct Fmt<F_Q4_0> { static constexpr int W = 1, C = 16; };
template <> struct Fmt<F_Q4_1> { static constexpr int W = 2, C = 16; };
template <> struct Fmt<F_Q5_0> { static constexpr int W = 2, C = 16; };
template <> struct Fmt<F_Q5_1> { static constexpr int W = 3, C = 16; };
template <> struct Fmt<F_Q8_0> { static constexpr int W = 1, C = 32; };
template <> struct Fmt<F_Q6> { static constexpr int W = 4, C = 16; };
template <> struct Fmt<F_Q3> { static constexpr int W = 5, C = 0; };
template <> struct Fmt<F_A8> { static constexpr int W = 2, C = 32; };

// One block's raw data: its words and codes, loaded before any is decoded.
template <int F> struct Raw {
    float w[Fmt<F>::W];
    uint4 c[Fmt<F>::C / 16 > 0 ? Fmt<F>::C / 16 : 1];
};

template <int F>
__device__ __forceinline__ void load_block(Raw<F>& r, const float* __restrict__ words, const uint8_t* __restrict__ codes,
                                           size_t plane, size_t blk) {
#pragma unroll
    for (int i = 0; i < Fmt<F>::W; ++i) r.w[i] = __ldcs(words + i * plane + blk);
#pragma unroll
    for (int i = 0; i < Fmt<F>::C / 16; ++i) r.c[i] = __ldcs(reinterpret_cast<const uint4*>(codes + blk * Fmt<F>::C) + i);
}

__device__ __forceinline__ uint32_t byte_of(const uint4& v, int i) {
    const uint32_t u = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w;
    return (u >> (8 * (i & 3))) & 0xffu;
}

// The 32 weights of a block. Nibble codes: byte i holds weight i (low) and 16 + i (high).
template <int F> __device__ __forceinline__ void decode(const Raw<F>& r, float* out) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float lo, hi;
        if constexpr (F == F_Q8_0 || F == F_A8) {
            const uint32_t a = byte_of(r.c[0], i), b = byte_of(r.c[1], i);
            lo = F == F_Q8_0 ? (float)(int8_t)a : (float)a;
            hi = F == F_Q8_0 ? (float)(int8_t)b : (float)b;
            // Q8_0 and A8: byte i is weight i (the second vector holds weights 16..32).
            out[i] = F == F_Q8_0 ? __fmul_rn(lo, r.w[0]) : __fadd_rn(__fmul_rn(lo, r.w[0]), r.w[1]);
            out[16 + i] = F == F_Q8_0 ? __fmul_rn(hi, r.w[0]) : __fadd_rn(__fmul_rn(hi, r.w[0]), r.w[1]);
            continue;
        } else if constexpr (F == F_Q3) {
            const uint32_t l0 = (__float_as_uint(r.w[2]) >> (2 * i)) & 3u, l1 = (__float_as_uint(r.w[3]) >> (2 * i)) & 3u;
            const uint32_t h = __float_as_uint(r.w[4]);
            lo = (float)((int)(l0 | ((h >> i) & 1u) << 2) - 4) * r.w[0];
            hi = (float)((int)(l1 | ((h >> (16 + i)) & 1u) << 2) - 4) * r.w[1];
        } else {
            const uint32_t byte = byte_of(r.c[0], i);
            uint32_t ql = byte & 15u, qh = byte >> 4;
            if constexpr (F == F_Q4_0) {
                lo = ((float)ql - 8.f) * r.w[0];
                hi = ((float)qh - 8.f) * r.w[0];
            } else if constexpr (F == F_Q4_1) {
                lo = __fadd_rn(__fmul_rn((float)ql, r.w[0]), r.w[1]);
                hi = __fadd_rn(__fmul_rn((float)qh, r.w[0]), r.w[1]);
            } else if constexpr (F == F_Q5_0 || F == F_Q5_1) {
                const uint32_t bits = __float_as_uint(r.w[F == F_Q5_0 ? 1 : 2]);
                ql |= ((bits >> i) & 1u) << 4;
                qh |= ((bits >> (16 + i)) & 1u) << 4;
                if constexpr (F == F_Q5_0) {
                    lo = ((float)ql - 16.f) * r.w[0];
                    hi = ((float)qh - 16.f) * r.w[0];
                } else {
                    lo = __fadd_rn(__fmul_rn((float)ql, r.w[0]), r.w[1]);
                    hi = __fadd_rn(__fmul_rn((float)qh, r.w[0]), r.w[1]);
                }
            } else {  // F_Q6: the two high bits of weights 0..16 in word 2, of 16..32 in word 3
                ql |= ((__float_as_uint(r.w[2]) >> (2 * i)) & 3u) << 4;
                qh |= ((__float_as_uint(r.w[3]) >> (2 * i)) & 3u) << 4;
                lo = (float)((int)ql - 32) * r.w[0];
                hi = (float)((int)qh - 32) * r.w[1];
            }
        }
        out[i] = lo;
        out[16 + i] = hi;
    }
}

// Blocks each lane loads before decoding any (memory-level parallelism).
#define QGEMV_UNROLL 4

template <int F, typename T, int M>
__device__ void qgemv(T* __restrict__ y, const T* __restrict__ x, const float* __restrict__ words,
                      const uint8_t* __restrict__ codes, int n, int nb, int wpr) {
    constexpr int WARPS = QGEMV_THREADS / 32;
    constexpr int V = Vec16<T>::N;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp % wpr;
    const int row = blockIdx.x * (WARPS / wpr) + warp / wpr;
    const int k = nb * 32, stride = 32 * wpr;
    const size_t plane = (size_t)n * nb;
    __shared__ float partial[WARPS][M];
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    if (row < n) {
        const size_t row0 = (size_t)row * nb;
        for (int base = part * 32 + lane; base < nb; base += stride * QGEMV_UNROLL) {
            Raw<F> raw[QGEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < QGEMV_UNROLL; ++u) {
                const int b = base + stride * u;
                if (b < nb) load_block<F>(raw[u], words, codes, plane, row0 + b);
            }
#pragma unroll
            for (int u = 0; u < QGEMV_UNROLL; ++u) {
                const int b = base + stride * u;
                if (b >= nb) break;
                float wf[32];
                decode<F>(raw[u], wf);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const T* xb = x + (size_t)m * k + (size_t)b * 32;
#pragma unroll
                    for (int v = 0; v < 32 / V; ++v) {
                        float xf[V];
                        load16<T>(xb + v * V, xf);
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[m] = fmaf(wf[v * V + e], xf[e], acc[m]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) partial[warp][m] = acc[m];
    }
    __syncthreads();
    if (lane == 0 && part == 0 && row < n) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float s = 0.f;
            for (int p = 0; p < wpr; ++p) s += partial[warp + p][m];
            y[(size_t)m * n + row] = from_f<T>(s);
        }
    }
}

// One thread per block of the matrix: its 32 weights as T into out [N, K].
template <int F, typename T>
__device__ void qdequant(T* __restrict__ out, const float* __restrict__ words, const uint8_t* __restrict__ codes, int n,
                         int nb) {
    const size_t blk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t plane = (size_t)n * nb;
    if (blk >= plane) return;
    Raw<F> raw;
    load_block<F>(raw, words, codes, plane, blk);
    float wf[32];
    decode<F>(raw, wf);
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int v = 0; v < 32 / V; ++v) store16<T>(out + blk * 32 + v * V, wf + v * V);
}

#define QGEMV(FN, F, TN, T, M)                                                                                  \
    extern "C" __global__ void __launch_bounds__(QGEMV_THREADS)                                                 \
        qgemv_##FN##_##TN##_##M(T* y, const T* x, const float* words, const uint8_t* codes, int n, int nb,      \
                                int wpr) {                                                                      \
        qgemv<F, T, M>(y, x, words, codes, n, nb, wpr);                                                         \
    }
#define QDEQUANT(FN, F, TN, T)                                                                                  \
    extern "C" __global__ void qdequant_##FN##_##TN(T* out, const float* words, const uint8_t* codes, int n,    \
                                                    int nb) {                                                   \
        qdequant<F, T>(out, words, codes, n, nb);                                                               \
    }
#define QGEMV_ROWS(FN, F, TN, T)                                                                                \
    QGEMV(FN, F, TN, T, 1) QGEMV(FN, F, TN, T, 2) QGEMV(FN, F, TN, T, 3) QGEMV(FN, F, TN, T, 4)                 \
    QGEMV(FN, F, TN, T, 5) QGEMV(FN, F, TN, T, 6) QGEMV(FN, F, TN, T, 7) QGEMV(FN, F, TN, T, 8)                 \
    QDEQUANT(FN, F, TN, T)
#define QGEMV_TYPES(FN, F)                                                                                      \
    QGEMV_ROWS(FN, F, f32, float) QGEMV_ROWS(FN, F, bf16, __nv_bfloat16) QGEMV_ROWS(FN, F, f16, __half)

QGEMV_TYPES(q4_0, F_Q4_0)
QGEMV_TYPES(q4_1, F_Q4_1)
QGEMV_TYPES(q5_0, F_Q5_0)
QGEMV_TYPES(q5_1, F_Q5_1)
QGEMV_TYPES(q8_0, F_Q8_0)
QGEMV_TYPES(q6, F_Q6)
QGEMV_TYPES(q3, F_Q3)
QGEMV_TYPES(a8, F_A8)
