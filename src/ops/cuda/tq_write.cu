// cache[slots[t]] = encode(new[t] * scale) for every row t and kv head of a step, padding rows
// (slot NO_SLOT) skipped (see ops/tq_write.rs and TqCodec::encode, the reference).
//
// One block per (row, kv head). With a Hadamard rotation the codes and the norm are
// bit-identical to the reference's: the norm sums the squares in the same order with the same
// roundings (no fused multiply-adds), the rotation's butterflies are the same additions, and a
// code counts the boundaries strictly below the coordinate, as the reference does.
#include "tq_common.cuh"

#define TW_THREADS 128
#define TW_MAXD 256

template <typename TN>
__device__ void tq_write(uint8_t* __restrict__ cache, const TN* __restrict__ src, const uint32_t* __restrict__ slots,
                         const float* __restrict__ table, const float* __restrict__ scale, int heads, int D,
                         int bits, int code_bytes, int dense) {
    __shared__ float y_s[TW_MAXD], tmp_s[TW_MAXD];
    __shared__ uint8_t code_s[TW_MAXD];
    __shared__ float inv_s, norm_s;
    pdl_launch_dependents();
    pdl_wait();  // launched as a dependent (ops/tq_write.rs): inputs after this
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const uint32_t slot = slots[t];
    if (slot == 0xffffffffu) return;  // a padding row (NO_SLOT)
    const TN* x = src + ((size_t)t * heads + h) * D;
    for (int i = tid; i < D; i += blockDim.x) {
        float v = to_f(x[i]);
        if (scale) v = __fmul_rn(v, scale[h * D + i]);
        y_s[i] = v;
    }
    __syncthreads();
    if (tid == 0) {
        // In order, as the reference's f32 sum of squares.
        float n = 0.f;
        for (int i = 0; i < D; ++i) n = __fadd_rn(n, __fmul_rn(y_s[i], y_s[i]));
        norm_s = __fsqrt_rn(n);
        inv_s = __fdiv_rn(1.f, fmaxf(norm_s, 1e-6f));
    }
    tq_rotate(y_s, tmp_s, 1, D, table + TQ_ROTATION, dense != 0);
    const float inv = inv_s;
    for (int i = tid; i < D; i += blockDim.x) {
        const float v = __fmul_rn(y_s[i], inv);
        int idx = 0;
#pragma unroll
        for (int k = 0; k < 15; ++k) idx += v > table[TQ_BOUNDS + k];  // unused boundaries are +inf
        code_s[i] = (uint8_t)idx;
    }
    __syncthreads();
    uint8_t* row = cache + ((size_t)slot * heads + h) * (code_bytes + 4);
    for (int k = tid; k < code_bytes; k += blockDim.x) {
        uint32_t byte = 0;
        for (int b = 0; b < 8; ++b) {
            const int g = 8 * k + b, i = g / bits;
            if (i < D) byte |= ((code_s[i] >> (g % bits)) & 1u) << b;
        }
        row[k] = (uint8_t)byte;
    }
    for (int k = tid; k < 4; k += blockDim.x) row[code_bytes + k] = (uint8_t)(__float_as_uint(norm_s) >> (8 * k));
}

#define TQ_WRITE(NAME, TN)                                                                                     \
    extern "C" __global__ void __launch_bounds__(TW_THREADS)                                                   \
        NAME(uint8_t* cache, const TN* src, const uint32_t* slots, const float* table, const float* scale,     \
             int heads, int D, int bits, int code_bytes, int dense) {                                          \
        tq_write<TN>(cache, src, slots, table, scale, heads, D, bits, code_bytes, dense);                      \
    }

TQ_WRITE(tq_write_f32, float)
TQ_WRITE(tq_write_bf16, __nv_bfloat16)
TQ_WRITE(tq_write_f16, __half)
