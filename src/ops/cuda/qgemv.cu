// Quantized matrices on the GPU (see ops/qmatmul/cuda.rs), two forms of the CPU's packed
// 32-weight blocks (ops/qmatmul/packed.rs), each decoding to the CPU's weights bit for bit:
// - blocks (qgemv, qdequant): codes `[N][NB][C]` bytes (16-byte aligned) and one plane per
//   32-bit word of a block (its scales, minimum, high bits), each f32, or bf16 or f16 where
//   every word of the matrix is exactly one, with one entry for 2^shift consecutive blocks of a
//   row where they all carry the same word (an MLX group of 64 or 128 weights): `[N][ceil(NB /
//   2^shift)]`, row-major, so a warp's loads of one plane are contiguous;
// - tiles (qtile, qtile_dequant), for 4-bit codes: see below.
// So the bytes streamed are the checkpoint's (MLX 4-bit, group 64: 4.5 bits a weight, not 6).
//
// qgemv: y = x W^T for the few rows of a decode step, one pass over the quantized bytes. A
// warp (or wpr warps) per R output rows, each lane a block at a time (its codes in one or two
// 16-byte loads), each decoded weight used for all M rows of x and each x value for R rows;
// f32 sums in an order that does not depend on M. qdequant: W to a dense [N, K] matrix of T,
// for prompts (a GEMM follows).
#include "common.cuh"
#include "mma.cuh"

#define QGEMV_THREADS 256

// Block formats, as ops/qmatmul/packed.rs's BlockFormat (the discriminants qmatmul/cuda.rs
// passes): words per block and code bytes per block.
#define F_Q4_0 0
#define F_Q4_1 1
#define F_Q5_0 2
#define F_Q5_1 3
#define F_Q8_0 4
#define F_Q6 5
#define F_Q3 6
#define F_A8 7

template <int F> struct Fmt;
template <> struct Fmt<F_Q4_0> { static constexpr int W = 1, C = 16; };
template <> struct Fmt<F_Q4_1> { static constexpr int W = 2, C = 16; };
template <> struct Fmt<F_Q5_0> { static constexpr int W = 2, C = 16; };
template <> struct Fmt<F_Q5_1> { static constexpr int W = 3, C = 16; };
template <> struct Fmt<F_Q8_0> { static constexpr int W = 1, C = 32; };
template <> struct Fmt<F_Q6> { static constexpr int W = 4, C = 16; };
template <> struct Fmt<F_Q3> { static constexpr int W = 5, C = 0; };
template <> struct Fmt<F_A8> { static constexpr int W = 2, C = 32; };

// One block's raw data: its words and codes, loaded before any is decoded.
template <int F> struct Raw {
    float w[Fmt<F>::W];
    uint4 c[Fmt<F>::C / 16 > 0 ? Fmt<F>::C / 16 : 1];
};

// The word planes of a matrix: plane i's start, its entries per row, and its form from
// `layout` (4 bits a plane: bits 0-1 the dtype, 0 f32, 1 bf16, 2 f16; bits 2-3 the shift).
// Each plane starts 16-byte aligned; qmatmul/cuda.rs lays them out the same way.
#define QW_F32 0
#define QW_BF16 1
#define QW_F16 2
template <int F> struct Words {
    const uint8_t* at[Fmt<F>::W];
    int per_row[Fmt<F>::W];
    uint32_t layout;
    __device__ __forceinline__ Words(const uint8_t* base, uint32_t layout, int n, int nb) : layout(layout) {
        size_t off = 0;
#pragma unroll
        for (int i = 0; i < Fmt<F>::W; ++i) {
            const uint32_t form = (layout >> (4 * i)) & 15u, shift = form >> 2;
            per_row[i] = (nb + (1 << shift) - 1) >> shift;
            at[i] = base + off;
            off += ((size_t)n * per_row[i] * ((form & 3u) == QW_F32 ? 4 : 2) + 15) & ~(size_t)15;
        }
    }
    // Word i of block b of `row`, as the f32 (or the bits) the CPU holds.
    __device__ __forceinline__ float get(int i, size_t row, int b) const {
        const uint32_t form = (layout >> (4 * i)) & 15u;
        const size_t e = row * per_row[i] + (b >> (form >> 2));
        if ((form & 3u) == QW_F32) return __ldcs(reinterpret_cast<const float*>(at[i]) + e);
        const unsigned short h = __ldcs(reinterpret_cast<const unsigned short*>(at[i]) + e);
        return (form & 3u) == QW_BF16 ? __uint_as_float((uint32_t)h << 16) : __half2float(__ushort_as_half(h));
    }
};

