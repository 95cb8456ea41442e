// Attention for prompt chunks with tensor cores (bf16 / f16), over the paged KV cache: the
// same function as paged_attention.cu (see ops/paged_attention.rs, the reference) for the rows
// of sequences that compute many tokens at once. Scores are accumulated in f32 from the exact
// products of the 16-bit inputs; probabilities are rounded to the input type for the P V
// product (as FlashAttention does); the output accumulates in f32.
//
// One block per (tile of up to 64 rows of one sequence, query head); 4 warps of 16 rows. Key
// tiles of 64 positions go through shared memory; each warp keeps its rows' running max and
// sum and its output rows (f32) in shared memory, rescaled when the max grows.
#include "common.cuh"
#include <mma.h>

using namespace nvcuda;

#define PF_ROWS 64
#define PF_KEYS 64
#define PF_WARPS 4

template <int D> struct PfLayout {
    static constexpr int LD = D + 8;          // 16-bit rows of K, V, Q
    static constexpr int LS = PF_KEYS + 4;    // f32 score rows
    static constexpr int LP = PF_KEYS + 8;    // 16-bit probability rows
    static constexpr int LO = D + 4;          // f32 output rows
    static constexpr size_t K = 0;
    static constexpr size_t V = K + 2 * PF_KEYS * LD;
    static constexpr size_t Q = V + 2 * PF_KEYS * LD;
    static constexpr size_t S = Q + 2 * PF_ROWS * LD;
    static constexpr size_t P = S + 4 * PF_ROWS * LS;
    static constexpr size_t O = P + 2 * PF_ROWS * LP;
    static constexpr size_t BYTES = O + 4 * PF_ROWS * LO;  // = 640 D + 30720 (ops/paged_attention.rs)
};

// tiles: 2 u32 per tile: sequence, first row of the tile.
template <typename T, int D>
__device__ void prefill_attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc,
                                  const T* __restrict__ vc, const uint32_t* __restrict__ tiles,
                                  const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                  int num_heads, int num_kv_heads, int block_size, float scale, int window,
                                  float softcap) {
    using L = PfLayout<D>;
    constexpr int V16 = 8;  // 16-bit elements per 16-byte vector
    extern __shared__ __align__(128) unsigned char smem[];
    T* K_s = reinterpret_cast<T*>(smem + L::K);
    T* V_s = reinterpret_cast<T*>(smem + L::V);
    T* Q_s = reinterpret_cast<T*>(smem + L::Q);
    float* S_s = reinterpret_cast<float*>(smem + L::S);
    T* P_s = reinterpret_cast<T*>(smem + L::P);
    float* O_s = reinterpret_cast<float*>(smem + L::O);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const uint32_t s = tiles[2 * blockIdx.x];
    const int r0 = tiles[2 * blockIdx.x + 1];
    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    const uint32_t* bt = block_tables + seq_info[4 * s + 3];
    const int n_rows = min(PF_ROWS, q_start + q_len - r0);
    const int pos0 = ctx - q_len + (r0 - q_start);  // position of the tile's first row
    const int hi = pos0 + n_rows - 1;
    const int lo = window > 0 ? max(0, pos0 + 1 - window) : 0;

    // Q tile (zero rows past the sequence), output rows zeroed.
    for (int i = tid; i < PF_ROWS * (D / V16); i += PF_WARPS * 32) {
        const int r = i / (D / V16), c = (i % (D / V16)) * V16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < n_rows) v = *reinterpret_cast<const uint4*>(q + ((size_t)(r0 + r) * num_heads + h) * D + c);
        *reinterpret_cast<uint4*>(Q_s + r * L::LD + c) = v;
    }
    for (int i = tid; i < PF_ROWS * L::LO; i += PF_WARPS * 32) O_s[i] = 0.f;
    __syncthreads();

    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa[D / 16];
