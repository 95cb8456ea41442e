// y = x W^T for a few rows of x (decode batches): a memory-bound stream over W in 16-byte loads,
// f32 accumulation, rounded once to T (see ops/gemv.rs, the reference).
// x: [M, K] (row stride x_stride), W: [N, K] contiguous, y: [M, N]. One warp per R rows of W.
#include "common.cuh"

#define GEMV_WARPS 8

template <typename T, int M, int R>
__device__ void gemv(T* __restrict__ y, const T* __restrict__ x, int x_stride, const T* __restrict__ w, int n, int k) {
    constexpr int V = Vec16<T>::N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (n0 >= n) return;
    const int kv = k / V;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    const T* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + (size_t)min(n0 + r, n - 1) * k;
#pragma unroll 4
    for (int i = lane; i < kv; i += 32) {
        float wf[R][V];
#pragma unroll
        for (int r = 0; r < R; ++r) load16(wr[r] + i * V, wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[V];
            load16(x + (size_t)m * x_stride + i * V, xf);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < V; ++e) acc[r][m] = fmaf(wf[r][e], xf[e], acc[r][m]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float s = warp_sum(acc[r][m]);
            if (lane == 0 && n0 + r < n) y[(size_t)m * n + n0 + r] = from_f<T>(s);
        }
}

#define GEMV(NAME, T, M, R)                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                              \
        NAME(T* y, const T* x, int x_stride, const T* w, int n, int k) {                                       \
        gemv<T, M, R>(y, x, x_stride, w, n, k);                                                                \
    }

#define GEMV_M(N_, T)                                                                                          \
    GEMV(gemv_##N_##_1, T, 1, 4)                                                                               \
    GEMV(gemv_##N_##_2, T, 2, 4)                                                                               \
    GEMV(gemv_##N_##_3, T, 3, 2)                                                                               \
    GEMV(gemv_##N_##_4, T, 4, 2)                                                                               \
    GEMV(gemv_##N_##_5, T, 5, 2)                                                                               \
    GEMV(gemv_##N_##_6, T, 6, 2)                                                                               \
    GEMV(gemv_##N_##_7, T, 7, 2)                                                                               \
    GEMV(gemv_##N_##_8, T, 8, 2)

GEMV_M(f32, float)
GEMV_M(bf16, __nv_bfloat16)
GEMV_M(f16, __half)
