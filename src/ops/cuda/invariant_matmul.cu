// y = x W^T for 16-bit x [M, K] and W [N, K] (row major) on tensor cores, f32 accumulation, with
// one summation order per output that depends on K alone (see ops/invariant_matmul.rs):
//   K is cut into S slots of K / S columns (S from K alone); slot s's sum P_s is the m16n8k16
//   products over its 16-wide steps in order, from zero; y = ((P_0 + P_1) + P_2) + ... .
// A tensor-core product computes each output from its own row of x, its row of W and its
// accumulator, so a row of y has the same bits whatever M is, whichever rows share the launch
// and whichever of the two kernels below runs. cuBLAS and the GEMV kernel promise neither.
//
// im_skinny (a decode or verify step, M <= 16 MT): the matrix streams once. A block of 8 warps
// takes 8 / S tiles of 16 rows of W, a warp one tile's slot: its W columns pass through a
// 4-stage cp.async ring of its own, x's fragments come straight from global memory (a few
// rows, cached), and the block adds the slots' sums in order through shared memory.
// im_large (prompt chunks): 128 x 128 tiles of y, 16 warps of 32 x 32, 4 cp.async stages of
// 32 columns, the running slot sum folded into the total at each slot's end.
// With act >= 0, W's rows are a gated MLP's (gate, up) pairs and y [M, N / 2] gets
// act(gate) * up, rounded as the plain product and gated_act.cu round.
#include "mma.cuh"

#define IM_WARPS 8
#define IM_STAGE_K 64
#define IM_STAGES 4
#define IM_LD (IM_STAGE_K + 8)  // rows 16 bytes apart mod 128: ldmatrix without bank conflicts

// act(gate) * up from the two f32 sums, each rounded where the separate ops round.
template <typename T> __device__ __forceinline__ T im_gated(float g, float u, int act) {
    const float gq = to_f(from_f<T>(g)), uq = to_f(from_f<T>(u));
    return from_f<T>(to_f(from_f<T>(mlp_act(gq, act))) * uq);
}

template <typename T> __device__ __forceinline__ uint32_t ld_pair(const T* p) {
    return __ldg(reinterpret_cast<const uint32_t*>(p));
}

template <typename T, int MT>
__device__ void im_skinny(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, int m, int n, int k,
                          int slots, int act) {
    extern __shared__ __align__(16) unsigned char im_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int slot = warp % slots, ft = warp / slots;
    const int block_n0 = blockIdx.x * (IM_WARPS / slots) * 16;
    const int n0 = block_n0 + ft * 16;
    const int len = k / slots;  // a multiple of 16
    const int k_lo = slot * len;
    const int steps = len / 16;
    const int stages = (steps + 3) / 4;
    T* ring = reinterpret_cast<T*>(im_smem) + warp * IM_STAGES * 16 * IM_LD;

    pdl_launch_dependents();
    // Stage s: W rows [n0, n0 + 16), columns [k_lo + 64 s, +64) of the slot; 4 vectors a lane.
    auto load = [&](int s) {
        T* dst = ring + (s % IM_STAGES) * 16 * IM_LD;
        const int kb = k_lo + s * IM_STAGE_K;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = lane + 32 * i, r = v >> 3, c = (v & 7) * 8;
            const bool ok = n0 + r < n && kb + c < k_lo + len;
            cp_async16(dst + r * IM_LD + c, w + (ok ? (size_t)(n0 + r) * k + kb + c : 0), ok);
        }
    };
