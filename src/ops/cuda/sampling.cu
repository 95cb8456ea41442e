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
//
// One block per row. Warp w owns the ids [w C, (w + 1) C) and reads them 32 at a time
// (coalesced); passes that need id order scan inside a warp with shuffles and across warps once.
// Histograms (radix select) add one value per distinct bin per warp, not per element: logits
// share their top bits, so per-element atomics would all hit the same few bins.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define FULL 0xffffffffu
// Masses are w * 2^40 rounded to integers (w <= 1, so a 262k vocabulary sums below 2^58).
#define MASS_SCALE 1099511627776.0f

typedef unsigned long long u64;

struct Row {
    const float* l;
    int vocab, chunk;  // chunk: ids per warp, a multiple of 32
    float inv_t, m;
    // The cut-off (ck, ci): an element is kept while at or before it in the order "larger
    // logit first, then lower id". (0, ~0) keeps every finite logit.
    uint32_t ck, ci;
    float min_p;  // also required of the draw's elements (0 in the passes before it)
    uint32_t exclude;  // an id the draw leaves out (a rejected draft), ~0 for none
};

// w = exp(l / T - max / T) of a finite logit.
__device__ __forceinline__ float weight(const Row& r, float l) { return exp_det(__fsub_rn(__fmul_rn(l, r.inv_t), r.m)); }
__device__ __forceinline__ u64 mass_of(float w) { return __float2ull_rn(__fmul_rn(w, MASS_SCALE)); }
__device__ __forceinline__ bool within(uint32_t key, uint32_t id, uint32_t ck, uint32_t ci) {
    return key > ck || (key == ck && id <= ci);
}
// Is id i (a finite logit l with key `key`) kept by the row's cut-off and min-p?
__device__ __forceinline__ bool kept(const Row& r, uint32_t key, int i, float l) {
    return within(key, (uint32_t)i, r.ck, r.ci) && (r.min_p == 0.0f || weight(r, l) >= r.min_p);
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

template <typename T> __device__ T block_sum(T v, T* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = scratch[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    const T out = scratch[0];
    __syncthreads();
    return out;
}

// Calls f(i, l) for the ids of this warp's range in groups of 32 (lane i), eight groups loaded
// before any is processed so that eight loads per lane are in flight (a pass is bound by load
// latency otherwise). l is NaN past the range. f returns true to stop early; the groups' order
// is the ids' order, and every lane of the warp takes part in every call.
template <typename F> __device__ __forceinline__ void for_each_group(const Row& r, F f) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int lo = warp * r.chunk, hi = min(r.vocab, lo + r.chunk);
    for (int base = lo; base < hi; base += 256) {
        float lv[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = base + 32 * j + lane;
            lv[j] = i < hi ? r.l[i] : __int_as_float(0x7fc00000);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (base + 32 * j >= hi) return;
            if (f(base + 32 * j + lane, lv[j])) return;
        }
    }
}

// What a pass in id order adds up per element.
enum Count { TIED, MASS };

__device__ __forceinline__ u64 value_of(const Row& r, Count what, uint32_t tk, uint32_t tci, int i, float l) {
    if (!isfinite(l)) return 0;
    const uint32_t key = order_key(l);
    if (what == TIED) return key == tk && (uint32_t)i <= tci;
    if ((uint32_t)i == r.exclude || !kept(r, key, i, l)) return 0;
    return mass_of(weight(r, l));
}

// The id, in id order, at which the running sum of `what` first exceeds x (x < the total):
// TIED counts ids whose logit has key tk and id <= tci; MASS adds the kept elements' masses.
// `total` (if not null) gets the sum over the row. Warp sums, one scan across warps, then the
// warp that holds the crossing walks its ids again.
__device__ uint32_t find_in_id_order(const Row& r, Count what, uint32_t tk, uint32_t tci, u64 x, bool x_is_fraction,
                                     float u, u64* total, u64* wsum) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u64 acc = 0;
    for_each_group(r, [&](int i, float l) {
        acc += value_of(r, what, tk, tci, i, l);
        return false;
    });
    acc = warp_sum_u64(acc);
    __syncthreads();
    if (lane == 0) wsum[warp] = acc;
    __syncthreads();
    __shared__ u64 target, before_s;
    __shared__ int owner;
    if (threadIdx.x == 0) {
        u64 t = 0;
        for (int w = 0; w < SAMPLE_WARPS; ++w) t += wsum[w];
        if (total) *total = t;
        u64 want = x;
        if (x_is_fraction) {
            want = t == 0 ? 0 : (u64)floor((double)u * (double)t);
            if (want >= t && t > 0) want = t - 1;
        }
        target = want;
        u64 b = 0;
        int w = 0;
        for (; w < SAMPLE_WARPS - 1 && b + wsum[w] <= want; ++w) b += wsum[w];
        owner = w;
        before_s = b;
    }
    __syncthreads();
    __shared__ uint32_t found;
    if (threadIdx.x == 0) found = 0xffffffffu;
    __syncthreads();
    if (warp == owner) {
        u64 b = before_s;
        const u64 want = target;
        for_each_group(r, [&](int i, float l) {
            const u64 v = value_of(r, what, tk, tci, i, l);
            u64 inc = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 n = __shfl_up_sync(FULL, inc, o);
                if (lane >= o) inc += n;
            }
            const bool hit = v > 0 && b + inc > want && b + inc - v <= want;
            const unsigned m = __ballot_sync(FULL, hit);
            if (m) {
                if (lane == __ffs(m) - 1) found = (uint32_t)i;
                return true;
            }
            b += __shfl_sync(FULL, inc, 31);
            return false;
        });
    }
    __syncthreads();
    const uint32_t out = found;
    __syncthreads();
    return out;
}

