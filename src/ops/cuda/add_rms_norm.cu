// h = x + delta; y = h / rms(h) * w, in one pass (see ops/add_rms_norm.rs, the reference).
// One block per row; out holds h for every row, then y. h is rounded to T before the norm reads
// it, as the separate add would.
#include "common.cuh"

#define ARN_THREADS 256

template <typename T>
__device__ void add_rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ delta,
                             const T* __restrict__ w, int rows, int dim, float eps) {
    extern __shared__ float hs[];  // the row's h, dim floats
    const size_t r = blockIdx.x;
    const T* xr = x + r * dim;
    const T* dr = delta + r * dim;
    T* ho = out + r * dim;
    T* yo = out + (size_t)rows * dim + r * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += ARN_THREADS) {
        const T h = from_f<T>(to_f(xr[i]) + to_f(dr[i]));
        ho[i] = h;
        const float hf = to_f(h);
        hs[i] = hf;
        ss += hf * hf;
    }
    ss = warp_sum(ss);
    __shared__ float part[ARN_THREADS / 32];
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < ARN_THREADS / 32; ++i) total += part[i];
    const float inv = rsqrtf(total / dim + eps);
    for (int i = threadIdx.x; i < dim; i += ARN_THREADS) yo[i] = from_f<T>(hs[i] * inv * to_f(w[i]));
}

#define ARN(NAME, T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(ARN_THREADS)                                                  \
        NAME(T* out, const T* x, const T* delta, const T* w, int rows, int dim, float eps) {                   \
        add_rms_norm<T>(out, x, delta, w, rows, dim, eps);                                                     \
    }
ARN(add_rms_norm_f32, float)
ARN(add_rms_norm_bf16, __nv_bfloat16)
ARN(add_rms_norm_f16, __half)
