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
// a block of 4 warps, each with 8 columns of the state S [Dk, Dv] in registers (lane l holds
// rows l, l + 32, ...: M = ceil(Dk / 32) of them). Per row, in order:
//   q^, k^ = l2-normalised q (times Dk^-1/2) and k of the key head h / (Hv / Hk);
//   S = exp(g) S;  S += k^ (beta (v - S^T k^))^T;  o = S^T q^.
// y: the conv's output [rows, C] (q, k, v side by side); a, b: [rows, Hv]; o: [rows, Hv * Dv].
// grid: (Hv, seqs, ceil(Dv / 32)), block 128.
template <int M>
__device__ void gdn_recurrence(float* __restrict__ o, const float* __restrict__ y, const float* __restrict__ a,
                               const float* __restrict__ b, const float* __restrict__ neg_a,
                               const float* __restrict__ dt_bias, float* __restrict__ ssm,
                               const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ slots, int Hk,
                               int Hv, int Dk, int Dv) {
    constexpr int COLS = 8;
    const int h = blockIdx.x, s = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int col0 = blockIdx.z * 32 + warp * COLS;
    const uint32_t slot = slots[s];
    if (slot == NO_SLOT || col0 >= Dv) return;
    const int q_start = seq_info[4 * s], q_len = seq_info[4 * s + 1], ctx = seq_info[4 * s + 2];
    if (q_len == 0) return;
    const bool fresh = ctx == q_len;
    const int ncols = min(COLS, Dv - col0);
    const int C = 2 * Hk * Dk + Hv * Dv;
    const int kh = h / (Hv / Hk);
    float* st = ssm + ((size_t)slot * Hv + h) * Dk * Dv;
    float S[M][COLS];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int i = lane + 32 * m;
#pragma unroll
        for (int j = 0; j < COLS; ++j)
            S[m][j] = (!fresh && i < Dk && j < ncols) ? st[(size_t)i * Dv + col0 + j] : 0.f;
    }
    const float q_scale = rsqrtf((float)Dk);
    const float na = neg_a[h], dtb = dt_bias[h];
    for (int r = 0; r < q_len; ++r) {
        const size_t row = q_start + r;
        const float* yr = y + row * C;
        float q[M], k[M];
        float qq = 0.f, kk = 0.f;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const int i = lane + 32 * m;
            q[m] = i < Dk ? yr[kh * Dk + i] : 0.f;
            k[m] = i < Dk ? yr[Hk * Dk + kh * Dk + i] : 0.f;
            qq += q[m] * q[m];
            kk += k[m] * k[m];
        }
        const float qinv = q_scale / sqrtf(warp_sum(qq) + 1e-6f);
        const float kinv = 1.f / sqrtf(warp_sum(kk) + 1e-6f);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            q[m] *= qinv;
            k[m] *= kinv;
        }
        const float decay = expf(na * softplus(a[row * Hv + h] + dtb));
        const float beta = 1.f / (1.f + expf(-b[row * Hv + h]));
        const float* v = yr + 2 * Hk * Dk + h * Dv + col0;
        float out[COLS];
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            float kv = 0.f;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                S[m][j] *= decay;
                kv += S[m][j] * k[m];
            }
            kv = warp_sum(kv);
            const float delta = beta * ((j < ncols ? v[j] : 0.f) - kv);
            float acc = 0.f;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                S[m][j] += k[m] * delta;
                acc += S[m][j] * q[m];
            }
            out[j] = warp_sum(acc);
        }
        if (lane < ncols) {
            float val = out[0];
#pragma unroll
            for (int j = 1; j < COLS; ++j)
                if (lane == j) val = out[j];
            o[row * Hv * Dv + h * Dv + col0 + lane] = val;
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int i = lane + 32 * m;
        if (i < Dk) {
#pragma unroll
            for (int j = 0; j < COLS; ++j)
                if (j < ncols) st[(size_t)i * Dv + col0 + j] = S[m][j];
        }
    }
}

#define GDN(M)                                                                                                 \
    extern "C" __global__ void gdn_recurrence_##M(float* o, const float* y, const float* a, const float* b,     \
                                                  const float* neg_a, const float* dt_bias, float* ssm,         \
                                                  const uint32_t* seq_info, const uint32_t* slots, int Hk,      \
                                                  int Hv, int Dk, int Dv) {                                     \
        gdn_recurrence<M>(o, y, a, b, neg_a, dt_bias, ssm, seq_info, slots, Hk, Hv, Dk, Dv);                    \
    }
GDN(1)
GDN(2)
GDN(4)
GDN(8)