template <int F>
__device__ __forceinline__ void load_block(Raw<F>& r, const Words<F>& words, const uint8_t* __restrict__ codes,
                                           size_t row, int b, int nb) {
#pragma unroll
    for (int i = 0; i < Fmt<F>::W; ++i) r.w[i] = words.get(i, row, b);
#pragma unroll
    for (int i = 0; i < Fmt<F>::C / 16; ++i)
        r.c[i] = __ldcs(reinterpret_cast<const uint4*>(codes + (row * nb + b) * Fmt<F>::C) + i);
}

// How a block's weight j comes from its code q_j: w_j = (q_j - OFF) * scale, with scale word
// 0 for weights 0..16 and word TWO for 16..32 (1 where a block has two scales), then + word 1
// where the format has a minimum (MIN).
template <int F> struct Dec;
template <> struct Dec<F_Q4_0> { static constexpr int OFF = 8, TWO = 0; static constexpr bool MIN = false; };
template <> struct Dec<F_Q4_1> { static constexpr int OFF = 0, TWO = 0; static constexpr bool MIN = true; };
template <> struct Dec<F_Q5_0> { static constexpr int OFF = 16, TWO = 0; static constexpr bool MIN = false; };
template <> struct Dec<F_Q5_1> { static constexpr int OFF = 0, TWO = 0; static constexpr bool MIN = true; };
template <> struct Dec<F_Q8_0> { static constexpr int OFF = 128, TWO = 0; static constexpr bool MIN = false; };
template <> struct Dec<F_Q6> { static constexpr int OFF = 32, TWO = 1; static constexpr bool MIN = false; };
template <> struct Dec<F_Q3> { static constexpr int OFF = 4, TWO = 1; static constexpr bool MIN = false; };
template <> struct Dec<F_A8> { static constexpr int OFF = 0, TWO = 0; static constexpr bool MIN = true; };

// Bits 0..4 of s to bit 0 of bytes 0..4 (the four shifted copies of s do not overlap).
__device__ __forceinline__ uint32_t spread1(uint32_t s) { return (s * 0x00204081u) & 0x01010101u; }
// The 2-bit fields 0..4 of s (8 bits) to bits 0..2 of bytes 0..4: even and odd fields apart,
// so that the shifted copies do not overlap.
__device__ __forceinline__ uint32_t spread2(uint32_t s) {
    return (((s & 0x33u) * 0x00001001u) & 0x00030003u) | (((s & 0xCCu) * 0x00040040u) & 0x03000300u);
}

// The codes of weights 16 h + 4 t + e (e = 0..4) in the bytes e of one word. Nibble codes:
// byte i holds weight i (low) and 16 + i (high); Q8_0 and A8: byte i of vector h is weight
// 16 h + i (Q8_0's int8 made unsigned, + 128).
template <int F> __device__ __forceinline__ uint32_t quad(const Raw<F>& r, int t, int h) {
    if constexpr (F == F_Q8_0 || F == F_A8) {
        const uint4& v = r.c[h];
        const uint32_t u = t == 0 ? v.x : t == 1 ? v.y : t == 2 ? v.z : v.w;
        return F == F_Q8_0 ? u ^ 0x80808080u : u;
    } else if constexpr (F == F_Q3) {
        const uint32_t l = spread2((__float_as_uint(r.w[2 + h]) >> (8 * t)) & 0xffu);
        return l | spread1((__float_as_uint(r.w[4]) >> (16 * h + 4 * t)) & 15u) << 2;
    } else {
        const uint4& v = r.c[0];
        const uint32_t u = t == 0 ? v.x : t == 1 ? v.y : t == 2 ? v.z : v.w;
        uint32_t q = (h ? u >> 4 : u) & 0x0F0F0F0Fu;
        if constexpr (F == F_Q5_0 || F == F_Q5_1)
            q |= spread1((__float_as_uint(r.w[F == F_Q5_0 ? 1 : 2]) >> (16 * h + 4 * t)) & 15u) << 4;
        if constexpr (F == F_Q6) q |= spread2((__float_as_uint(r.w[2 + h]) >> (8 * t)) & 0xffu) << 4;
        return q;
    }
}

