// Gated DeltaNet (Qwen3.5's linear attention) on the device, for the rows of a step: the
// causal depthwise conv with its state, then the gated delta rule with its state (see
// ops/gated_delta.rs, the CPU reference, for the equations).
//
// Every kernel finds a row's sequence through the step's metadata (batch.rs, MetaLayout):
// row_seq [rows], seq_info [4 per sequence: q_start, q_len, context_len, table offset] and
// slots [per sequence: its state slot, NO_SLOT for a graph's padding sequences, which are
// skipped]. A sequence at its first position (context_len == q_len) starts from a zero state,
// whatever its slot holds, so slots need no clearing.
#include "common.cuh"

#define NO_SLOT 0xffffffffu

// y[t, c] = silu(sum_j w[c, j] * x_{t-K+1+j}[c]) for every row t, where the inputs before a
// sequence's first row come from its conv state ([K-1, C] per slot, oldest row first).
// Rows depend only on inputs, so every (row, channel) is a thread of its own.
// grid: (ceil(C / 128), rows), block 128.
extern "C" __global__ void gdn_conv(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w,
                                    const float* __restrict__ conv_state, const uint32_t* __restrict__ row_seq,
                                    const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ slots, int C,
                                    int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (c >= C) return;
    const uint32_t s = row_seq[t];
    const uint32_t slot = slots[s];
    if (slot == NO_SLOT) {
        y[(size_t)t * C + c] = 0.f;
        return;
    }
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    const bool fresh = ctx == q_len;
    const int i = t - q_start;  // the row's index in its sequence's rows
    const float* st = conv_state + (size_t)slot * (K - 1) * C;
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
        const int src = i - (K - 1) + j;  // < 0: from the state
        float v;
        if (src >= 0) v = x[(size_t)(q_start + src) * C + c];
        else v = fresh ? 0.f : st[(size_t)(K - 1 + src) * C + c];
        acc += w[c * K + j] * v;
    }
    y[(size_t)t * C + c] = acc / (1.f + expf(-acc));
}

