// cache[slots[t]] = encode(new[t] * scale) for every row t and kv head of a step, padding rows
// (slot NO_SLOT) skipped (see ops/tq_write.rs and TqCodec::encode, the reference).
//
// One warp per (row, kv head), TW_WARPS of them per block: each encodes its head vector on its
// own (tq_encode_warp), bit-identical to the reference with a Hadamard rotation. Head dims: those
// of the attention kernels (16, 32, 64, 80, 96, 128, 256; ops/tq_write.rs checks).
#include "tq_common.cuh"

#define TW_WARPS 4

template <typename TN, int D>
__device__ void tq_write(uint8_t* __restrict__ cache, const TN* __restrict__ src, const uint32_t* __restrict__ slots,
                         const float* __restrict__ table, const float* __restrict__ scale, int heads, int bits,
                         int dense) {
    __shared__ float y_s[TW_WARPS][D], tmp_s[TW_WARPS][D];
    __shared__ uint8_t code_s[TW_WARPS][D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x, h = blockIdx.y * TW_WARPS + warp;
    if (h >= heads) return;
    const uint32_t slot = slots[t];
    if (slot == 0xffffffffu) return;  // a padding row (NO_SLOT)
    const TN* x = src + ((size_t)t * heads + h) * D;
    for (int i = lane; i < D; i += 32) {
        float v = to_f(x[i]);
        if (scale) v = __fmul_rn(v, scale[h * D + i]);
        y_s[warp][i] = v;
    }
    uint8_t* row = cache + ((size_t)slot * heads + h) * (D * bits / 8 + 4);  // codes, then the f32 norm
    tq_encode_warp<D>(y_s[warp], tmp_s[warp], code_s[warp], row, table, bits, dense != 0);
}

#define TQ_WRITE(NAME, TN)                                                                                     \
    extern "C" __global__ void __launch_bounds__(TW_WARPS * 32)                                                \
        NAME(uint8_t* cache, const TN* src, const uint32_t* slots, const float* table, const float* scale,     \
             int heads, int D, int bits, int dense) {                                          \
        pdl_launch_dependents();                                                                               \
        pdl_wait(); /* launched as a dependent (ops/tq_write.rs): inputs after this */                         \
        switch (D) {                                                                                           \
            case 16: return tq_write<TN, 16>(cache, src, slots, table, scale, heads, bits, dense);  \
            case 32: return tq_write<TN, 32>(cache, src, slots, table, scale, heads, bits, dense);  \
            case 64: return tq_write<TN, 64>(cache, src, slots, table, scale, heads, bits, dense);  \
            case 80: return tq_write<TN, 80>(cache, src, slots, table, scale, heads, bits, dense);  \
            case 96: return tq_write<TN, 96>(cache, src, slots, table, scale, heads, bits, dense);  \
            case 128: return tq_write<TN, 128>(cache, src, slots, table, scale, heads, bits, dense); \
            case 256: return tq_write<TN, 256>(cache, src, slots, table, scale, heads, bits, dense); \
        }                                                                                                      \
    }

TQ_WRITE(tq_write_f32, float)
TQ_WRITE(tq_write_bf16, __nv_bfloat16)
TQ_WRITE(tq_write_f16, __half)