// q_j - OFF as a float, exactly: the byte under the exponent of 2^23 (a byte permute), then
// 2^23 + OFF taken away. An int-to-float conversion runs at an eighth of the FP32 rate on
// sm_90; this is one integer op and one add.
template <int F> __device__ __forceinline__ float value(const Raw<F>& r, int j) {
    const uint32_t bits = __byte_perm(quad<F>(r, (j & 15) >> 2, j >> 4), 0x4B000000u, 0x7440u | (j & 3));
    return __fsub_rn(__uint_as_float(bits), (float)(8388608 + Dec<F>::OFF));
}

// Weight j of a block as the CPU decodes it (two roundings where there is a minimum).
template <int F> __device__ __forceinline__ float weight(const Raw<F>& r, int j) {
    const float v = value<F>(r, j);
    if constexpr (Dec<F>::MIN) return __fadd_rn(__fmul_rn(v, r.w[0]), r.w[1]);
    else return __fmul_rn(v, r.w[Dec<F>::TWO * (j >> 4)]);
}

// Rows of W a warp takes at once, by rows of x: each x value a lane loads then serves R rows,
// so that the loads of x (from L1) do not outgrow the weights' from memory as M grows.
// launch::rows_per_warp in qmatmul/cuda.rs mirrors it.
template <int M> struct RowsPerWarp { static constexpr int R = M == 1 ? 1 : M <= 3 ? 2 : 4; };

// The products are taken on the codes and scaled once a block (a half block where it has two
// scales): y += scale * sum_j (q_j - OFF) x_j (+ min * sum_j x_j), not as sum_j w_j x_j, so a
// weight costs a byte permute, an add and one FMA per row of x. That is the CPU's result up
// to f32 rounding (not bit for bit), and a row's sums still do not depend on M.
//
// A lane takes one block at a time (its R rows' loads, then their products): on an H100
// (2026-12-05, Qwen2.5-7B's shapes in one graph) loading two or four blocks ahead was 5-10%
// slower for every format and R (ptxas schedules each block's loads next to their uses
// either way).
template <int F, typename T, int M, int R>
__device__ void qgemv(T* __restrict__ y, const T* __restrict__ x, const uint8_t* __restrict__ wbase, uint32_t layout,
                      const uint8_t* __restrict__ codes, int n, int nb, int wpr) {
    constexpr int WARPS = QGEMV_THREADS / 32;
    constexpr int V = Vec16<T>::N;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp % wpr;
    const int row0 = (blockIdx.x * (WARPS / wpr) + warp / wpr) * R;
    const int k = nb * 32, stride = 32 * wpr;
    const Words<F> words(wbase, layout, n, nb);
    __shared__ float partial[WARPS][R][M];
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    if (row0 < n) {
        // A lane takes blocks part * 32 + lane + j * stride in order of j, whatever R. Rows
        // past n read row n - 1 and are not written.
        for (int b = part * 32 + lane; b < nb; b += stride) {
            Raw<F> raw[R];
#pragma unroll
            for (int r = 0; r < R; ++r) load_block<F>(raw[r], words, codes, (size_t)min(row0 + r, n - 1), b, nb);
            {
                float s[R][M], xs[M];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    xs[m] = 0.f;
#pragma unroll
                    for (int r = 0; r < R; ++r) s[r][m] = 0.f;
                }
#pragma unroll
                for (int c = 0; c < 32 / V; ++c) {
                    // This chunk's weights, decoded once for all rows of x.
                    float v[R][V];
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int e = 0; e < V; ++e) v[r][e] = value<F>(raw[r], c * V + e);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float xv[V];
                        load16<T>(x + (size_t)m * k + (size_t)b * 32 + c * V, xv);
#pragma unroll
                        for (int e = 0; e < V; ++e) {
                            if constexpr (Dec<F>::MIN) xs[m] += xv[e];
#pragma unroll
                            for (int r = 0; r < R; ++r) s[r][m] = fmaf(v[r][e], xv[e], s[r][m]);
                        }
                    }
                    // A block with two scales: its first half is scaled when done.
                    if (Dec<F>::TWO && (c + 1) * V == 16)
#pragma unroll
                        for (int r = 0; r < R; ++r)
#pragma unroll
                            for (int m = 0; m < M; ++m) {
                                acc[r][m] = fmaf(raw[r].w[0], s[r][m], acc[r][m]);
                                s[r][m] = 0.f;
                            }
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        acc[r][m] = fmaf(raw[r].w[Dec<F>::TWO], s[r][m], acc[r][m]);
                        if constexpr (Dec<F>::MIN) acc[r][m] = fmaf(raw[r].w[1], xs[m], acc[r][m]);
                    }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) partial[warp][r][m] = acc[r][m];
    }
    __syncthreads();
    if (lane == 0 && part == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (row0 + r >= n) break;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float s = 0.f;
                for (int p = 0; p < wpr; ++p) s += partial[warp + p][r][m];
                y[(size_t)m * n + row0 + r] = from_f<T>(s);
            }
        }
    }
}

