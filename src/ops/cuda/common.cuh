// Shared helpers for iris's CUDA kernels: element conversions and 16-byte vector loads.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// Elements of T in one 16-byte vector.
template <typename T> struct Vec16 { static constexpr int N = 16 / sizeof(T); };

// Loads 16 bytes (Vec16<T>::N elements, 16-byte aligned) as floats.
template <typename T> __device__ __forceinline__ void load16(const T* p, float* out);
template <> __device__ __forceinline__ void load16<float>(const float* p, float* out) {
    float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
}
template <> __device__ __forceinline__ void load16<__nv_bfloat16>(const __nv_bfloat16* p, float* out) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
template <> __device__ __forceinline__ void load16<__half>(const __half* p, float* out) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}

// Stores Vec16<T>::N floats as 16 bytes of T (16-byte aligned).
template <typename T> __device__ __forceinline__ void store16(T* p, const float* v);
template <> __device__ __forceinline__ void store16<float>(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <> __device__ __forceinline__ void store16<__nv_bfloat16>(__nv_bfloat16* p, const float* v) {
    uint4 o;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = o;
}
template <> __device__ __forceinline__ void store16<__half>(__half* p, const float* v) {
    uint4 o;
    __half2* h = reinterpret_cast<__half2*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = o;
}

// The MLP activations the fused kernels take: SiLU, or GELU with the tanh approximation.
__device__ __forceinline__ float mlp_act(float x, int gelu) {
    if (gelu) return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return x / (1.f + expf(-x));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// One chunk of a running softmax per head, for the block-wide dense attention kernel: warps take heads in turn (WARPS of them), and head h's N scores in shared
// memory, p[h * STRIDE + i], become exp(score - m_new); its max m[h] and sum l[h] move on, and
// corr[h] = exp(m_old - m_new) is left for rescaling what was accumulated before. The caller
// synchronizes the block before (scores written) and after (p, corr read).
template <int N, int STRIDE, int WARPS>
__device__ __forceinline__ void softmax_chunk(float* p, int heads, float* m, float* l, float* corr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int h = warp; h < heads; h += WARPS) {
        float* ph = p + h * STRIDE;
        float mx = -INFINITY;
        for (int i = lane; i < N; i += 32) mx = fmaxf(mx, ph[i]);
        mx = warp_max(mx);
        const float m_old = m[h];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.f;
        for (int i = lane; i < N; i += 32) {
            const float e = expf(ph[i] - m_new);
            ph[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();
        if (lane == 0) {
            const float c = expf(m_old - m_new);
            corr[h] = c;
            l[h] = l[h] * c + sum;
            m[h] = m_new;
        }
    }
}

// Programmatic dependent launch (Hopper): a kernel launched with it may start while the kernel
// before it finishes; pdl_wait() returns once that kernel has completed and its writes are
// visible, so everything a kernel reads from earlier kernels, and every write, comes after it.
// pdl_launch_dependents() lets the next such kernel start launching. Both are no-ops for a
// kernel launched normally, and before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Orders floats as unsigned integers as Rust's f32::total_cmp does: a > b <=> key(a) > key(b)
// (-0 below +0; NaNs beyond the infinities).
__device__ __forceinline__ uint32_t order_key(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_key(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// exp(x) by range reduction and a degree-7 polynomial, each step one IEEE operation, so that
// Rust computes the same bits (src/simd.rs: `exp_det`). 0 at or below -87 (and for NaN),
// infinite above 89.
__device__ __forceinline__ float exp_det(float x) {
    if (!(x > -87.0f)) return 0.0f;
    if (x > 89.0f) return __int_as_float(0x7f800000);
    const float n = rintf(__fmul_rn(x, 1.44269504f));
    float r = fmaf(-n, 0.693145752f, x);
    r = fmaf(-n, 1.42860677e-6f, r);
    float p = 1.98412698e-4f;
    p = fmaf(p, r, 1.38888889e-3f);
    p = fmaf(p, r, 8.33333333e-3f);
    p = fmaf(p, r, 4.16666667e-2f);
    p = fmaf(p, r, 1.66666667e-1f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const int e = (int)n;
    if (e < -126) return 0.0f;
    // 2^128 has no f32: scale by 2^127, then by 2.
    if (e > 127) return __fmul_rn(__fmul_rn(p, __int_as_float(254 << 23)), 2.0f);
    return __fmul_rn(p, __int_as_float((e + 127) << 23));
}