// Radix select, 8 bits at a time from the top, over the keys of kept elements with a key
// matching the prefix so far: the digit where the running count (MASS: mass) from the largest
// reaches `need`. Returns the full key; `*above` gets the count (mass) of keys above it.
__device__ uint32_t radix_select(const Row& r, Count what, u64 need, u64* above, u64* hist) {
    const int lane = threadIdx.x % 32;
    uint32_t prefix = 0, mask = 0;
    u64 before = 0;
    __shared__ uint32_t digit_s;
    __shared__ u64 acc_s;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += SAMPLE_THREADS) hist[d] = 0;
        __syncthreads();
        for_each_group(r, [&](int i, float l) {
            bool valid = false;
            uint32_t bin = 0;
            u64 v = 0;
            if (isfinite(l)) {
                const uint32_t key = order_key(l);
                if ((key & mask) == prefix && within(key, (uint32_t)i, r.ck, r.ci)) {
                    valid = true;
                    bin = (key >> shift) & 255u;
                    v = what == MASS ? mass_of(weight(r, l)) : 1;
                }
            }
            unsigned active = __ballot_sync(FULL, valid);
            while (active) {
                const int leader = __ffs(active) - 1;
                const uint32_t b = __shfl_sync(FULL, bin, leader);
                const bool mine = valid && bin == b;
                const u64 sum = warp_sum_u64(mine ? v : 0);
                if (lane == leader) atomicAdd(&hist[b], sum);
                active &= ~__ballot_sync(FULL, mine);
            }
            return false;
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 acc = before;
            int d = 255;
            for (; d > 0 && acc + hist[d] < need; --d) acc += hist[d];
            digit_s = (uint32_t)d;
            acc_s = acc;
        }
        __syncthreads();
        prefix |= digit_s << shift;
        mask |= 255u << shift;
        before = acc_s;
        __syncthreads();
    }
    *above = before;
    return prefix;
}

