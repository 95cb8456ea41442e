// Mixture-of-experts routing on the device: one warp per token, the same choice and weights
// as the host reference (ops/moe_route.rs), bit for bit: the same deterministic sigmoid, the
// same order ("larger value first, then lower id", values compared as f32::total_cmp does),
// and the same sums in the same order.
#include "common.cuh"

#define ROUTE_WARPS 4
// Most experts per token and most expert groups (the host checks both).
#define ROUTE_MAX_K 32

typedef unsigned long long u64;

// A candidate (value key, id) as one integer: the larger, the earlier in the order. 0 is "no
// candidate" (a real one has ~id > 0).
__device__ __forceinline__ u64 candidate(uint32_t key, uint32_t id) { return ((u64)key << 32) | (u64)(~id); }
__device__ __forceinline__ uint32_t candidate_id(u64 c) { return ~(uint32_t)c; }
__device__ __forceinline__ float candidate_value(u64 c) { return from_key((uint32_t)(c >> 32)); }

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

// 1 / (1 + exp(-l)) with the deterministic exp.
__device__ __forceinline__ float sigmoid_det(float l) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_det(-l))); }

// logits [rows, n_experts] f32, bias [n_experts] f32 -> experts [rows, top_k] u32 (ascending)
// and weights [rows, top_k] f32. Dynamic shared memory: ROUTE_WARPS * 2 * n_experts words.
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                     uint32_t* __restrict__ experts, float* __restrict__ weights, int rows,
                                     int n_experts, int n_group, int topk_group, int top_k, int norm, float scale) {
    extern __shared__ uint32_t route_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * ROUTE_WARPS + warp;
    if (t >= rows) return;  // the whole warp leaves together
    uint32_t* key = route_smem + (size_t)warp * 2 * n_experts;  // of the biased score
    float* score = reinterpret_cast<float*>(key + n_experts);
    const float* l = logits + (size_t)t * n_experts;
    for (int e = lane; e < n_experts; e += 32) {
        const float s = sigmoid_det(l[e]);
        score[e] = s;
        key[e] = order_key(__fadd_rn(s, bias[e]));
    }
    __syncwarp();

    if (n_group > topk_group) {
        // A group scores the sum of its two best biased scores (the best first); lane g holds
        // group g's candidate.
        const int per_group = n_experts / n_group;
        u64 group = 0;
        if (lane < n_group) {
            u64 b0 = 0, b1 = 0;
            for (int i = 0; i < per_group; ++i) {
                const int e = lane * per_group + i;
                const u64 c = candidate(key[e], (uint32_t)e);
                if (c > b0) {
                    b1 = b0;
                    b0 = c;
                } else if (c > b1) {
                    b1 = c;
                }
            }
            group = candidate(order_key(__fadd_rn(candidate_value(b0), candidate_value(b1))), (uint32_t)lane);
        }
        uint32_t allowed = 0;
        for (int r = 0; r < topk_group; ++r) {
            const u64 best = warp_max_u64(((allowed >> lane) & 1u) ? 0ull : group);
            allowed |= 1u << candidate_id(best);
        }
        const uint32_t masked = order_key(__int_as_float(0xff800000));  // -inf
        for (int e = lane; e < n_experts; e += 32)
            if (!((allowed >> (e / per_group)) & 1u)) key[e] = masked;
        __syncwarp();
    }

    // The top_k best, one at a time (every lane ends with the same list).
    uint32_t chosen[ROUTE_MAX_K];
    for (int j = 0; j < top_k; ++j) {
        u64 best = 0;
        for (int e = lane; e < n_experts; e += 32) {
            bool taken = false;
            for (int i = 0; i < j; ++i) taken |= chosen[i] == (uint32_t)e;
            const u64 c = taken ? 0ull : candidate(key[e], (uint32_t)e);
            best = c > best ? c : best;
        }
        chosen[j] = candidate_id(warp_max_u64(best));
    }
    if (lane != 0) return;
    for (int j = 1; j < top_k; ++j) {  // ascending ids
        const uint32_t v = chosen[j];
        int i = j - 1;
        for (; i >= 0 && chosen[i] > v; --i) chosen[i + 1] = chosen[i];
        chosen[i + 1] = v;
    }
    float sum = 1.0f;
    if (norm) {
        sum = score[chosen[0]];
        for (int j = 1; j < top_k; ++j) sum = __fadd_rn(sum, score[chosen[j]]);
        sum = __fadd_rn(sum, 1e-20f);
    }
    for (int j = 0; j < top_k; ++j) {
        float w = score[chosen[j]];
        if (norm) w = __fdiv_rn(w, sum);
        experts[(size_t)t * top_k + j] = chosen[j];
        weights[(size_t)t * top_k + j] = __fmul_rn(w, scale);
    }
}
