// h = x + delta; y = h / rms(h) * w, in one pass (see ops/add_rms_norm.rs, the reference).
// One block per row, each thread up to ARN_VECS 16-byte vectors of it held in registers, so a
// row costs one round trip to memory for its inputs. h is rounded to T before the norm reads
// it, as the separate add would.
#include "common.cuh"

#define ARN_VECS 4

template <typename T>
__device__ void add_rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ delta,
                             const T* __restrict__ w, int rows, int dim, float eps) {
    pdl_launch_dependents();  // the projection after it may start streaming its weights
    pdl_wait();               // launched as a dependent (ops/add_rms_norm.rs): inputs after this
    constexpr int V = Vec16<T>::N;
    const int nv = dim / V;
    const size_t r = blockIdx.x;
    const T* xr = x + r * dim;
    const T* dr = delta + r * dim;
    T* ho = out + r * dim;
    T* yo = out + (size_t)rows * dim + r * dim;
    float h[ARN_VECS][V];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < ARN_VECS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nv) {
            float a[V], b[V];
            load16(xr + i * V, a);
            load16(dr + i * V, b);
#pragma unroll
            for (int e = 0; e < V; ++e) {
                h[k][e] = to_f(from_f<T>(a[e] + b[e]));
                ss += h[k][e] * h[k][e];
            }
            store16(ho + i * V, h[k]);
        }
    }
    ss = warp_sum(ss);
    __shared__ float part[32];
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < (int)(blockDim.x + 31) / 32; ++i) total += part[i];
    const float inv = rsqrtf(total / dim + eps);
#pragma unroll
    for (int k = 0; k < ARN_VECS; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nv) {
            float wv[V], y[V];
            load16(w + i * V, wv);
#pragma unroll
            for (int e = 0; e < V; ++e) y[e] = h[k][e] * inv * wv[e];
            store16(yo + i * V, y);
        }
    }
}

#define ARN(NAME, T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                         \
        NAME(T* out, const T* x, const T* delta, const T* w, int rows, int dim, float eps) {                   \
        add_rms_norm<T>(out, x, delta, w, rows, dim, eps);                                                     \
    }
ARN(add_rms_norm_f32, float)
ARN(add_rms_norm_bf16, __nv_bfloat16)
ARN(add_rms_norm_f16, __half)
