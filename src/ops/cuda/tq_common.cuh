// TurboQuant pieces shared by tq_write.cu and tq_attention.cu (see ops/turboquant/ for the
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

// The threads that run a rotation: the whole block, or (WARP) the calling warp alone, which
// lets the warps of a block rotate different vectors without waiting on each other.
template <bool WARP> struct TqTeam {
    __device__ __forceinline__ static int id() { return WARP ? (threadIdx.x & 31) : threadIdx.x; }
    __device__ __forceinline__ static int size() { return WARP ? 32 : blockDim.x; }
    __device__ __forceinline__ static void sync() {
        if (WARP) __syncwarp(); else __syncthreads();
    }
};

// In place, the unnormalised Walsh-Hadamard transform of `count` vectors of D values (D a
// power of two) in shared memory, by the team. Each butterfly computes u + v and u - v as the
// reference's fwht does, so the results are bit-identical to it.
template <bool WARP, int D>
__device__ __forceinline__ void tq_fwht(float* y, int count) {
    using T = TqTeam<WARP>;
#pragma unroll
    for (int h = 1; h < D; h <<= 1) {
        T::sync();
        for (int b = T::id(); b < count * (D / 2); b += T::size()) {
            const int v = b / (D / 2), k = b % (D / 2);
            float* x = y + v * D;
            const int i = (k / h) * 2 * h + k % h;
            const float u = x[i], w = x[i + h];
            x[i] = __fadd_rn(u, w);
            x[i + h] = __fsub_rn(u, w);
        }
    }
    T::sync();
}

// y <- R y for `count` vectors of D values in shared memory (Rotation::apply), or R^T y with
// INVERSE (Rotation::apply_inverse), by the team; `tmp` is shared scratch of count * D values
// (dense rotations only). Hadamard, R = H S2 H S1 / D (H unnormalised, S1 and S2 the sign
// diagonals): bit-identical to the reference (the sign flips and the scaling by 1 / D, a power
// of two, are exact). Dense: each output sums its D products in order, which rounds
// differently from the reference's vectorised dot product.
template <bool WARP, int D, bool INVERSE = false>
__device__ __forceinline__ void tq_rotate(float* y, float* tmp, int count, const float* rot, bool dense) {
    using T = TqTeam<WARP>;
    T::sync();
    if constexpr ((D & (D - 1)) == 0) {
        if (!dense) {
            if (!INVERSE)
                for (int i = T::id(); i < count * D; i += T::size()) y[i] = __fmul_rn(y[i], rot[i % D]);
            tq_fwht<WARP, D>(y, count);
            for (int i = T::id(); i < count * D; i += T::size()) y[i] = __fmul_rn(y[i], rot[D + i % D]);
            tq_fwht<WARP, D>(y, count);
            const float inv = 1.f / (float)D;
            for (int i = T::id(); i < count * D; i += T::size())
                y[i] = __fmul_rn(y[i], INVERSE ? rot[i % D] * inv : inv);
            T::sync();
            return;
        }
    }
    for (int i = T::id(); i < count * D; i += T::size()) tmp[i] = y[i];
    T::sync();
    for (int i = T::id(); i < count * D; i += T::size()) {
        const int c = i % D;
        const float* x = tmp + (i / D) * D;
        float s = 0.f;
        for (int j = 0; j < D; ++j) s = fmaf(INVERSE ? rot[(size_t)j * D + c] : rot[(size_t)c * D + j], x[j], s);
        y[i] = s;
    }
    T::sync();
}

// The randomized Hadamard rotation of tq_rotate (y <- R y, or R^T y with INVERSE) of one
// vector held by the calling warp in registers, coordinate 32 j + lane in x[j] (power-of-two
// D >= 32): butterflies across lanes by shuffles, within a lane past 32, so no shared memory
// and no barriers. The stages run in another order than tq_fwht's, which rounds differently:
// for attention, not for the codec's bit-exact encoding.
template <int D, bool INVERSE = false>
__device__ __forceinline__ void tq_rotate_regs(float (&x)[D / 32], const float* signs) {
    static_assert(D >= 32 && (D & (D - 1)) == 0, "a power-of-two head dim of 32 or more");
    constexpr int J = D / 32;
    const int lane = threadIdx.x & 31;
    auto fwht = [&]() {
#pragma unroll
        for (int h = 1; h < 32; h <<= 1)
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const float p = __shfl_xor_sync(0xffffffffu, x[j], h);
                x[j] = (lane & h) ? p - x[j] : x[j] + p;
            }
#pragma unroll
        for (int h = 1; h < J; h <<= 1)
#pragma unroll
            for (int j = 0; j < J; ++j)
                if ((j & h) == 0) {
                    const float u = x[j], w = x[j + h];
                    x[j] = u + w;
                    x[j + h] = u - w;
                }
    };
    if (!INVERSE)
