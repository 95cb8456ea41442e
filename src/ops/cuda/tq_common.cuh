// TurboQuant pieces shared by tq_write.cu and tq_attention.cu (see kv/turboquant/ for the
// reference): a codec's table in device memory, its rotation, and packed codes.
#pragma once
#include "common.cuh"

// A codec's table (TqCodec::device_table): 16 boundaries (the 2^b - 1 of the codebook, then
// +inf), 16 centroids (repeated: entry i holds centroid i mod 2^b), then the rotation: the two
// sign diagonals (2 D values) of the randomized Hadamard transform, or the D x D row-major
// matrix of a dense one.
#define TQ_BOUNDS 0
#define TQ_CENTROIDS 16
#define TQ_ROTATION 32

// In place, the unnormalised Walsh-Hadamard transform of `count` vectors of D values (D a
// power of two) in shared memory, by the whole block. Each butterfly computes u + v and u - v
// as the reference's fwht does, so the results are bit-identical to it.
__device__ __forceinline__ void tq_fwht(float* y, int count, int D) {
    for (int h = 1; h < D; h <<= 1) {
        __syncthreads();
        for (int b = threadIdx.x; b < count * (D / 2); b += blockDim.x) {
            const int v = b / (D / 2), k = b % (D / 2);
            float* x = y + v * D;
            const int i = (k / h) * 2 * h + k % h;
            const float u = x[i], w = x[i + h];
            x[i] = __fadd_rn(u, w);
            x[i + h] = __fsub_rn(u, w);
        }
    }
    __syncthreads();
}

// y <- R y for `count` vectors of D values in shared memory (Rotation::apply); `tmp` is shared
// scratch of count * D values (dense rotations only). Hadamard: bit-identical to the reference
// (the sign flips and the scaling by 1 / D, a power of two, are exact). Dense: each output sums
// its D products in order, which rounds differently from the reference's vectorised dot product.
__device__ __forceinline__ void tq_rotate(float* y, float* tmp, int count, int D, const float* rot, bool dense) {
    __syncthreads();
    if (!dense) {
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) y[i] = __fmul_rn(y[i], rot[i % D]);
        tq_fwht(y, count, D);
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) y[i] = __fmul_rn(y[i], rot[D + i % D]);
        tq_fwht(y, count, D);
        const float inv = 1.f / (float)D;
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) y[i] = __fmul_rn(y[i], inv);
    } else {
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) tmp[i] = y[i];
        __syncthreads();
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) {
            const float* m = rot + (size_t)(i % D) * D;
            const float* x = tmp + (i / D) * D;
            float s = 0.f;
            for (int j = 0; j < D; ++j) s = fmaf(m[j], x[j], s);
            y[i] = s;
        }
    }
    __syncthreads();
}

// y <- R^T y (Rotation::apply_inverse), as `tq_rotate`.
__device__ __forceinline__ void tq_rotate_inverse(float* y, float* tmp, int count, int D, const float* rot,
                                                  bool dense) {
    __syncthreads();
    if (!dense) {
        tq_fwht(y, count, D);
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) y[i] = __fmul_rn(y[i], rot[D + i % D]);
        tq_fwht(y, count, D);
        const float inv = 1.f / (float)D;
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) y[i] = __fmul_rn(y[i], rot[i % D] * inv);
    } else {
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) tmp[i] = y[i];
        __syncthreads();
        for (int i = threadIdx.x; i < count * D; i += blockDim.x) {
            const int c = i % D;
            const float* x = tmp + (i / D) * D;
            float s = 0.f;
            for (int r = 0; r < D; ++r) s = fmaf(rot[(size_t)r * D + c], x[r], s);
            y[i] = s;
        }
    }
    __syncthreads();
}

// The 8 codes of coordinates 8 g .. 8 g + 7 of a packed row (least significant bits first):
// they fill bytes [g bits, (g + 1) bits) exactly. Returned as one integer, code e at bits e * bits.
__device__ __forceinline__ uint32_t tq_codes8(const uint8_t* row, int g, int bits) {
    const uint8_t* p = row + g * bits;
    uint32_t w = p[0] | ((uint32_t)p[1] << 8);
    if (bits > 2) w |= (uint32_t)p[2] << 16;
    if (bits > 3) w |= (uint32_t)p[3] << 24;
    return w;
}

// A row's f32 norm, stored little-endian after its codes (rows need not be 4-byte aligned).
__device__ __forceinline__ float tq_norm(const uint8_t* row, int code_bytes) {
    const uint8_t* p = row + code_bytes;
    return __uint_as_float(p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24));
}