// One block per row of `[rows, vocab]` f32 logits. `params` is `[rows, 7]`: 1/temperature
// (0: greedy), top_k (0: off), top_p, min_p, u in [0, 1), a draft to judge (-1: none) and the
// uniform of its residual draw. A sampled row with a draft gives the draft when u falls in its
// mass, else draws with the second uniform from the kept tokens less the draft.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_f32(const float* __restrict__ logits, const float* __restrict__ params, uint32_t* __restrict__ out,
               int vocab) {
    __shared__ u64 hist[256];
    __shared__ u64 scratch[SAMPLE_WARPS];
    __shared__ unsigned int uscratch[SAMPLE_WARPS];
    const float* p = params + (size_t)blockIdx.x * 7;
    const float inv_t = p[0], top_p = p[2], min_p = p[3], u = p[4], u_residual = p[6];
    const unsigned int top_k = (unsigned int)p[1];
    const int draft = p[5] >= 0.0f ? (int)p[5] : -1;
    const int chunk = ((vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) / 32 * 32;
    Row row{logits + (size_t)blockIdx.x * vocab, vocab, chunk, inv_t, 0.0f, 0u, 0xffffffffu, 0.0f, 0xffffffffu};

    // Largest finite logit (its key) and how many are finite.
    uint32_t kmax = 0;
    unsigned int n = 0;
    for_each_group(row, [&](int, float l) {
        if (isfinite(l)) { kmax = max(kmax, order_key(l)); ++n; }
        return false;
    });
    n = block_sum<unsigned int>(n, uscratch);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) kmax = max(kmax, __shfl_xor_sync(FULL, kmax, o));
    if (threadIdx.x % 32 == 0) uscratch[threadIdx.x / 32] = kmax;
    __syncthreads();
    if (threadIdx.x < 32) {
        uint32_t v = uscratch[threadIdx.x];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL, v, o));
        if (threadIdx.x == 0) uscratch[0] = v;
    }
    __syncthreads();
    kmax = uscratch[0];
    __syncthreads();
    if (n == 0) {  // a draft row never gives its draft here (NO_TOKEN in ops/sample.rs)
        if (threadIdx.x == 0) out[blockIdx.x] = draft >= 0 ? 0xffffffffu : 0u;
        return;
    }
    if (inv_t == 0.0f) {  // greedy: the largest logit, lowest id on ties
        const uint32_t id = find_in_id_order(row, TIED, kmax, 0xffffffffu, 0, false, 0.f, nullptr, scratch);
        if (threadIdx.x == 0) out[blockIdx.x] = id;
        return;
    }
    row.m = __fmul_rn(from_key(kmax), inv_t);

    if (top_k > 0 && top_k < n) {
        u64 above;
        const uint32_t ck = radix_select(row, TIED, top_k, &above, hist);
        // The (top_k - above)-th of the ids tied at ck closes the kept set.
        row.ci = find_in_id_order(row, TIED, ck, 0xffffffffu, top_k - above - 1, false, 0.f, nullptr, scratch);
        row.ck = ck;
    }
    if (top_p < 1.0f) {
        u64 mk = 0;
        for_each_group(row, [&](int i, float l) {
            if (isfinite(l) && within(order_key(l), (uint32_t)i, row.ck, row.ci)) mk += mass_of(weight(row, l));
            return false;
        });
        mk = block_sum<u64>(mk, scratch);
        const u64 target = (u64)ceil((double)top_p * (double)mk);
        u64 before;
        const uint32_t ck = radix_select(row, MASS, target, &before, hist);
        // Ties at the cut-off key all weigh the same: take as many (in id order) as reach target.
        const u64 q = mass_of(weight(row, from_key(ck)));
        const u64 r = q == 0 ? 1ull : (target - before + q - 1) / q;
        row.ci = find_in_id_order(row, TIED, ck, ck == row.ck ? row.ci : 0xffffffffu, r - 1, false, 0.f, nullptr, scratch);
        row.ck = ck;
    }
    // The draw: x = floor(u * M) over the kept masses, the first id whose running mass passes x.
    // M > 0: the largest logit weighs 1 and survives every filter (min_p <= 1).
    row.min_p = min_p;
    float draw_u = u;
    if (draft >= 0) {
        // Accept the draft when floor(u * M) falls below its mass (the host's Kept::accepts);
        // a draft outside the vocabulary has none.
        u64 total = 0;
        for_each_group(row, [&](int i, float l) {
            total += value_of(row, MASS, 0, 0, i, l);
            return false;
        });
        total = block_sum<u64>(total, scratch);
        const u64 md = draft < vocab ? value_of(row, MASS, 0, 0, draft, row.l[draft]) : 0;
        u64 x = (u64)floor((double)u * (double)total);
        if (x >= total) x = total - 1;
        if (x < md) {
            if (threadIdx.x == 0) out[blockIdx.x] = (uint32_t)draft;
            return;
        }
        row.exclude = (uint32_t)draft;
        draw_u = u_residual;
    }
    const uint32_t id = find_in_id_order(row, MASS, 0, 0, 0, true, draw_u, nullptr, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = id == 0xffffffffu ? 0u : id;
}

// A grammar's masks over [rows, vocab] f32 logits (ops/token_mask.rs, the reference): table[r]
// is row r's mask index (0xffffffff: any token), the masks follow the `rows` indices, `words`
// u32s each, bit t % 32 of word t / 32 set when token t is allowed. Disallowed logits become
// -inf. Grid: (blocks over the vocabulary, rows).
extern "C" __global__ void mask_logits_f32(const float* __restrict__ x, const uint32_t* __restrict__ table,
                                           float* __restrict__ y, int rows, int vocab, int words) {
    const int r = blockIdx.y;
    const uint32_t m = table[r];
    const float* xr = x + (size_t)r * vocab;
    float* yr = y + (size_t)r * vocab;
    const uint32_t* bits = table + rows + (size_t)(m == 0xffffffffu ? 0 : m) * words;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < vocab; t += gridDim.x * blockDim.x) {
        const float l = xr[t];
        yr[t] = (m == 0xffffffffu || (bits[t >> 5] >> (t & 31)) & 1u) ? l : -INFINITY;
    }
}
