// The routed experts of a mixture-of-experts layer over experts stacked per layer
// (gate_up [E, 2I, H], down [E, H, I]), with no host round trip (ops/moe_experts.rs):
//   moe_group:    the (token, slot) pairs of each expert: offsets [E + 1] and pair ids [P]
//   moe_gate_up:  h[p] = act(x[t] Wg_e^T) * (x[t] Wu_e^T)      per pair p = t * top_k + slot
//   moe_down:     o[p] = h[p] Wd_e^T
//   moe_combine:  y[t] = sum over slots, in slot order, of w[t, slot] o[t * top_k + slot]
// Blocks of the two projections belong to one expert and loop over its pairs, so an expert's
// rows are read from memory once per step whatever the number of its tokens. Every value is
// computed by one warp in a fixed order that does not depend on the other pairs (no float
// atomics): a token's output is the same in any batch. Products round to T where the layer's
// op-by-op path rounds (projection outputs, act(gate), act(gate) * up, the weighted outputs).
#include "common.cuh"

#define MOE_WARPS 8
// Pairs whose dot products share one pass over a weight row.
#define MOE_PAIRS 4

// experts [P] u32 -> offsets [E + 1], order [P] (pair ids grouped by expert; order within an
// expert is irrelevant, each pair's results land in its own row). One block; dynamic shared
// memory: n_experts words. Ids >= n_experts are left out (the host routes only valid ones).
extern "C" __global__ void moe_group(const uint32_t* __restrict__ experts, int pairs, int n_experts,
                                     uint32_t* __restrict__ offsets, uint32_t* __restrict__ order) {
    extern __shared__ uint32_t group_smem[];
    uint32_t* cursor = group_smem;
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) cursor[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const uint32_t e = experts[p];
        if (e < (uint32_t)n_experts) atomicAdd(&cursor[e], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t run = 0;
        for (int e = 0; e < n_experts; ++e) {
            const uint32_t c = cursor[e];
            offsets[e] = run;
            cursor[e] = run;
            run += c;
        }
        offsets[n_experts] = run;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const uint32_t e = experts[p];
        if (e < (uint32_t)n_experts) order[atomicAdd(&cursor[e], 1u)] = (uint32_t)p;
    }
}

// Each lane's share of dot(w, x_q) for up to MOE_PAIRS rows x_q (n_pairs of them), over n
// elements; `vec`: n and every row start are whole 16-byte vectors. Not reduced over the warp.
template <typename T>
__device__ __forceinline__ void lane_dots(const T* __restrict__ w, const T* const* x, int n_pairs, int n, int vec,
                                          int lane, float* acc) {
    if (vec) {
        constexpr int V = Vec16<T>::N;
        for (int v = lane; v < n / V; v += 32) {
            float wv[V];
            load16(w + (size_t)v * V, wv);
#pragma unroll
            for (int q = 0; q < MOE_PAIRS; ++q) {
                if (q < n_pairs) {
                    float xv[V];
                    load16(x[q] + (size_t)v * V, xv);
#pragma unroll
                    for (int i = 0; i < V; ++i) acc[q] = fmaf(wv[i], xv[i], acc[q]);
                }
            }
        }
    } else {
        for (int i = lane; i < n; i += 32) {
            const float wi = to_f(w[i]);
#pragma unroll
            for (int q = 0; q < MOE_PAIRS; ++q)
                if (q < n_pairs) acc[q] = fmaf(wi, to_f(x[q][i]), acc[q]);
        }
    }
}

