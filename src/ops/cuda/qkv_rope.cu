// Splits a step's fused q/k/v projection into q, k and v heads, adds the bias, applies the
// optional per-head RMSNorm of q and k, and rotates q and k (see ops/qkv_rope.rs, the
// reference). One warp per (row, head); the head's values go through shared memory because
// rotary pairs element i with i + D/2 (or 2i with 2i + 1), which another lane holds.
#include "tq_common.cuh"

#define QR_WARPS 4

// A TurboQuant cache that k and v are encoded into (qkv_rope_tq): codes [slots, hkv, row bytes]
// (row bytes: D bits / 8 of codes, then the f32 norm), codec tables (TqCodec::device_table),
// and the keys' scales ([hkv, D] or null). `keep`: k and v are also returned, after q, as
// the plain kernel returns them (a float window reads them), padding rows' included.
struct TqDst {
    uint8_t* codes[2];
    const float* table[2];
    const float* kscale;
    int bits[2];
    int dense[2];
    int keep;
};

// Encodes the calling warp's head vector, x[k] at coordinate lane + 32 k (times ks[k] when
// `scaled`), into the row of kv head `kvh` at `slot` of a TurboQuant cache, `which` = 0 for
// keys, 1 for values; `tab` is the codec's table in shared memory, `buf` the warp's D floats.
template <int D, int E>
__device__ __forceinline__ void qkv_encode_tq(const TqDst& tq, int which, const float* tab, float* buf,
                                              const float (&x)[E], const float (&ks)[E], bool scaled, uint32_t slot,
                                              int hkv, int kvh) {
    __shared__ float tmp_s[QR_WARPS][D];
    __shared__ uint8_t code_s[QR_WARPS][D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncwarp();  // every lane has read buf
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int e = lane + 32 * k;
        if (e < D) buf[e] = scaled ? __fmul_rn(x[k], ks[k]) : x[k];
    }
    uint8_t* row = tq.codes[which] + ((size_t)slot * hkv + kvh) * (D * tq.bits[which] / 8 + 4);
    tq_encode_warp<D>(buf, tmp_s[warp], code_s[warp], row, tq.dense[which] ? tq.table[which] : tab, tq.bits[which],
                      tq.dense[which] != 0);
}

// y: [rows, (hq + 2 hkv) * D] with row stride y_stride (q heads, then k, then v).
// bias: [(hq + 2 hkv) * D] or null. cos, sin: [rows, D / 2]. qn, kn: [D] or null.
// out: q [rows, hq, D], then k [rows, hkv, D], then v [rows, hkv, D]; or, given a dense cache
// (kc, vc: [slots, hkv, D], slots: a slot per row, 0xffffffff for none), q only, with k and v
// stored in their slots (the separate cache write's two launches saved); or, given a TurboQuant
// cache (TQC), q (and with tq.keep k and v too), with k and v encoded into their slots as
// tq_write.cu does from the T values the kernel would have returned (bit-identical to the two
// separate launches).
template <typename T, int D, bool TQC>
__device__ void qkv_rope(T* __restrict__ out, const T* __restrict__ y, int y_stride, const T* __restrict__ bias,
                         const T* __restrict__ cos, const T* __restrict__ sin, const T* __restrict__ qn,
                         const T* __restrict__ kn, float eps, int rows, int hq, int hkv, int interleaved,
                         T* __restrict__ kc, T* __restrict__ vc, const uint32_t* __restrict__ slots,
                         const TqDst& tq) {
    constexpr int E = (D + 31) / 32;
    constexpr int H = D / 2;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x;
    const int head = blockIdx.y * QR_WARPS + warp;
    __shared__ float buf[QR_WARPS][D];
    // TurboQuant: the codecs' boundaries, centroids and rotation signs (dense rotations stay in
    // global memory), and the key scales of a key head, read before the wait: they are written
    // once at start-up, so their latency overlaps the kernel before.
    constexpr int TAB = TQC ? TQ_ROTATION + 2 * D : 1;
    __shared__ float tab_s[TQC ? 2 : 1][TAB];
    float ks[E];
    pdl_launch_dependents();
    if constexpr (TQC) {
        for (int i = threadIdx.x; i < 2 * TAB; i += blockDim.x) {
            const int which = i / TAB, j = i % TAB;
            if (j < TQ_ROTATION || !tq.dense[which]) tab_s[which][j] = tq.table[which][j];
        }
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const int e = lane + 32 * k;
            ks[k] = tq.kscale && head >= hq && head < hq + hkv && e < D ? tq.kscale[(head - hq) * D + e] : 1.f;
        }
        __syncthreads();
    }
    pdl_wait();  // launched as a dependent (ops/qkv_rope.rs): y comes after this
    if (head >= hq + 2 * hkv) return;
    const uint32_t slot = (TQC || kc) && head >= hq ? slots[t] : 0u;
    const bool stored = slot != 0xffffffffu;  // else a padding row: its k and v are not kept
    if (!stored && !(TQC && tq.keep)) return;
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
    if (TQC && head >= hq + hkv) {  // v: encoded as it is (x holds T values)
        if constexpr (TQC) {
            if (tq.keep) {
                T* o = out + (size_t)rows * (hq + hkv) * D + ((size_t)t * hkv + head - hq - hkv) * D;
#pragma unroll
                for (int k = 0; k < E; ++k)
                    if (lane + 32 * k < D) o[lane + 32 * k] = from_f<T>(x[k]);
            }
            if (stored) qkv_encode_tq<D, E>(tq, 1, tab_s[1], buf[warp], x, ks, false, slot, hkv, head - hq - hkv);
        }
        return;
    }
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
        if (TQC && !is_q) {
            x[k] = to_f(from_f<T>(o));  // the key as the separate write would read it
            if (tq.keep) dst[e] = from_f<T>(o);
        } else {
            dst[e] = from_f<T>(o);
        }
    }
    if constexpr (TQC)
        if (!is_q && stored)
            qkv_encode_tq<D, E>(tq, 0, tab_s[0], buf[warp], x, ks, tq.kscale != nullptr, slot, hkv, head - hq);
}

#define QR(NAME, T, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(QR_WARPS * 32)                                                \
        NAME(T* out, const T* y, int y_stride, const T* bias, const T* cos, const T* sin, const T* qn,          \
             const T* kn, float eps, int rows, int hq, int hkv, int interleaved, T* kc, T* vc,                  \
             const uint32_t* slots) {                                                                           \
        qkv_rope<T, D, false>(out, y, y_stride, bias, cos, sin, qn, kn, eps, rows, hq, hkv, interleaved, kc, vc, \
                              slots, TqDst{});                                                                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(QR_WARPS * 32)                                                \
        NAME##_tq(T* out, const T* y, int y_stride, const T* bias, const T* cos, const T* sin, const T* qn,     \
                  const T* kn, float eps, int rows, int hq, int hkv, int interleaved, uint8_t* kq, uint8_t* vq, \
                  const uint32_t* slots, const float* ktab, const float* vtab, const float* kscale, int kbits,  \
                  int vbits, int kdense, int vdense, int keep) {                                                \
        const TqDst tq{{kq, vq}, {ktab, vtab}, kscale, {kbits, vbits}, {kdense, vdense}, keep};                 \
        qkv_rope<T, D, true>(out, y, y_stride, bias, cos, sin, qn, kn, eps, rows, hq, hkv, interleaved, nullptr, \
                             nullptr, slots, tq);                                                               \
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
