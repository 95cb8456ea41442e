// Picking tokens on the device (see ops/argmax.rs, the reference).
#include "common.cuh"
#include <limits.h>

#define ARGMAX_THREADS 1024

// Is (v, i) a better pick than (bv, bi)? Larger value, then lower id; non-finite values never win.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return isfinite(v) && (v > bv || (v == bv && i < bi) || bi == INT_MAX);
}

// One block per row of [rows, vocab] f32 logits: the largest finite logit, lowest id on ties,
// 0 when none is finite.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_f32(const float* __restrict__ logits, uint32_t* __restrict__ out, int vocab) {
    const float* l = logits + (size_t)blockIdx.x * vocab;
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < vocab; i += ARGMAX_THREADS) {
        const float v = l[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (i != INT_MAX && better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = sv[lane];
        bi = si[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const int i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (i != INT_MAX && better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        if (lane == 0) out[blockIdx.x] = bi == INT_MAX ? 0u : (uint32_t)bi;
    }
}