// One thread per block of the matrix: its 32 weights as T into out [N, K].
template <int F, typename T>
__device__ void qdequant(T* __restrict__ out, const uint8_t* __restrict__ wbase, uint32_t layout,
                         const uint8_t* __restrict__ codes, int n, int nb) {
    const size_t blk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= (size_t)n * nb) return;
    const Words<F> words(wbase, layout, n, nb);
    Raw<F> raw;
    load_block<F>(raw, words, codes, blk / nb, (int)(blk % nb), nb);
    float wf[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) wf[j] = weight<F>(raw, j);
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int v = 0; v < 32 / V; ++v) store16<T>(out + blk * 32 + v * V, wf + v * V);
}

// ---- 4-bit codes on tensor cores (Q4_0, Q4_1: GGUF Q4_0/Q4_1/Q4_K, MLX 2-4 bits) ----
//
// The layout (ops/qmatmul/cuda.rs, `tile_stream`): rows in tiles of 16 (the last padded with
// zero codes and words), each tile one stream of chunks of TILE_G blocks (128 weights of a row;
// the last chunk padded with zero blocks), a chunk its codes and then its words, so that one
// run of 16-byte copies brings a chunk in:
// - codes, 1024 bytes: `[2 pairs][32 lanes][2 blocks][2 k-steps]` u32, made for m16n8k16's A
//   fragment. Lane l = 4 g + t holds, for block b's k-step h, a u32 whose nibbles s and 4 + s
//   are register s's two elements: row g + 8 (s & 1), weights 8 t + 4 h + 2 (s >> 1) + {0, 1}
//   of the block. (The weights of a block are permuted so that lane t's B fragments are x's
//   8 t .. 8 t + 8, one 16-byte load; A follows the same order, so the products are the same.)
//   So a lane's codes for two blocks are 16 contiguous bytes, and a register is a shift, one
//   LOP3 and one bf16 or f16 subtraction away: (128 + q) is a bf16 (1024 + q an f16) whose
//   bits are q under a fixed exponent.
// - words: `[TILE_G >> shift groups][8][W][2]` of WT, a group's words (one per 2^shift blocks)
//   for lane group g's rows g and g + 8 side by side, one load for all of them.
//
// qtile: y = x W^T for up to 8 NT rows of x (NT <= 4), each n8 slice of x one MMA per
// k-step with the same decoded A. Per group of blocks sharing their words: c = sum (q - OFF) x
// on the tensor cores (exact products, f32 sums), then y += scale c (+ min sum x, the sum also
// an MMA, with A all ones). f32 x is cut into three bf16 parts (hi + mid + lo = x exactly), one
// MMA each. A column's sums do not depend on the other columns nor on M.
#define TILE_G 4
template <int F> __device__ __forceinline__ constexpr bool tile_format() { return F == F_Q4_0 || F == F_Q4_1; }

// (a & B) | C in one instruction (the compiler emits two for the shift-mask-or of a register).
template <uint32_t B, uint32_t C> __device__ __forceinline__ uint32_t and_or(uint32_t a) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "n"(B), "n"(C));
    return d;
}