// Each sequence's conv state becomes its last K-1 inputs (the old state shifted, then its new
// rows). After gdn_conv, which reads the old state. grid: (ceil(C / 128), seqs), block 128.
extern "C" __global__ void gdn_conv_state(float* __restrict__ conv_state, const float* __restrict__ x,
                                          const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ slots,
                                          int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    const uint32_t slot = slots[s];
    if (c >= C || slot == NO_SLOT) return;
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    if (q_len == 0) return;
    const bool fresh = ctx == q_len;
    float* st = conv_state + (size_t)slot * (K - 1) * C;
    float old[8];
    for (int j = 0; j < K - 1; ++j) old[j] = fresh ? 0.f : st[(size_t)j * C + c];
    for (int j = 0; j < K - 1; ++j) {
        const int from = q_len + j;  // in the window: K-1 old rows, then the q_len new ones
        st[(size_t)j * C + c] = from < K - 1 ? old[from] : x[(size_t)(q_start + from - (K - 1)) * C + c];
    }
}

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// The gated delta rule over a sequence's rows, for value head h and 32 of its value columns:
// lane j of every warp owns column j, warp w the key rows 32w .. 32w + 31 of the state S
// [Dk, Dv] (in registers: loads and stores of a row are 128 coalesced bytes), so a block has
// ceil(Dk / 32) warps and the sums over key rows meet in shared memory. Per row, in order:
//   q^, k^ = l2-normalised q (times Dk^-1/2) and k of the key head h / (Hv / Hk);
//   S = exp(g) S;  S += k^ (beta (v - S^T k^))^T;  o = S^T q^.
// y: the conv's output [rows, C] (q, k, v side by side); a, b: [rows, Hv]; o: [rows, Hv * Dv].
// grid: (Hv, seqs, ceil(Dv / 32)), block 32 * ceil(Dk / 32) (at most 8 warps: Dk <= 256).
extern "C" __global__ void gdn_recurrence(float* __restrict__ o, const float* __restrict__ y,
                                          const float* __restrict__ a, const float* __restrict__ b,
                                          const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                          float* __restrict__ ssm, const uint32_t* __restrict__ seq_info,
                                          const uint32_t* __restrict__ slots, int Hk, int Hv, int Dk, int Dv) {
    __shared__ float sq[256], sk[256];          // this row's q and k (raw)
    __shared__ float red[8][2];                 // per warp: sum q^2, sum k^2
    __shared__ float part[8][32];               // per warp and column: a partial sum over key rows
    const int h = blockIdx.x, s = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const int j = blockIdx.z * 32 + lane;       // this lane's value column
    const uint32_t slot = slots[s];
    if (slot == NO_SLOT) return;
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    if (q_len == 0) return;
    const bool fresh = ctx == q_len;
    const bool col = j < Dv;
    const int C = 2 * Hk * Dk + Hv * Dv;
    const int kh = h / (Hv / Hk);
    const int i0 = warp * 32;                   // this warp's first key row
    const int rows = max(0, min(32, Dk - i0));
    float* st = ssm + ((size_t)slot * Hv + h) * Dk * Dv;
    float S[32];
#pragma unroll
    for (int r = 0; r < 32; ++r) S[r] = (!fresh && col && r < rows) ? st[(size_t)(i0 + r) * Dv + j] : 0.f;
    const float q_scale = rsqrtf((float)Dk);
    const float na = neg_a[h], dtb = dt_bias[h];
    for (int t = 0; t < q_len; ++t) {
        const size_t row = q_start + t;
        const float* yr = y + row * C;
        const int i = i0 + lane;
        const float qi = i < Dk ? yr[kh * Dk + i] : 0.f;
        const float ki = i < Dk ? yr[Hk * Dk + kh * Dk + i] : 0.f;
        if (i < Dk) {
            sq[i] = qi;
            sk[i] = ki;
        }
        const float qq = warp_sum(qi * qi), kk = warp_sum(ki * ki);
        if (lane == 0) {
            red[warp][0] = qq;
            red[warp][1] = kk;
        }
        const float decay = expf(na * softplus(a[row * Hv + h] + dtb));
        const float beta = 1.f / (1.f + expf(-b[row * Hv + h]));
        const float v = col ? yr[2 * Hk * Dk + h * Dv + j] : 0.f;
        __syncthreads();
        float qs = 0.f, ks = 0.f;
        for (int w = 0; w < nw; ++w) {
            qs += red[w][0];
            ks += red[w][1];
        }
        const float qinv = q_scale / sqrtf(qs + 1e-6f), kinv = 1.f / sqrtf(ks + 1e-6f);
        float kv = 0.f;
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            S[r] *= decay;
            kv += S[r] * (r < rows ? sk[i0 + r] : 0.f);
        }
        part[warp][lane] = kv * kinv;
        __syncthreads();
        kv = 0.f;
        for (int w = 0; w < nw; ++w) kv += part[w][lane];
        const float delta = beta * (v - kv);
        float acc = 0.f;
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            const float kr = r < rows ? sk[i0 + r] * kinv : 0.f;
            S[r] += kr * delta;
            acc += S[r] * (r < rows ? sq[i0 + r] : 0.f);
        }
        __syncthreads();  // every warp has read part[] for kv
        part[warp][lane] = acc * qinv;
        __syncthreads();
        if (warp == 0 && col) {
            float out = 0.f;
            for (int w = 0; w < nw; ++w) out += part[w][lane];
            o[row * Hv * Dv + h * Dv + j] = out;
        }
        __syncthreads();  // part[], sq, sk and red are rewritten by the next row
    }
    if (col) {
#pragma unroll
        for (int r = 0; r < 32; ++r)
            if (r < rows) st[(size_t)(i0 + r) * Dv + j] = S[r];
    }
}
