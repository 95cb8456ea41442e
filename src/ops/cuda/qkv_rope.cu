// Splits a step's fused q/k/v projection into q, k and v heads, adds the bias, applies the
// optional per-head RMSNorm of q and k, and rotates q and k (see ops/qkv_rope.rs, the
// reference). One warp per (row, head); the head's values go through shared memory because
// rotary pairs element i with i + D/2 (or 2i with 2i + 1), which another lane holds.
#include "common.cuh"

#define QR_WARPS 4

// y: [rows, (hq + 2 hkv) * D] with row stride y_stride (q heads, then k, then v).
// bias: [(hq + 2 hkv) * D] or null. cos, sin: [rows, D / 2]. qn, kn: [D] or null.
// out: q [rows, hq, D], then k [rows, hkv, D], then v [rows, hkv, D]; or, given a dense cache
// (kc, vc: [slots, hkv, D], slots: a slot per row, 0xffffffff for none), q only, with k and v
// stored in their slots (the separate cache write's two launches saved).
template <typename T, int D>
__device__ void qkv_rope(T* __restrict__ out, const T* __restrict__ y, int y_stride, const T* __restrict__ bias,
                         const T* __restrict__ cos, const T* __restrict__ sin, const T* __restrict__ qn,
                         const T* __restrict__ kn, float eps, int rows, int hq, int hkv, int interleaved,
                         T* __restrict__ kc, T* __restrict__ vc, const uint32_t* __restrict__ slots) {
    constexpr int E = (D + 31) / 32;
    constexpr int H = D / 2;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x;
    const int head = blockIdx.y * QR_WARPS + warp;
    __shared__ float buf[QR_WARPS][D];
    pdl_launch_dependents();
    pdl_wait();  // launched as a dependent (ops/qkv_rope.rs): y comes after this
    if (head >= hq + 2 * hkv) return;
    const uint32_t slot = kc && head >= hq ? slots[t] : 0u;
    if (slot == 0xffffffffu) return;  // a padding row: its k and v are not kept
    const T* src = y + (size_t)t * y_stride + (size_t)head * D;
    float x[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int e = lane + 32 * k;
        if (e < D) {
            float v = to_f(src[e]);
            // Rounded to T as the separate bias add would.
            if (bias) v = to_f(from_f<T>(v + to_f(bias[(size_t)head * D + e])));
            x[k] = v;
        }
    }
    T* dst;
    if (head >= hq + hkv) {  // v: passed through
        dst = kc ? vc + ((size_t)slot * hkv + head - hq - hkv) * D
                 : out + (size_t)rows * (hq + hkv) * D + ((size_t)t * hkv + head - hq - hkv) * D;
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const int e = lane + 32 * k;
            if (e < D) dst[e] = from_f<T>(x[k]);
        }
        return;
    }
    const bool is_q = head < hq;
    const T* nw = is_q ? qn : kn;
    if (nw) {
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < E; ++k)
            if (lane + 32 * k < D) ss += x[k] * x[k];
        ss = warp_sum(ss);
        const float inv = rsqrtf(ss / D + eps);
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const int e = lane + 32 * k;
            if (e < D) x[k] = to_f(from_f<T>(x[k] * inv * to_f(nw[e])));
        }
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int e = lane + 32 * k;
        if (e < D) buf[warp][e] = x[k];
    }
    __syncwarp();
    dst = is_q ? out + ((size_t)t * hq + head) * D
         : kc  ? kc + ((size_t)slot * hkv + head - hq) * D
               : out + (size_t)rows * hq * D + ((size_t)t * hkv + head - hq) * D;
    const T* c = cos + (size_t)t * H;
    const T* s = sin + (size_t)t * H;
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int e = lane + 32 * k;
        if (e >= D) continue;
        float o;
        if (interleaved) {
            const int i = e / 2;
            const float cc = to_f(c[i]), ss = to_f(s[i]);
            o = (e & 1) ? buf[warp][e - 1] * ss + x[k] * cc : x[k] * cc - buf[warp][e + 1] * ss;
        } else {
            const int i = e < H ? e : e - H;
            const float cc = to_f(c[i]), ss = to_f(s[i]);
            o = e < H ? x[k] * cc - buf[warp][e + H] * ss : buf[warp][e - H] * ss + x[k] * cc;
        }
        dst[e] = from_f<T>(o);
    }
}

#define QR(NAME, T, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(QR_WARPS * 32)                                                \
        NAME(T* out, const T* y, int y_stride, const T* bias, const T* cos, const T* sin, const T* qn,          \
             const T* kn, float eps, int rows, int hq, int hkv, int interleaved, T* kc, T* vc,                  \
             const uint32_t* slots) {                                                                           \
        qkv_rope<T, D>(out, y, y_stride, bias, cos, sin, qn, kn, eps, rows, hq, hkv, interleaved, kc, vc, slots); \
    }

#define QR_DIMS(N, T)                                                                                          \
    QR(qkv_rope_##N##_16, T, 16)                                                                               \
    QR(qkv_rope_##N##_32, T, 32)                                                                               \
    QR(qkv_rope_##N##_64, T, 64)                                                                               \
    QR(qkv_rope_##N##_80, T, 80)                                                                               \
    QR(qkv_rope_##N##_96, T, 96)                                                                               \
    QR(qkv_rope_##N##_128, T, 128)                                                                             \
    QR(qkv_rope_##N##_256, T, 256)

QR_DIMS(f32, float)
QR_DIMS(bf16, __nv_bfloat16)
QR_DIMS(f16, __half)