// The four A registers of a k-step from its u32: q - OFF as two 16-bit values of type T each.
template <typename T, int OFF> __device__ __forceinline__ void tile_a(uint32_t (&a)[4], uint32_t u) {
    if constexpr (std::is_same<T, __half>::value) {
        // Nibbles 0 and 1 need no shift: 1024 + q and 1024 + 16 q are both f16s.
        const __half2 lo = __half2half2(__ushort_as_half((unsigned short)(0x6400u + OFF)));
        const __half2 sc = __half2half2(__float2half(1.f / 16.f)), hi = __half2half2(__float2half(-64.f - OFF));
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const uint32_t v = p ? u >> 8 : u;
            uint32_t r0 = and_or<0x000F000Fu, 0x64006400u>(v), r1 = and_or<0x00F000F0u, 0x64006400u>(v);
            const __half2 d0 = __hsub2(*reinterpret_cast<const __half2*>(&r0), lo);
            const __half2 d1 = __hfma2(*reinterpret_cast<const __half2*>(&r1), sc, hi);
            a[2 * p] = *reinterpret_cast<const uint32_t*>(&d0);
            a[2 * p + 1] = *reinterpret_cast<const uint32_t*>(&d1);
        }
    } else {
        const __nv_bfloat162 off = __bfloat162bfloat162(__ushort_as_bfloat16((unsigned short)(0x4300u + OFF)));
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const uint32_t r = and_or<0x000F000Fu, 0x43004300u>(u >> (4 * s));
            const __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&r), off);
            a[s] = *reinterpret_cast<const uint32_t*>(&d);
        }
    }
}

// The MMA input type for activations T (f32 is cut into bf16 parts).
template <typename T> struct TileIn { using type = __nv_bfloat16; static constexpr int PARTS = 1; };
template <> struct TileIn<__half> { using type = __half; static constexpr int PARTS = 1; };
template <> struct TileIn<float> { using type = __nv_bfloat16; static constexpr int PARTS = 3; };

// One bf16 register from two f32: hi (the top 16 bits), mid (those of what is left), lo (the
// rest, which fits a bf16), so that hi + mid + lo is the pair exactly.
__device__ __forceinline__ void split3(uint32_t (&b)[3], float x0, float x1) {
    const uint32_t h0 = __float_as_uint(x0) & 0xffff0000u, h1 = __float_as_uint(x1) & 0xffff0000u;
    const float r0 = x0 - __uint_as_float(h0), r1 = x1 - __uint_as_float(h1);
    const uint32_t m0 = __float_as_uint(r0) & 0xffff0000u, m1 = __float_as_uint(r1) & 0xffff0000u;
    const float l0 = r0 - __uint_as_float(m0), l1 = r1 - __uint_as_float(m1);
    b[0] = __byte_perm(h0, h1, 0x7632);
    b[1] = __byte_perm(m0, m1, 0x7632);
    b[2] = __byte_perm(__float_as_uint(l0), __float_as_uint(l1), 0x7632);
}

// Lane t's B fragments of one block for one row of x: x's weights 8 t .. 8 t + 8 of the block
// (`p`, 16-byte aligned), b[h][r][part] for k-step h, register r; zeros where !valid.
template <typename T> struct TileX {
    uint32_t b[2][2][TileIn<T>::PARTS];
    __device__ __forceinline__ void load(const T* p, bool valid) {
        if constexpr (TileIn<T>::PARTS == 1) {
            const uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
            b[0][0][0] = v.x, b[0][1][0] = v.y, b[1][0][0] = v.z, b[1][1][0] = v.w;
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float4 v = valid ? __ldg(reinterpret_cast<const float4*>(p) + h) : make_float4(0.f, 0.f, 0.f, 0.f);
                split3(b[h][0], v.x, v.y);
                split3(b[h][1], v.z, v.w);
            }
        }
    }
};

// A chunk's words: a lane group's words of one group (rows g and g + 8), BYTES of them.
template <int F, typename WT> struct TileWords {
    static constexpr int W = Fmt<F>::W, N = 2 * W, BYTES = N * (int)sizeof(WT);
    // Bytes of a chunk with TILE_G >> shift groups.
    __device__ __forceinline__ static int chunk_bytes(int shift) { return 1024 + (TILE_G >> shift) * 8 * BYTES; }
    // w[i][r]: word i of row g + 8 r, from the BYTES at `p` (4-byte aligned).
    __device__ __forceinline__ static void load(float (&w)[W][2], const uint8_t* p) {
        uint32_t raw[BYTES / 4];
#pragma unroll
        for (int e = 0; e < BYTES / 4; ++e) raw[e] = reinterpret_cast<const uint32_t*>(p)[e];
#pragma unroll
        for (int e = 0; e < N; ++e) {
            float v;
            if constexpr (std::is_same<WT, float>::value) v = __uint_as_float(raw[e]);
            else {
                const unsigned short h = (unsigned short)(raw[e / 2] >> (16 * (e & 1)));
                if constexpr (std::is_same<WT, __half>::value) v = __half2float(__ushort_as_half(h));
                else v = __uint_as_float((uint32_t)h << 16);
            }
            w[e / 2][e & 1] = v;
        }
    }
};

