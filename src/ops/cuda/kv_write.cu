// cache[slot_mapping[t]] = new[t] for every row t of a step, padding rows skipped (see ops/kv_write.rs, the reference).
#include "common.cuh"

// grid: one block per row; row = kv_heads * head_dim elements.
template <typename TI, typename TC>
__device__ void kv_write(TC* __restrict__ cache, const TI* __restrict__ src, const uint32_t* __restrict__ slots,
                         int row) {
    const size_t t = blockIdx.x;
    if (slots[t] == 0xffffffffu) return;  // a padding row (NO_SLOT)
    TC* dst = cache + (size_t)slots[t] * row;
    const TI* s = src + t * row;
    for (int i = threadIdx.x; i < row; i += blockDim.x) dst[i] = from_f<TC>(to_f(s[i]));
}

#define KV_WRITE(NAME, TI, TC)                                                                                 \
    extern "C" __global__ void NAME(TC* cache, const TI* src, const uint32_t* slots, int row) {                \
        kv_write<TI, TC>(cache, src, slots, row);                                                              \
    }

KV_WRITE(kv_write_f32_f32, float, float)
KV_WRITE(kv_write_f32_bf16, float, __nv_bfloat16)
KV_WRITE(kv_write_f32_f16, float, __half)
KV_WRITE(kv_write_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
KV_WRITE(kv_write_f16_f16, __half, __half)
