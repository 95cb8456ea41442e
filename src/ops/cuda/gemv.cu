// y = x W^T for a few rows of x (decode steps): x [M, K], W [N, K] row-major, y [M, N], M <= 8
// (see ops/gemv.rs). A step of a large model is one pass over its weights, so this is a
// bandwidth problem: one warp per output row streams the row in 16-byte loads, several in
// flight per lane, and uses each loaded weight for all M rows of x (x stays in L1/L2); matrices
// of few rows split each row over several warps. The
// sum for a row is taken in the same order whatever M is, so a row's output does not depend on
// how many rows share the step. f32 accumulation. With act >= 0 the rows are a gated MLP's
// (gate, up) pairs and y [M, N / 2] gets the activation's product instead (ops/gemv.rs).
#include "common.cuh"

#define GEMV_THREADS 256
#define GEMV_UNROLL 8

template <typename T> __device__ __forceinline__ void unpack16(const uint4& v, float* out);
template <> __device__ __forceinline__ void unpack16<float>(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x); out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z); out[3] = __uint_as_float(v.w);
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& v, float* out) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(u[i] << 16);
        out[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4& v, float* out) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __half2 h = *reinterpret_cast<const __half2*>(&u[i]);
        float2 f = __half22float2(h);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// K is a whole number of 16-byte vectors; x, W and y start 16-byte aligned. wpr (1, 2, 4 or 8)
// warps share a row, each taking every wpr-th run of 32 vectors, so that a matrix of few rows
// still spreads over every SM; their partial sums are added in warp order.
template <typename T, int M>
__device__ void gemv(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, int n, int k, int wpr,
                     int act) {
    constexpr int V = Vec16<T>::N;
    constexpr int WARPS = GEMV_THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp % wpr;
    const int row = blockIdx.x * (WARPS / wpr) + warp / wpr;
    const int kv = k / V;
    const int stride = 32 * wpr;
    __shared__ float partial[WARPS][M];
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;

    pdl_launch_dependents();  // the small kernel after it may launch (it waits for y itself)
    if (row < n) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        // Every load of a pass is issued before any is used (the last pass predicated), so each
        // lane keeps GEMV_UNROLL loads in flight throughout.
        for (int base = part * 32 + lane; base < kv; base += stride * GEMV_UNROLL) {
            uint4 wv[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int i = base + stride * u;
                wv[u] = i < kv ? __ldcs(wr + i) : make_uint4(0u, 0u, 0u, 0u);  // read once: stream
            }
            // The weights do not come from the kernel before; x does (see ops/gemv.rs: launched
            // as a programmatic dependent, the first weights stream while that kernel ends).
            if (base == part * 32 + lane) pdl_wait();
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int i = base + stride * u;
                if (i >= kv) break;
                float wf[V];
                unpack16<T>(wv[u], wf);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float xf[V];
                    unpack16<T>(__ldg(xv + (size_t)m * kv + i), xf);
#pragma unroll
                    for (int e = 0; e < V; ++e) acc[m] = fmaf(wf[e], xf[e], acc[m]);
                }
            }
        }
    }
    pdl_wait();  // rows past n, and row lengths of no pass: y is written only after it
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) partial[warp][m] = acc[m];
    }
    __syncthreads();
    if (act < 0 && lane == 0 && part == 0 && row < n) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float s = 0.f;
            for (int p = 0; p < wpr; ++p) s += partial[warp + p][m];
            y[(size_t)m * n + row] = from_f<T>(s);
        }
    }
    // Rows (2i, 2i + 1) are (gate i, up i) of a gated MLP, both in this block (wpr <= 4): y
    // gets act(gate) * up, each rounded to T where the plain product and gated_act.cu round.
    if (act >= 0 && lane == 0 && part == 0 && row < n && (row & 1) == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float g = 0.f, u = 0.f;
            for (int p = 0; p < wpr; ++p) g += partial[warp + p][m];
            for (int p = 0; p < wpr; ++p) u += partial[warp + wpr + p][m];
            const float gq = to_f(from_f<T>(g)), uq = to_f(from_f<T>(u));
            y[(size_t)m * (n / 2) + row / 2] = from_f<T>(to_f(from_f<T>(mlp_act(gq, act))) * uq);
        }
    }
}

#define GEMV(TN, T, M)                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                 \
        gemv_##TN##_##M(T* y, const T* x, const T* w, int n, int k, int wpr, int act) {                       \
        gemv<T, M>(y, x, w, n, k, wpr, act);                                                                   \
    }
#define GEMV_ROWS(TN, T)                                                                                       \
    GEMV(TN, T, 1) GEMV(TN, T, 2) GEMV(TN, T, 3) GEMV(TN, T, 4)                                                \
    GEMV(TN, T, 5) GEMV(TN, T, 6) GEMV(TN, T, 7) GEMV(TN, T, 8)

GEMV_ROWS(f32, float)
GEMV_ROWS(bf16, __nv_bfloat16)
GEMV_ROWS(f16, __half)