#pragma unroll
    for (int s = 0; s < IM_STAGES - 1; ++s) {
        if (s < stages) load(s);
        cp_async_commit_group();
    }
    pdl_wait();  // x comes from the kernel before; y is written after

    float acc[MT][2][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    for (int s = 0; s < stages; ++s) {
        if (s + IM_STAGES - 1 < stages) load(s + IM_STAGES - 1);
        cp_async_commit_group();
        // x's fragments of the stage, loaded before waiting for W.
        const int nsteps = min(4, steps - 4 * s);
        uint32_t a[4][MT][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int kk = k_lo + s * IM_STAGE_K + j * 16 + 2 * t;
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r0 = i * 16 + g, r1 = r0 + 8;
                const bool ok = j < nsteps;
                a[j][i][0] = ok && r0 < m ? ld_pair(x + (size_t)r0 * k + kk) : 0u;
                a[j][i][1] = ok && r1 < m ? ld_pair(x + (size_t)r1 * k + kk) : 0u;
                a[j][i][2] = ok && r0 < m ? ld_pair(x + (size_t)r0 * k + kk + 8) : 0u;
                a[j][i][3] = ok && r1 < m ? ld_pair(x + (size_t)r1 * k + kk + 8) : 0u;
            }
        }
        cp_async_wait_group<IM_STAGES - 1>();
        __syncwarp();
        const T* st = ring + (s % IM_STAGES) * 16 * IM_LD;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j >= nsteps) break;
            uint32_t b[4];  // W rows [0, 8) then [8, 16), each columns [0, 8) and [8, 16) of step j
            ldsm_x4<false>(b, st + ((lane & 7) + ((lane >> 4) << 3)) * IM_LD + j * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                mma16816<T>(acc[i][0], a[j][i], b[0], b[1]);
                mma16816<T>(acc[i][1], a[j][i], b[2], b[3]);
            }
        }
        __syncwarp();  // the ring stage is overwritten by the next iteration's load
    }
    cp_async_wait_group<0>();
    __syncthreads();
    // Each warp's slot sums, [warp][row][16 columns], then the slots added in order.
    float* part = reinterpret_cast<float*>(im_smem);
    constexpr int ROWS = MT * 16;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                part[(warp * ROWS + i * 16 + g + 8 * (e >> 1)) * 16 + j * 8 + 2 * t + (e & 1)] = acc[i][j][e];
    __syncthreads();
    const int tiles = IM_WARPS / slots;
    auto total = [&](int f, int row, int col) {
        const float* p = part + ((f * slots) * ROWS + row) * 16 + col;
        float sum = p[0];
        for (int s = 1; s < slots; ++s) sum += p[s * ROWS * 16];
        return sum;
    };
    if (act < 0) {
        for (int idx = threadIdx.x; idx < tiles * m * 16; idx += blockDim.x) {
            const int f = idx / (m * 16), row = (idx / 16) % m, col = idx % 16;
            const int c = block_n0 + f * 16 + col;
            if (c < n) y[(size_t)row * n + c] = from_f<T>(total(f, row, col));
        }
    } else {
        for (int idx = threadIdx.x; idx < tiles * m * 8; idx += blockDim.x) {
            const int f = idx / (m * 8), row = (idx / 8) % m, col = 2 * (idx % 8);
            const int c = block_n0 + f * 16 + col;
            if (c < n) y[(size_t)row * (n / 2) + c / 2] = im_gated<T>(total(f, row, col), total(f, row, col + 1), act);
        }
    }
}

#define IL_BM 128
#define IL_BN 128
#define IL_BK 32
#define IL_LD (IL_BK + 8)
#define IL_STAGES 4
#define IL_THREADS 512  // 16 warps, 4 x 4, of 32 x 32 outputs each