#pragma unroll
    for (int k = 0; k < D / 16; ++k) wmma::load_matrix_sync(qa[k], Q_s + (warp * 16) * L::LD + k * 16, L::LD);

    // Softmax state of row (warp * 16 + lane / 2); the two lanes of a row hold the same values.
    const int row = warp * 16 + lane / 2, half = lane % 2;
    const int pos = pos0 + row;
    const int row_lo = window > 0 ? max(0, pos + 1 - window) : 0;
    float m = -INFINITY, l = 0.f;
    float* S_w = S_s + warp * 16 * L::LS;
    T* P_w = P_s + warp * 16 * L::LP;
    float* O_w = O_s + warp * 16 * L::LO;

    for (int k0 = lo; k0 <= hi; k0 += PF_KEYS) {
        for (int i = tid; i < PF_KEYS * (D / V16); i += PF_WARPS * 32) {
            const int r = i / (D / V16), c = (i % (D / V16)) * V16;
            const int j = k0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (j <= hi) {
                const size_t slot = (size_t)bt[j / block_size] * block_size + j % block_size;
                const size_t off = (slot * num_kv_heads + kvh) * D + c;
                kv = *reinterpret_cast<const uint4*>(kc + off);
                vv = *reinterpret_cast<const uint4*>(vc + off);
            }
            *reinterpret_cast<uint4*>(K_s + r * L::LD + c) = kv;
            *reinterpret_cast<uint4*>(V_s + r * L::LD + c) = vv;
        }
        __syncthreads();
        // S = Q K^T for this warp's 16 rows.
#pragma unroll
        for (int n = 0; n < PF_KEYS / 16; ++n) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int k = 0; k < D / 16; ++k) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kb;
                wmma::load_matrix_sync(kb, K_s + (n * 16) * L::LD + k * 16, L::LD);
                wmma::mma_sync(acc, qa[k], kb, acc);
            }
            wmma::store_matrix_sync(S_w + n * 16, acc, L::LS, wmma::mem_row_major);
        }
        __syncwarp();
        // Running softmax over this key tile: each lane takes half a row.
        float x[PF_KEYS / 2];
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < PF_KEYS / 2; ++c) {
            const int col = half * (PF_KEYS / 2) + c;
            const int j = k0 + col;
            float v = S_w[(lane / 2) * L::LS + col] * scale;
            if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
            const bool ok = row < n_rows && j <= pos && j >= row_lo;
            x[c] = ok ? v : -INFINITY;
            mx = fmaxf(mx, x[c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m, mx);
        const float base = m_new == -INFINITY ? 0.f : m_new;
        const float corr = expf(m - base);
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < PF_KEYS / 2; ++c) {
            const float p = expf(x[c] - base);
            sum += p;
            P_w[(lane / 2) * L::LP + half * (PF_KEYS / 2) + c] = from_f<T>(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * corr + sum;
        m = m_new;
        for (int c = half; c < D; c += 2) O_w[(lane / 2) * L::LO + c] *= corr;
        __syncwarp();
        // O += P V.
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
            wmma::load_matrix_sync(o, O_w + dt * 16, L::LO, wmma::mem_row_major);
#pragma unroll
            for (int k = 0; k < PF_KEYS / 16; ++k) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
                wmma::load_matrix_sync(pa, P_w + k * 16, L::LP);
                wmma::load_matrix_sync(vb, V_s + (k * 16) * L::LD + dt * 16, L::LD);
                wmma::mma_sync(o, pa, vb, o);
            }
            wmma::store_matrix_sync(O_w + dt * 16, o, L::LO, wmma::mem_row_major);
        }
        __syncthreads();
    }
    if (row < n_rows) {
        const float inv = 1.f / l;
        T* dst = out + ((size_t)(r0 + row) * num_heads + h) * D;
        for (int c = half; c < D; c += 2) dst[c] = from_f<T>(O_w[(lane / 2) * L::LO + c] * inv);
    }
}

#define PF(NAME, T, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(PF_WARPS * 32)                                                \
        NAME(T* out, const T* q, const T* kc, const T* vc, const uint32_t* tiles, const uint32_t* seq_info,    \
             const uint32_t* block_tables, int num_heads, int num_kv_heads, int block_size, float scale,        \
             int window, float softcap) {                                                                       \
        prefill_attention<T, D>(out, q, kc, vc, tiles, seq_info, block_tables, num_heads, num_kv_heads,         \
                                block_size, scale, window, softcap);                                           \
    }

#define PF_DIMS(N, T)                                                                                          \
    PF(prefill_attention_##N##_64, T, 64)                                                                      \
    PF(prefill_attention_##N##_80, T, 80)                                                                      \
    PF(prefill_attention_##N##_96, T, 96)                                                                      \
    PF(prefill_attention_##N##_128, T, 128)                                                                    \
    PF(prefill_attention_##N##_256, T, 256)

PF_DIMS(bf16, __nv_bfloat16)
PF_DIMS(f16, __half)