template <int F, typename T, typename WT, int NT>
__device__ void qtile(T* __restrict__ y, const T* __restrict__ x, const uint8_t* __restrict__ tiles, int shift,
                      int n, int m, int nb, int wpr) {
    static_assert(tile_format<F>(), "4-bit codes only");
    using In = typename TileIn<T>::type;
    using Words = TileWords<F, WT>;
    constexpr int P = TileIn<T>::PARTS, WARPS = QGEMV_THREADS / 32;
    constexpr bool MIN = Dec<F>::MIN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int part = warp % wpr, ntiles = (n + 15) >> 4;
    const int tile = blockIdx.x * (WARPS / wpr) + warp / wpr;
    const int k = nb * 32, chunks = (nb + TILE_G - 1) / TILE_G, cb = Words::chunk_bytes(shift);
    // The blocks of a group, less one: a group's last block is b with (b + 1) & gm == 0.
    const int gm = (1 << shift) - 1;
    // All-ones A: its product with x is x's sum over the k-step, in every row.
    uint32_t ones[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) ones[s] = std::is_same<In, __half>::value ? 0x3C003C00u : 0x3F803F80u;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    // Each warp's next chunks in flight, through shared memory (cp.async): loads into
    // registers would be scheduled next to their uses, far too few bytes in flight to cover
    // the memory's latency.
    constexpr int MAXCB = 1024 + TILE_G * 8 * Words::BYTES, STAGES = 4, COPIES = (MAXCB + 511) / 512;
    constexpr int RING = WARPS * STAGES * MAXCB, RED = WARPS * NT * 4 * 32 * 4;
    __shared__ __align__(16) uint8_t smem[RING > RED ? RING : RED];
    uint8_t* ring = smem + warp * STAGES * MAXCB;
    pdl_launch_dependents();  // the kernel after it may launch (it waits for y itself)
    {
        // Warp `part` of a tile takes chunks part, part + wpr, ...: `count` of them (none past
        // the last tile). Each lane copies the 16 bytes at 16 lane + 512 j of a chunk, for
        // j < COPIES where the chunk has them.
        const int count = tile < ntiles ? (chunks - part + wpr - 1) / wpr : 0;
        const uint8_t* src = tiles + ((size_t)tile * chunks + part) * cb + 16 * lane;
        const size_t src_step = (size_t)wpr * cb;
        const uint32_t dst = smem_addr(ring) + 16 * lane;
        bool has[COPIES];
#pragma unroll
        for (int j = 0; j < COPIES; ++j) has[j] = 16 * lane + 512 * j < cb;
        auto fetch = [&](int i) {
            if (i < count) {
                // Past L1 (cp.async.cg): the streamed weights must not evict x, which every
                // tile reads again.
#pragma unroll
                for (int j = 0; j < COPIES; ++j)
                    if (has[j]) cp_async16(dst + (i & (STAGES - 1)) * MAXCB + 512 * j, src + 512 * j, true);
                src += src_step;
            }
            cp_async_commit_group();  // empty past the end, so the count of groups stays right
        };
        // Lane g's rows of x at the warp's next chunk (columns past m read row m - 1 and are not
        // used).
        const T* xl[NT];
        bool col[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            xl[j] = x + (size_t)min(8 * j + g, m - 1) * k + 8 * t + part * TILE_G * 32;
            col[j] = 8 * j + g < m;
        }
        const int x_step = wpr * TILE_G * 32;
        // The weights do not come from the kernel before; x does (launched as a programmatic
        // dependent: the first chunks stream in while that kernel ends).
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) fetch(i);
        pdl_wait();
        for (int i = 0; i < count; ++i) {
            __syncwarp();  // every lane is done with the stage the next copies refill
            fetch(i + STAGES - 1);
            // Blocks of this chunk within the row (the last chunk may be cut short).
            const int left = nb - (part + wpr * i) * TILE_G;
            TileX<T> xv[TILE_G][NT];
#pragma unroll
            for (int blk = 0; blk < TILE_G; ++blk)
#pragma unroll
                for (int j = 0; j < NT; ++j) xv[blk][j].load(xl[j] + blk * 32, blk < left && col[j]);
#pragma unroll
            for (int j = 0; j < NT; ++j) xl[j] += x_step;
            cp_async_wait_group<STAGES - 1>();
            __syncwarp();  // the stage's bytes came through other lanes' copies
            const uint8_t* stage = ring + (i & (STAGES - 1)) * MAXCB;
            float c[NT][4], xs[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) c[j][e] = xs[j][e] = 0.f;
#pragma unroll
            for (int pair = 0; pair < TILE_G / 2; ++pair) {
                const uint4 code = *reinterpret_cast<const uint4*>(stage + 512 * pair + 16 * lane);
#pragma unroll
                for (int bi = 0; bi < 2; ++bi) {
                    const int blk = 2 * pair + bi;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        uint32_t a[4];
                        tile_a<In, Dec<F>::OFF>(a, bi ? (h ? code.w : code.z) : (h ? code.y : code.x));
#pragma unroll
                        for (int j = 0; j < NT; ++j)
#pragma unroll
                            for (int p = 0; p < P; ++p) {
                                mma16816<In>(c[j], a, xv[blk][j].b[h][0][p], xv[blk][j].b[h][1][p]);
                                if constexpr (MIN) mma16816<In>(xs[j], ones, xv[blk][j].b[h][0][p], xv[blk][j].b[h][1][p]);
                            }
                    }
                    if (((blk + 1) & gm) == 0) {
                        // The group's last block: its words scale the group's sums.
                        float wd[Fmt<F>::W][2];
                        Words::load(wd, stage + 1024 + ((blk >> shift) * 8 + g) * Words::BYTES);
#pragma unroll
                        for (int j = 0; j < NT; ++j)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                acc[j][e] = fmaf(wd[0][e >> 1], c[j][e], acc[j][e]);
                                if constexpr (MIN) acc[j][e] = fmaf(wd[1][e >> 1], xs[j][e], acc[j][e]);
                                c[j][e] = xs[j][e] = 0.f;
                            }
                    }
                }
            }
        }
        cp_async_wait_group<0>();
    }
    // The tile's parts summed in a fixed order; lane (g, t) holds rows g, g + 8 and columns
    // 8 j + 2 t + {0, 1}.
    if (wpr > 1) {
        // The ring's memory, now free (every lane's copies have landed).
        __syncthreads();
        auto& partial = *reinterpret_cast<float (*)[WARPS][NT][4][32]>(smem);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[warp][j][e][lane] = acc[j][e];
        __syncthreads();
        if (part != 0) return;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float s = 0.f;
                for (int p = 0; p < wpr; ++p) s += partial[warp + p][j][e][lane];
                acc[j][e] = s;
            }
    }
    if (tile >= ntiles) return;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = tile * 16 + g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
            if (row < n && col < m) y[(size_t)col * n + row] = from_f<T>(acc[j][e]);
        }
}

