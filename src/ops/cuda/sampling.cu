// Picking tokens on the device (see ops/argmax.rs, the reference).
#include "common.cuh"
#include <limits.h>

#define ARGMAX_THREADS 1024

// Is (v, i) a better pick than (bv, bi)? Larger value, then lower id; non-finite values never win.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return isfinite(v) && (v > bv || (v == bv && i < bi) || bi == INT_MAX);
}

// One block per row of [rows, vocab] f32 logits: the largest finite logit, lowest id on ties,
// 0 when none is finite.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_f32(const float* __restrict__ logits, uint32_t* __restrict__ out, int vocab) {
    const float* l = logits + (size_t)blockIdx.x * vocab;
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < vocab; i += ARGMAX_THREADS) {
        const float v = l[i];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (i != INT_MAX && better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = sv[lane];
        bi = si[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const int i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (i != INT_MAX && better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        if (lane == 0) out[blockIdx.x] = bi == INT_MAX ? 0u : (uint32_t)bi;
    }
}

// ---------------------------------------------------------------------------------------------
// Drawing a token with temperature, top-k, top-p and min-p (see ops/sample.rs, the reference,
// for the definitions). Every quantity that decides the token is computed with operations whose
// IEEE results are the same here and in Rust (explicit fmaf, __fmul_rn, no fast-math), and masses
// are summed as integers, so this kernel picks exactly the token the CPU reference picks.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Masses are w * 2^40 rounded to integers (w <= 1, so a 262k vocabulary sums below 2^58).
#define MASS_SCALE 1099511627776.0f

// Orders floats as unsigned integers: a > b  <=>  key(a) > key(b) for finite a, b.
__device__ __forceinline__ uint32_t order_key(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exp(x) for x <= 0 by range reduction and a degree-7 polynomial, written so Rust computes the
// same bits (ops/sample.rs: `exp_det`).
__device__ __forceinline__ float exp_det(float x) {
    if (!(x > -87.0f)) return 0.0f;
    const float n = rintf(__fmul_rn(x, 1.44269504f));
    float r = fmaf(-n, 0.693145752f, x);
    r = fmaf(-n, 1.42860677e-6f, r);
    float p = 1.98412698e-4f;
    p = fmaf(p, r, 1.38888889e-3f);
    p = fmaf(p, r, 8.33333333e-3f);
    p = fmaf(p, r, 4.16666667e-2f);
    p = fmaf(p, r, 1.66666667e-1f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const int e = (int)n;
    if (e < -126) return 0.0f;
    return __fmul_rn(p, __int_as_float((e + 127) << 23));
}

struct Row {
    const float* l;
    int vocab;
    float inv_t, m;
};

// w = exp(l / T - max / T) of a finite logit.
__device__ __forceinline__ float weight(const Row& r, float l) { return exp_det(__fsub_rn(__fmul_rn(l, r.inv_t), r.m)); }
__device__ __forceinline__ unsigned long long mass_of(float w) { return __float2ull_rn(__fmul_rn(w, MASS_SCALE)); }

// Is (key, id) at or before the cut-off (ck, ci) in the order "larger logit first, then lower id"?
__device__ __forceinline__ bool within(uint32_t key, uint32_t id, uint32_t ck, uint32_t ci) {
    return key > ck || (key == ck && id <= ci);
}

template <typename T> __device__ T block_sum(T v, T* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < SAMPLE_WARPS ? scratch[lane] : (T)0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    const T out = scratch[0];
    __syncthreads();
    return out;
}

// Exclusive prefix sum of one value per thread, in thread order; `total` gets the sum.
__device__ unsigned long long block_exclusive_scan(unsigned long long v, unsigned long long* scratch,
                                                   unsigned long long* total) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned long long inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        unsigned long long w = lane < SAMPLE_WARPS ? scratch[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        scratch[lane] = w;  // inclusive totals of warps 0..lane
    }
    __syncthreads();
    const unsigned long long before = (warp > 0 ? scratch[warp - 1] : 0ull) + inc - v;
    *total = scratch[SAMPLE_WARPS - 1];
    __syncthreads();
    return before;
}

// The id of the `r`-th (1-based) element, in id order, among ids whose logit has key `ck` and
// id <= ci. Each thread walks a contiguous segment so the order is the ids'.
__device__ uint32_t nth_tied(const Row& row, uint32_t ck, uint32_t ci, unsigned long long r,
                             unsigned long long* scan) {
    const int seg = (row.vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = threadIdx.x * seg, hi = min(row.vocab, lo + seg);
    unsigned long long c = 0;
    for (int i = lo; i < hi; ++i) {
        const float l = row.l[i];
        c += (isfinite(l) && order_key(l) == ck && (uint32_t)i <= ci);
    }
    unsigned long long total;
    const unsigned long long before = block_exclusive_scan(c, scan, &total);
    __shared__ uint32_t found;
    if (threadIdx.x == 0) found = ci;
    __syncthreads();
    if (before < r && r <= before + c) {
        unsigned long long k = before;
        for (int i = lo; i < hi; ++i) {
            const float l = row.l[i];
            if (isfinite(l) && order_key(l) == ck && (uint32_t)i <= ci && ++k == r) { found = (uint32_t)i; break; }
        }
    }
    __syncthreads();
    return found;
}

// One block per row of `[rows, vocab]` f32 logits. `params` is `[rows, 5]`: 1/temperature
// (0: greedy), top_k (0: off), top_p, min_p, u in [0, 1).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_f32(const float* __restrict__ logits, const float* __restrict__ params, uint32_t* __restrict__ out,
               int vocab) {
    __shared__ unsigned long long hist[256];
    __shared__ unsigned long long scan[SAMPLE_WARPS];
    __shared__ float fscratch[SAMPLE_WARPS];
    __shared__ unsigned int uscratch[SAMPLE_WARPS];
    const float* p = params + (size_t)blockIdx.x * 5;
    const float inv_t = p[0], top_p = p[2], min_p = p[3], u = p[4];
    const unsigned int top_k = (unsigned int)p[1];
    Row row{logits + (size_t)blockIdx.x * vocab, vocab, inv_t, 0.0f};

    // Largest finite logit (its key) and how many are finite.
    uint32_t kmax = 0;
    unsigned int n = 0;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float l = row.l[i];
        if (isfinite(l)) { kmax = max(kmax, order_key(l)); ++n; }
    }
    n = block_sum<unsigned int>(n, uscratch);
    {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
        if (threadIdx.x % 32 == 0) uscratch[threadIdx.x / 32] = kmax;
        __syncthreads();
        if (threadIdx.x < 32) {
            uint32_t v = uscratch[threadIdx.x];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
            if (threadIdx.x == 0) uscratch[0] = v;
        }
        __syncthreads();
        kmax = uscratch[0];
        __syncthreads();
    }
    if (n == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0u;
        return;
    }
    if (inv_t == 0.0f) {  // greedy: the largest logit, lowest id on ties
        const uint32_t id = nth_tied(row, kmax, 0xffffffffu, 1, scan);
        if (threadIdx.x == 0) out[blockIdx.x] = id;
        return;
    }
    const uint32_t umax = (kmax & 0x80000000u) ? (kmax & 0x7fffffffu) : ~kmax;
    row.m = __fmul_rn(__uint_as_float(umax), inv_t);

    // The cut-off (ck, ci): an element is kept while at or before it in the order.
    uint32_t ck = 0, ci = 0xffffffffu;
    if (top_k > 0 && top_k < n) {
        // Radix select of the top_k-th largest key, 8 bits at a time.
        uint32_t prefix = 0, mask = 0;
        unsigned long long need = top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int d = threadIdx.x; d < 256; d += SAMPLE_THREADS) hist[d] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
                const float l = row.l[i];
                if (!isfinite(l)) continue;
                const uint32_t key = order_key(l);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1ull);
            }
            __syncthreads();
            __shared__ uint32_t digit;
            __shared__ unsigned long long above;
            if (threadIdx.x == 0) {
                unsigned long long acc = 0;
                int d = 255;
                for (; d > 0 && acc + hist[d] < need; --d) acc += hist[d];
                digit = (uint32_t)d;
                above = acc;
            }
            __syncthreads();
            prefix |= digit << shift;
            mask |= 255u << shift;
            need -= above;
            __syncthreads();
        }
        ck = prefix;
        ci = nth_tied(row, ck, 0xffffffffu, need, scan);
    }
    if (top_p < 1.0f) {
        unsigned long long mk = 0;
        for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            const float l = row.l[i];
            if (isfinite(l) && within(order_key(l), (uint32_t)i, ck, ci)) mk += mass_of(weight(row, l));
        }
        mk = block_sum<unsigned long long>(mk, scan);
        const unsigned long long target = (unsigned long long)ceil((double)top_p * (double)mk);
        // Radix select on mass: the first element (in order) where the running mass reaches target.
        uint32_t prefix = 0, mask = 0;
        unsigned long long before = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int d = threadIdx.x; d < 256; d += SAMPLE_THREADS) hist[d] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
                const float l = row.l[i];
                if (!isfinite(l)) continue;
                const uint32_t key = order_key(l);
                if ((key & mask) == prefix && within(key, (uint32_t)i, ck, ci))
                    atomicAdd(&hist[(key >> shift) & 255u], mass_of(weight(row, l)));
            }
            __syncthreads();
            __shared__ uint32_t digit;
            __shared__ unsigned long long acc_s;
            if (threadIdx.x == 0) {
                unsigned long long acc = before;
                int d = 255;
                for (; d > 0 && acc + hist[d] < target; --d) acc += hist[d];
                digit = (uint32_t)d;
                acc_s = acc;
            }
            __syncthreads();
            prefix |= digit << shift;
            mask |= 255u << shift;
            before = acc_s;
            __syncthreads();
        }
        // Ties at the cut-off key all weigh the same: take as many (in id order) as reach target.
        const uint32_t uk = (prefix & 0x80000000u) ? (prefix & 0x7fffffffu) : ~prefix;
        const unsigned long long q = mass_of(weight(row, __uint_as_float(uk)));
        const unsigned long long r = q == 0 ? 1ull : (target - before + q - 1) / q;
        const uint32_t cut_id = nth_tied(row, prefix, prefix == ck ? ci : 0xffffffffu, r, scan);
        ck = prefix;
        ci = cut_id;
    }

    // The draw: x = floor(u * M) over the kept masses, the first id whose running mass passes x.
    // M > 0: the largest logit weighs 1 and survives every filter (min_p <= 1).
    if (threadIdx.x == 0) out[blockIdx.x] = 0u;
    const int seg = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = threadIdx.x * seg, hi = min(vocab, lo + seg);
    unsigned long long c = 0;
    for (int i = lo; i < hi; ++i) {
        const float l = row.l[i];
        if (!isfinite(l) || !within(order_key(l), (uint32_t)i, ck, ci)) continue;
        const float w = weight(row, l);
        if (w >= min_p) c += mass_of(w);
    }
    unsigned long long total;
    const unsigned long long before = block_exclusive_scan(c, scan, &total);
    unsigned long long x = (unsigned long long)floor((double)u * (double)total);
    if (x >= total) x = total - 1;
    if (before <= x && x < before + c) {
        unsigned long long acc = before;
        for (int i = lo; i < hi; ++i) {
            const float l = row.l[i];
            if (!isfinite(l) || !within(order_key(l), (uint32_t)i, ck, ci)) continue;
            const float w = weight(row, l);
            if (w < min_p) continue;
            acc += mass_of(w);
            if (x < acc) { out[blockIdx.x] = (uint32_t)i; break; }
        }
    }
}