// grid (ceil(inter / MOE_WARPS), E), MOE_WARPS warps: warp w of block (b, e) computes h[p][i],
// i = b * MOE_WARPS + w, for every pair p of expert e. x [T, hidden] (row stride x_stride),
// h [P, inter].
template <typename T>
__device__ void moe_gate_up(const T* __restrict__ x, int x_stride, const T* __restrict__ gate_up,
                            const uint32_t* __restrict__ offsets, const uint32_t* __restrict__ order, T* __restrict__ h,
                            int hidden, int inter, int top_k, int vec, int gelu) {
    const int e = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i = blockIdx.x * MOE_WARPS + warp;
    const uint32_t lo = offsets[e], hi = offsets[e + 1];
    if (lo >= hi || i >= inter) return;
    const T* wg = gate_up + ((size_t)e * 2 * inter + i) * hidden;
    const T* wu = wg + (size_t)inter * hidden;
    for (uint32_t b = lo; b < hi; b += MOE_PAIRS) {
        const int n_pairs = min((int)(hi - b), MOE_PAIRS);
        const T* xs[MOE_PAIRS];
        uint32_t ps[MOE_PAIRS];
#pragma unroll
        for (int q = 0; q < MOE_PAIRS; ++q) {
            ps[q] = order[b + min(q, n_pairs - 1)];
            xs[q] = x + (size_t)(ps[q] / top_k) * x_stride;
        }
        float g[MOE_PAIRS] = {}, u[MOE_PAIRS] = {};
        lane_dots(wg, xs, n_pairs, hidden, vec, lane, g);
        lane_dots(wu, xs, n_pairs, hidden, vec, lane, u);
#pragma unroll
        for (int q = 0; q < MOE_PAIRS; ++q) {
            const float gs = to_f(from_f<T>(warp_sum(g[q])));
            const float us = to_f(from_f<T>(warp_sum(u[q])));
            if (lane == 0 && q < n_pairs) h[(size_t)ps[q] * inter + i] = from_f<T>(to_f(from_f<T>(mlp_act(gs, gelu))) * us);
        }
    }
}

// grid (ceil(hidden / MOE_WARPS), E): warp w of block (b, e) computes o[p][c], c = b *
// MOE_WARPS + w, for every pair p of expert e. h [P, inter], o [P, hidden].
template <typename T>
__device__ void moe_down(const T* __restrict__ h, const T* __restrict__ down, const uint32_t* __restrict__ offsets,
                         const uint32_t* __restrict__ order, T* __restrict__ o, int hidden, int inter, int vec) {
    const int e = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = blockIdx.x * MOE_WARPS + warp;
    const uint32_t lo = offsets[e], hi = offsets[e + 1];
    if (lo >= hi || c >= hidden) return;
    const T* wd = down + ((size_t)e * hidden + c) * inter;
    for (uint32_t b = lo; b < hi; b += MOE_PAIRS) {
        const int n_pairs = min((int)(hi - b), MOE_PAIRS);
        const T* hs[MOE_PAIRS];
        uint32_t ps[MOE_PAIRS];
#pragma unroll
        for (int q = 0; q < MOE_PAIRS; ++q) {
            ps[q] = order[b + min(q, n_pairs - 1)];
            hs[q] = h + (size_t)ps[q] * inter;
        }
        float acc[MOE_PAIRS] = {};
        lane_dots(wd, hs, n_pairs, inter, vec, lane, acc);
#pragma unroll
        for (int q = 0; q < MOE_PAIRS; ++q) {
            const float s = warp_sum(acc[q]);
            if (lane == 0 && q < n_pairs) o[(size_t)ps[q] * hidden + c] = from_f<T>(s);
        }
    }
}

// y [T, hidden] = sum over slots j (in order) of round(o[t * top_k + j] * round(w[t, j])).
template <typename T>
__device__ void moe_combine(const T* __restrict__ o, const float* __restrict__ weights, T* __restrict__ y, int rows,
                            int hidden, int top_k) {
    const size_t n = (size_t)rows * hidden;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t t = idx / hidden, c = idx % hidden;
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            const float w = to_f(from_f<T>(weights[t * top_k + j]));
            acc = __fadd_rn(acc, to_f(from_f<T>(__fmul_rn(to_f(o[(t * top_k + j) * hidden + c]), w))));
        }
        y[idx] = from_f<T>(acc);
    }
}

#define MOE(SUFFIX, T)                                                                                          \
    extern "C" __global__ void moe_gate_up_##SUFFIX(const T* x, int x_stride, const T* gate_up,                 \
                                                    const uint32_t* offsets, const uint32_t* order, T* h,       \
                                                    int hidden, int inter, int top_k, int vec, int gelu) {      \
        moe_gate_up<T>(x, x_stride, gate_up, offsets, order, h, hidden, inter, top_k, vec, gelu);               \
    }                                                                                                           \
    extern "C" __global__ void moe_down_##SUFFIX(const T* h, const T* down, const uint32_t* offsets,             \
                                                 const uint32_t* order, T* o, int hidden, int inter, int vec) { \
        moe_down<T>(h, down, offsets, order, o, hidden, inter, vec);                                            \
    }                                                                                                           \
    extern "C" __global__ void moe_combine_##SUFFIX(const T* o, const float* weights, T* y, int rows,           \
                                                    int hidden, int top_k) {                                    \
        moe_combine<T>(o, weights, y, rows, hidden, top_k);                                                     \
    }
MOE(f32, float)
MOE(bf16, __nv_bfloat16)
MOE(f16, __half)