// One thread per (row, block): its 32 weights as T into out [N, K], as the CPU decodes them.
template <int F, typename T, typename WT>
__device__ void qtile_dequant(T* __restrict__ out, const uint8_t* __restrict__ tiles, int shift, int n, int nb) {
    using Words = TileWords<F, WT>;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * nb) return;
    const int row = (int)(i / nb), b = (int)(i % nb), tile = row >> 4, r = row & 15;
    const int chunks = (nb + TILE_G - 1) / TILE_G, blk = b % TILE_G, cb = Words::chunk_bytes(shift);
    const uint8_t* chunk = tiles + ((size_t)tile * chunks + b / TILE_G) * cb;
    float wd[Fmt<F>::W][2];
    Words::load(wd, chunk + 1024 + ((blk >> shift) * 8 + (r & 7)) * Words::BYTES);
    const float d = wd[0][r >> 3], mn = Dec<F>::MIN ? wd[Fmt<F>::W - 1][r >> 3] : 0.f;
    const uint32_t* codes = reinterpret_cast<const uint32_t*>(chunk + 512 * (blk >> 1)) + 2 * (blk & 1);
    float wf[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        // Weight j is lane 4 (r % 8) + j / 8's, k-step (j / 4) % 2, register r / 8 + 2 ((j / 2) % 2).
        const int s = (r >> 3) + 2 * ((j >> 1) & 1), lane = 4 * (r & 7) + (j >> 3);
        const uint32_t u = codes[4 * lane + ((j >> 2) & 1)];
        const float v = (float)(((u >> (4 * s + 16 * (j & 1))) & 15u)) - (float)Dec<F>::OFF;
        wf[j] = Dec<F>::MIN ? __fadd_rn(__fmul_rn(v, d), mn) : __fmul_rn(v, d);
    }
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int v = 0; v < 32 / V; ++v) store16<T>(out + i * 32 + v * V, wf + v * V);
}

