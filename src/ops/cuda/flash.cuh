// One warp's share of FlashAttention-2 on tensor cores (bf16 / f16), for the kernels that
// attend over the paged cache with it: prompt chunks (prefill_attention.cu: a warp per 16 query
// rows) and decodes (decode_attention.cu: a warp per 16 keys of a tile, the rows being the
// query heads that share one KV head). Scores are accumulated in f32 from the exact products
// of the 16-bit inputs; probabilities are rounded to the input type for the P V product (as
// FlashAttention does); the output accumulates in f32.
#pragma once
#include "mma.cuh"

#define FLASH_LOG2E 1.4426950408889634f

// 16-bit rows of Q, K and V in shared memory: 16 bytes apart mod 128, so ldmatrix reads them
// without bank conflicts.
__host__ __device__ constexpr int flash_ld(int d) { return d + 8; }

// A warp's 16 rows of a tile: their running max and sum, and their output rows, in registers.
// Lane l holds rows l / 4 and l / 4 + 8 (`i` = 0, 1 below) of the warp's; of each row, output
// columns 8 n + 2 (l % 4) and the next, for every n.
template <typename T, int D> struct FlashWarp {
    static constexpr int LD = flash_ld(D);
    static constexpr int NT = D / 8;  // output column tiles of 8
    const T* Q_w;                     // the warp's 16 query rows in shared memory
    int row0;                         // the tile row of the first of them
    int lane;
    float o[NT][4];
    float m[2] = {-INFINITY, -INFINITY};  // in log2 units (scores times log2 e)
    float l[2] = {0.f, 0.f};              // this lane's part of the sum; whole after finish()

    __device__ __forceinline__ FlashWarp(const T* Q_w, int row0) : Q_w(Q_w), row0(row0) {
        lane = threadIdx.x % 32;
#pragma unroll
        for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    }
    // The tile row of this lane's row i.
    __device__ __forceinline__ int row(int i) const { return row0 + lane / 4 + 8 * i; }

    // The NK keys at positions [k0, k0 + NK) (in K_s and V_s, NK rows of LD) join the
    // softmax; row i reads positions [a[i], b[i]] of them (none when a[i] > b[i]).
    template <int NK>
    __device__ __forceinline__ void attend(const T* K_s, const T* V_s, int k0, const int (&a)[2], const int (&b)[2],
                                           float scale, float softcap) {
        static_assert(NK % 16 == 0, "keys come in 16s");
        // S = Q K^T: NK / 8 column tiles of 8 keys.
        float s[NK / 8][4];
#pragma unroll
        for (int n = 0; n < NK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[4];
            ldsm_x4<false>(qa, Q_w + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < NK / 16; ++np) {
                uint32_t kb[4];  // keys np*16 + [0, 8) then [8, 16), each dims [0, 8) and [8, 16) of kk
                ldsm_x4<false>(kb, K_s + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                                       ((lane >> 3) & 1) * 8);
                mma16816<T>(s[2 * np], qa, kb[0], kb[1]);
                mma16816<T>(s[2 * np + 1], qa, kb[2], kb[3]);
            }
        }
        // Online softmax: masked scores, each row's max over its quad of lanes.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1, j = k0 + 8 * n + 2 * (lane & 3) + (e & 1);
                float v = s[n][e] * scale;
                if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
                v = j >= a[i] && j <= b[i] ? v * FLASH_LOG2E : -INFINITY;
                s[n][e] = v;
                mx[i] = fmaxf(mx[i], v);
            }
        }
        float base[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float m_new = fmaxf(m[i], mx[i]);
            base[i] = m_new == -INFINITY ? 0.f : m_new;
            const float corr = exp2f(m[i] - base[i]);
            m[i] = m_new;
            l[i] *= corr;
#pragma unroll
            for (int n = 0; n < NT; ++n) o[n][2 * i] *= corr, o[n][2 * i + 1] *= corr;
        }
#pragma unroll
        for (int n = 0; n < NK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(s[n][e] - base[e >> 1]);
                l[e >> 1] += s[n][e];
            }
        }
        // O += P V: the scores' accumulators, rounded to T, are P's operand fragments.
#pragma unroll
        for (int kk = 0; kk < NK / 16; ++kk) {
            const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t vb[4];  // keys kk*16 + [0, 8) and [8, 16) of dims dp*16 + [0, 8), then of [8, 16)
                ldsm_x4<true>(vb, V_s + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 +
                                      (lane >> 4) * 8);
                mma16816<T>(o[2 * dp], pa, vb[0], vb[1]);
                mma16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
    }

    // The rows' sums over their quads: l is then each row's whole sum.
    __device__ __forceinline__ void finish() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        }
    }

    // After finish(): put(i, column, value) for the normalised output of this lane's columns.
    template <typename Put> __device__ __forceinline__ void each_output(Put put) const {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
            for (int n = 0; n < NT; ++n) put(i, 8 * n + 2 * (lane & 3), o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        }
    }
};