template <typename T>
__device__ void im_large(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, int m, int n, int k,
                         int slots, int act) {
    extern __shared__ __align__(16) unsigned char im_smem[];
    T* xs = reinterpret_cast<T*>(im_smem);  // stages of [IL_BM][IL_LD]
    T* ws = xs + IL_STAGES * IL_BM * IL_LD;  // stages of [IL_BN][IL_LD]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * IL_BM, n0 = blockIdx.x * IL_BN;
    const int wm = (warp >> 2) * 32, wn = (warp & 3) * 32;
    const int steps = k / 16, slot_steps = steps / slots;
    const int stages = (k + IL_BK - 1) / IL_BK;

    pdl_launch_dependents();
    // Stage s: rows of x and W, columns [32 s, 32 s + 32): one vector of each a thread.
    const int lr = threadIdx.x >> 2, lc = (threadIdx.x & 3) * 8;
    auto load_w = [&](int s) {
        const int kc = s * IL_BK + lc;
        const bool ok = n0 + lr < n && kc < k;
        cp_async16(ws + (s % IL_STAGES) * IL_BN * IL_LD + lr * IL_LD + lc, w + (ok ? (size_t)(n0 + lr) * k + kc : 0),
                   ok);
    };
    auto load_x = [&](int s) {
        const int kc = s * IL_BK + lc;
        const bool ok = m0 + lr < m && kc < k;
        cp_async16(xs + (s % IL_STAGES) * IL_BM * IL_LD + lr * IL_LD + lc, x + (ok ? (size_t)(m0 + lr) * k + kc : 0),
                   ok);
    };
    // W does not come from the kernel before: its first stages load while that kernel ends.
    for (int s = 0; s < IL_STAGES - 1 && s < stages; ++s) load_w(s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < IL_STAGES - 1; ++s) {
        if (s < stages) load_x(s);
        cp_async_commit_group();
    }

    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.f;

    for (int s = 0; s < stages; ++s) {
        if (s + IL_STAGES - 1 < stages) {
            load_w(s + IL_STAGES - 1);
            load_x(s + IL_STAGES - 1);
        }
        cp_async_commit_group();
        cp_async_wait_group<IL_STAGES - 1>();
        __syncthreads();
        const T* xt = xs + (s % IL_STAGES) * IL_BM * IL_LD;
        const T* wt = ws + (s % IL_STAGES) * IL_BN * IL_LD;
#pragma unroll
        for (int j = 0; j < IL_BK / 16; ++j) {
            const int q = s * (IL_BK / 16) + j;  // the step's index in K
            if (q >= steps) break;
            uint32_t a[2][4], b[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                ldsm_x4<false>(a[i], xt + (wm + i * 16 + (lane & 15)) * IL_LD + j * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int p = 0; p < 2; ++p)
                ldsm_x4<false>(b[p], wt + (wn + p * 16 + (lane & 7) + ((lane >> 4) << 3)) * IL_LD + j * 16 +
                                         ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    mma16816<T>(acc[i][2 * p], a[i], b[p][0], b[p][1]);
                    mma16816<T>(acc[i][2 * p + 1], a[i], b[p][2], b[p][3]);
                }
            if ((q + 1) % slot_steps == 0) {  // a slot ends: its sum joins the total
                const bool first = q + 1 == slot_steps;
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            tot[i][jj][e] = first ? acc[i][jj][e] : tot[i][jj][e] + acc[i][jj][e];
                            acc[i][jj][e] = 0.f;
                        }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm + i * 16 + g + 8 * h;
            if (row >= m) continue;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int c = n0 + wn + jj * 8 + 2 * t;
                if (c >= n) continue;
                const float v0 = tot[i][jj][2 * h], v1 = tot[i][jj][2 * h + 1];
                if (act >= 0) {
                    y[(size_t)row * (n / 2) + c / 2] = im_gated<T>(v0, v1, act);
                } else {
                    y[(size_t)row * n + c] = from_f<T>(v0);
                    if (c + 1 < n) y[(size_t)row * n + c + 1] = from_f<T>(v1);
                }
            }
        }
}

#define IM_SKINNY(TN, T, MT)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) invariant_matmul_skinny_##TN##_##MT(                     \
        T* y, const T* x, const T* w, int m, int n, int k, int slots, int act) {                               \
        im_skinny<T, MT>(y, x, w, m, n, k, slots, act);                                                        \
    }
#define IM_LARGE(TN, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(IL_THREADS, 1) invariant_matmul_large_##TN(                          \
        T* y, const T* x, const T* w, int m, int n, int k, int slots, int act) {                               \
        im_large<T>(y, x, w, m, n, k, slots, act);                                                             \
    }
#define IM_ALL(TN, T) IM_SKINNY(TN, T, 1) IM_SKINNY(TN, T, 2) IM_SKINNY(TN, T, 4) IM_LARGE(TN, T)

IM_ALL(bf16, __nv_bfloat16)
IM_ALL(f16, __half)