// Kernels qtile_{format}_{x type}_w{word type}_{NT}, NT in 1, 2, 4 (M up to 8 NT; MAX_TILE_ROWS
// in qmatmul/cuda.rs).
#define QTILE(FN, F, TN, T, WN, WT, NT)                                                                         \
    extern "C" __global__ void __launch_bounds__(QGEMV_THREADS)                                                 \
        qtile_##FN##_##TN##_w##WN##_##NT(T* y, const T* x, const uint8_t* tiles, int shift, int n, int m,     \
                                         int nb, int wpr) {                                                     \
        qtile<F, T, WT, NT>(y, x, tiles, shift, n, m, nb, wpr);                                                 \
    }
#define QTILE_DEQUANT(FN, F, TN, T, WN, WT)                                                                     \
    extern "C" __global__ void qtile_dequant_##FN##_##TN##_w##WN(T* out, const uint8_t* tiles, int shift, int n, \
                                                                 int nb) {                                      \
        qtile_dequant<F, T, WT>(out, tiles, shift, n, nb);                                                      \
    }
#define QTILE_COLS(FN, F, TN, T, WN, WT)                                                                        \
    QTILE(FN, F, TN, T, WN, WT, 1) QTILE(FN, F, TN, T, WN, WT, 2) QTILE(FN, F, TN, T, WN, WT, 4)                \
    QTILE_DEQUANT(FN, F, TN, T, WN, WT)
#define QTILE_WORDS(FN, F, TN, T)                                                                               \
    QTILE_COLS(FN, F, TN, T, f32, float) QTILE_COLS(FN, F, TN, T, bf16, __nv_bfloat16)                          \
    QTILE_COLS(FN, F, TN, T, f16, __half)
#define QTILE_TYPES(FN, F)                                                                                      \
    QTILE_WORDS(FN, F, f32, float) QTILE_WORDS(FN, F, bf16, __nv_bfloat16) QTILE_WORDS(FN, F, f16, __half)

QTILE_TYPES(q4_0, F_Q4_0)
QTILE_TYPES(q4_1, F_Q4_1)

#define QGEMV(FN, F, TN, T, M)                                                                                  \
    extern "C" __global__ void __launch_bounds__(QGEMV_THREADS)                                                 \
        qgemv_##FN##_##TN##_##M(T* y, const T* x, const uint8_t* words, uint32_t layout,                   \
                                const uint8_t* codes, int n, int nb, int wpr) {                                 \
        qgemv<F, T, M, RowsPerWarp<M>::R>(y, x, words, layout, codes, n, nb, wpr);                              \
    }
#define QDEQUANT(FN, F, TN, T)                                                                                  \
    extern "C" __global__ void qdequant_##FN##_##TN(T* out, const uint8_t* words, uint32_t layout,           \
                                                    const uint8_t* codes, int n, int nb) {                      \
        qdequant<F, T>(out, words, layout, codes, n, nb);                                                               \
    }
#define QGEMV_ROWS(FN, F, TN, T)                                                                                \
    QGEMV(FN, F, TN, T, 1) QGEMV(FN, F, TN, T, 2) QGEMV(FN, F, TN, T, 3) QGEMV(FN, F, TN, T, 4)                 \
    QGEMV(FN, F, TN, T, 5) QGEMV(FN, F, TN, T, 6) QGEMV(FN, F, TN, T, 7) QGEMV(FN, F, TN, T, 8)                 \
    QDEQUANT(FN, F, TN, T)
#define QGEMV_TYPES(FN, F)                                                                                      \
    QGEMV_ROWS(FN, F, f32, float) QGEMV_ROWS(FN, F, bf16, __nv_bfloat16) QGEMV_ROWS(FN, F, f16, __half)

// 4-bit codes (q4_0, q4_1) are held in tiles and take qtile.
QGEMV_TYPES(q5_0, F_Q5_0)
QGEMV_TYPES(q5_1, F_Q5_1)
QGEMV_TYPES(q8_0, F_Q8_0)
QGEMV_TYPES(q6, F_Q6)
QGEMV_TYPES(q3, F_Q3)
QGEMV_TYPES(a8, F_A8)