#pragma unroll
        for (int j = 0; j < J; ++j) x[j] *= signs[32 * j + lane];
    fwht();
#pragma unroll
    for (int j = 0; j < J; ++j) x[j] *= signs[D + 32 * j + lane];
    fwht();
    const float inv = 1.f / (float)D;
#pragma unroll
    for (int j = 0; j < J; ++j) x[j] *= INVERSE ? signs[32 * j + lane] * inv : inv;
}

// The codes of one head vector (codes[i] for coordinate i) packed into `row` by the calling
// warp, least significant bits first.
template <int D, int BITS>
__device__ __forceinline__ void tq_pack_warp(const uint8_t* codes, uint8_t* row) {
    constexpr int CB = D * BITS / 8;
    for (int k = threadIdx.x & 31; k < CB; k += 32) {
        uint32_t byte = 0;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const int g = 8 * k + b, i = g / BITS;
            byte |= ((codes[i] >> (g % BITS)) & 1u) << b;
        }
        row[k] = (uint8_t)byte;
    }
}

// TqCodec::encode of one head vector by the calling warp: y (shared, D values, already scaled
// by the key scales) becomes the packed codes and f32 norm of `row`; y is overwritten, `tmp`
// (D values) and `codes` (D bytes) are shared scratch. The codes and the norm are bit-identical
// to the reference's with a Hadamard rotation: the norm sums the squares in the same order
// with the same roundings (no fused multiply-adds), the butterflies are the same additions,
// and a code counts the boundaries strictly below the coordinate, as the reference does.
template <int D>
__device__ __forceinline__ void tq_encode_warp(float* y, float* tmp, uint8_t* codes, uint8_t* row,
                                               const float* table, int bits, bool dense) {
    const int code_bytes = D * bits / 8;
    const int lane = threadIdx.x & 31;
    __syncwarp();
    float norm = 0.f;
    if (lane == 0) {
        // In order, as the reference's f32 sum of squares.
        float n = 0.f;
#pragma unroll 16
        for (int i = 0; i < D; ++i) n = __fadd_rn(n, __fmul_rn(y[i], y[i]));
        norm = __fsqrt_rn(n);
    }
    norm = __shfl_sync(0xffffffffu, norm, 0);
    const float inv = __fdiv_rn(1.f, fmaxf(norm, 1e-6f));
    tq_rotate<true, D>(y, tmp, 1, table + TQ_ROTATION, dense);
    for (int i = lane; i < D; i += 32) {
        const float v = __fmul_rn(y[i], inv);
        int idx = 0;
#pragma unroll
        for (int k = 0; k < 15; ++k) idx += v > table[TQ_BOUNDS + k];  // unused boundaries are +inf
        codes[i] = (uint8_t)idx;
    }
    __syncwarp();
    if (bits == 2) tq_pack_warp<D, 2>(codes, row);
    else if (bits == 3) tq_pack_warp<D, 3>(codes, row);
    else tq_pack_warp<D, 4>(codes, row);
    if (lane < 4) row[code_bytes + lane] = (uint8_t)(__float_as_uint(norm) >> (8 * lane));
    __syncwarp();
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

// The 8 codes of group g as tq_codes8, in one or two loads where the row's layout aligns them:
// rows of D bits / 8 + 4 bytes are 4-aligned for 4 bits, 2-aligned for 2 bits and, when D is
// a multiple of 16, for 3 bits (in the cache, and in tiles that start 16-aligned and keep its
// row sizes).
template <int D>
__device__ __forceinline__ uint32_t tq_codes8_aligned(const uint8_t* row, int g, int bits) {
    const uint8_t* p = row + g * bits;
    if (bits == 4) return *reinterpret_cast<const uint32_t*>(p);
    if (bits == 2) return *reinterpret_cast<const uint16_t*>(p);
    if (D % 16 == 0) {
        if (g & 1) return p[0] | ((uint32_t)*reinterpret_cast<const uint16_t*>(p + 1) << 8);
        return *reinterpret_cast<const uint16_t*>(p) | ((uint32_t)p[2] << 16);
    }
    return tq_codes8(row, g, bits);
}

__device__ __forceinline__ float tq_norm_aligned(const uint8_t* row, int code_bytes) {
    const uint8_t* p = row + code_bytes;
    if (((uintptr_t)p & 3) == 0) return *reinterpret_cast<const float*>(p);
    return tq_norm(row, code_bytes);
}
