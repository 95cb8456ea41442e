// Paged attention over TurboQuant codes for any mix of prefill chunks and decodes (see
// ops/tq_attention/, the reference). Row t of sequence s sits at position p and reads
// positions [lo, split) as codes and [split, p] from floats (the float window), where
// lo = p + 1 - window for sliding layers (else 0) and split = max(p + 1 - float_window, lo).
//
// Two kernels:
// - tq_attn_partial: one block per (row, group of query heads sharing a kv head, split), a
//   warp or more per query head. The first `nsplit` splits cover the row's coded positions:
//   the block rotates each query (divided by the key scales) once, scores each key as
//   norm * <R q, c[idx]> by codebook lookups, keeps a running softmax, and sums
//   p * norm * c[idx] of the values in the rotated space. The others cover its float window
//   (this step's rows or the sequence's ring), `wchunk` positions each, in the model's space.
//   Each writes (max, sum, values) per head and split.
// - tq_attn_combine: one block per (row, query head). It merges the splits, rotates the coded
//   splits' sum back once, adds the window splits' sum, and writes the output.
// Rows of prompt chunks (sequences computing `skip` rows or more) are left to
// tq_prefill_attention (prefill_attention.cu), which uses tensor cores; both kernels run over
// rows [row0, row0 + gridDim.x) only, the span of the others (the partial states are indexed
// from row0).
//
// Splits let a single long decode use the whole GPU; the number of splits is fixed by the
// launch (rows and heads only, so a CUDA graph replays it at any context length) and a split
// covers at least `min_chunk` positions, so short contexts leave the extra blocks idle.
//
// A decode step's attention is a chain of dependent memory round trips more than arithmetic
// (measured on an H200: ~0.5-1.5 us each), so both kernels read the tables that never change
// (codebooks, rotation signs, key scales) before waiting on the kernel before them, and issue
// their other loads in as few rounds as they can.
#include "tq_common.cuh"

// Splits per (row, head): up to 64 over the coded positions, up to 32 over the float window.
#define TA_MAXSPLIT 96
#define TC_THREADS 512

// Position bounds of row t: (first position of its sequence's chunk, end = p + 1, lo, split).
struct TqRow {
    int s, q_start, first, end, lo, split;
};

__device__ __forceinline__ TqRow tq_row(int t, const uint32_t* row_seq, const uint32_t* seq_info, int window,
                                        int float_window) {
    TqRow r;
    r.s = row_seq[t];
    r.q_start = seq_info[4 * r.s];
    const int q_len = seq_info[4 * r.s + 1], ctx = seq_info[4 * r.s + 2];
    r.first = ctx - q_len;
    r.end = r.first + (t - r.q_start) + 1;
    r.lo = window > 0 ? max(0, r.end - window) : 0;
    r.split = max(r.end - float_window, r.lo);
    return r;
}

__device__ __forceinline__ float tq_logit(float dot, float scale, float softcap) {
    float x = dot * scale;
    if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
    return x;
}

// tq_attn_partial's layout: ks_n = blockDim / (32 hb) warps per query head, each taking every
// ks_n-th pass over the split's keys (tq_pass). A coded split's codes come into shared memory
// a tile at a time (the next tile's copies in flight while this one is summed), so a tile costs
// one round trip to memory, not one per pass; a float-window split's keys are read from memory
// a pass at a time. Within a warp, LPK lanes share a key (two groups of 8 coordinates each) and
// KPW = 32 / LPK keys are scored at once; each lane keeps its share of the (rotated) query in
// registers, and each group of LPK lanes its own running softmax and
// value sums, merged at the end in a fixed order (the result does not depend on the threads'
// timing). A thread per key, decoding each key once for all the block's heads, was slower:
// ~35 us per layer for 64 keys of a 7B decode on an H200 (against ~11 us now), ~900 dependent
// shared-memory reads and FMAs per thread with one warp per scheduler to hide them.
#define TL_WARPS 8
#define TL_UNROLL 4
#define TL_TILE_BYTES 16384  // per buffer; two buffers

template <int D> struct TqLanes {
    static constexpr int G = D / 8;  // groups of 8 coordinates
    static constexpr int LPK = G <= 2 ? 1 : G <= 4 ? 2 : G <= 8 ? 4 : G <= 16 ? 8 : G <= 32 ? 16 : 32;
    static constexpr int GPL = (G + LPK - 1) / LPK;  // groups per lane (2)
    static constexpr int KPW = 32 / LPK;             // keys a warp scores at once
};

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Eight coordinates [c, c + 8) of a float-window vector of kv head `kvh` at position j: this
// step's row (rounded to the ring's type, so it reads the same before and after it moves into
// the ring) or the ring's. The row's address is worked out once per eight coordinates: per
// coordinate, the index arithmetic cost more than the loads.
template <typename TQ, typename TR>
__device__ __forceinline__ void tq_float8(float (&x)[8], const TQ* fresh, const TR* ring, const TqRow& r, int j,
                                          int ring_idx, int float_window, int num_kv_heads, int kvh, int D, int c) {
    if (j < r.first) {
        const TR* src = ring + (((size_t)ring_idx * float_window + j % float_window) * num_kv_heads + kvh) * D + c;
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = to_f(src[e]);
    } else {
        const TQ* src = fresh + (((size_t)r.q_start + (j - r.first)) * num_kv_heads + kvh) * D + c;
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = to_f(from_f<TR>(to_f(src[e])));
    }
}

// A warp's passes over a split's nk keys, TL_UNROLL keys per group of lanes at a time (key
// first + u * step + the group's index): each key's score is knorm(k) * <q, key> with the
// key's 8-coordinate groups from key8(k, group, out), then the pass's keys join the running
// softmax (m, l) and the value sums acc, p * vnorm(k) times val8's groups. Codes and the float
// window differ only in these four.
template <int D, typename Key8, typename KNorm, typename Val8, typename VNorm>
__device__ __forceinline__ void tq_pass(int nk, int first, int step, const float (&qv)[TqLanes<D>::GPL][8],
                                        float scale, float softcap, Key8 key8, KNorm knorm, Val8 val8, VNorm vnorm,
                                        float& m, float& l, float (&acc)[TqLanes<D>::GPL][8]) {
    using L = TqLanes<D>;
    constexpr int G = L::G, LPK = L::LPK, GPL = L::GPL, U = TL_UNROLL;
    const int lane = threadIdx.x & 31, sub = lane / LPK, kl = lane % LPK;
    for (int k0 = first; k0 < nk; k0 += U * step) {
        float x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = k0 + u * step + sub;
            float sc = 0.f;
            if (k < nk) {
#pragma unroll
                for (int g = 0; g < GPL; ++g) {
                    const int gi = kl + LPK * g;
                    if (gi < G) {
                        float kv[8];
                        key8(k, gi, kv);
#pragma unroll
                        for (int e = 0; e < 8; ++e) sc = fmaf(qv[g][e], kv[e], sc);
                    }
                }
            }
#pragma unroll
            for (int o = LPK / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
            x[u] = k < nk ? tq_logit(knorm(k) * sc, scale, softcap) : -INFINITY;
        }
        // The sums rescaled once, when the max moves.
        float mx = m;
#pragma unroll
        for (int u = 0; u < U; ++u) mx = fmaxf(mx, x[u]);
        if (mx > m) {
            const float c = expf(m - mx);
            l *= c;
#pragma unroll
            for (int g = 0; g < GPL; ++g)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] *= c;
            m = mx;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = k0 + u * step + sub;
            if (k < nk) {
                const float p = expf(x[u] - m);
                l += p;
                const float pv = p * vnorm(k);
#pragma unroll
                for (int g = 0; g < GPL; ++g) {
                    const int gi = kl + LPK * g;
                    if (gi < G) {
                        float vv[8];
                        val8(k, gi, vv);
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pv, vv[e], acc[g][e]);
                    }
                }
            }
        }
    }
}

template <typename TQ, typename TR, int D>
__device__ void tq_attn_partial(float* __restrict__ part, const TQ* __restrict__ q, const uint8_t* __restrict__ kc,
                                const uint8_t* __restrict__ vc, const uint32_t* __restrict__ row_seq,
                                const uint32_t* __restrict__ seq_info, const uint32_t* __restrict__ block_tables,
                                const float* __restrict__ ktab, const float* __restrict__ vtab,
                                const float* __restrict__ kscale, const TQ* __restrict__ new_k,
                                const TQ* __restrict__ new_v, const TR* __restrict__ ring_k,
                                const TR* __restrict__ ring_v, const uint32_t* __restrict__ window_rings,
                                int num_heads, int num_kv_heads, int hb, int block_size, int kbits, int vbits,
                                int kdense, float scale, int window, float softcap, int float_window, int nsplit,
                                int min_chunk, int wchunk, int row0, int skip) {
    using L = TqLanes<D>;
    constexpr int LPK = L::LPK, GPL = L::GPL, KPW = L::KPW;
    constexpr int QPL = (D + 31) / 32;  // query coordinates a lane loads
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
    static_assert(2 * TL_WARPS * D * 4 <= TL_TILE_BYTES, "the rotation scratch lives in the second tile buffer");

    __shared__ __align__(16) uint8_t tile_s[2][TL_TILE_BYTES];
    __shared__ float st_m[TL_WARPS], st_l[TL_WARPS];
    __shared__ float ktab_s[16], vtab_s[16], sign_s[2 * D], kscale_s[D];
    // Before the first tile is summed: each warp's query and rotation scratch in buffer 1;
    // after the last: the warps' value sums in buffer 0.
    float(*q_s)[D] = reinterpret_cast<float(*)[D]>(&tile_s[1][0]);
    float(*tmp_s)[D] = reinterpret_cast<float(*)[D]>(&tile_s[1][TL_WARPS * D * 4]);
    float(*sum_s)[D] = reinterpret_cast<float(*)[D]>(&tile_s[0][0]);

    pdl_launch_dependents();
    const int t = row0 + blockIdx.x, z = blockIdx.z;
    const bool win = z >= nsplit;  // a split of the float window
    const int group = num_heads / num_kv_heads, per_kv = group / hb;
    const int kvh = blockIdx.y / per_kv;
    const int h0 = kvh * group + (blockIdx.y % per_kv) * hb;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
    const int ks_n = nthreads / 32 / hb;  // warps per head
    const int hh = warp / ks_n, ks = warp % ks_n;
    const int sub = lane / LPK, kl = lane % LPK;
    // Written once at start-up, not by the kernels before: read before the wait.
    if (!win) {
        if (tid < 16) { ktab_s[tid] = ktab[TQ_CENTROIDS + tid]; vtab_s[tid] = vtab[TQ_CENTROIDS + tid]; }
        if (!kdense)
            for (int i = tid; i < 2 * D; i += nthreads) sign_s[i] = ktab[TQ_ROTATION + i];
        for (int i = tid; i < D; i += nthreads) kscale_s[i] = kscale ? kscale[kvh * D + i] : 1.f;
    }
    pdl_wait();  // launched as a dependent (ops/tq_attention/cuda.rs): inputs after this

    const TqRow r = tq_row(t, row_seq, seq_info, window, float_window);
    if ((int)seq_info[4 * r.s + 1] >= skip) return;  // a prompt chunk's row: tq_prefill_attention's
    int a, b;
    if (win) {
        a = r.split + (z - nsplit) * wchunk;
        b = min(a + wchunk, r.end);
    } else {
        const int n = r.split - r.lo;
        const int chunk = max((n + nsplit - 1) / nsplit, min_chunk);
        a = r.lo + z * chunk;
        b = min(a + chunk, r.split);
    }
    float* out = part + (((size_t)blockIdx.x * num_heads + h0) * gridDim.z + z) * (D + 2);
    const size_t head_stride = (size_t)gridDim.z * (D + 2);
    if (a >= b) {  // the whole block: nothing in this split
        for (int i = tid; i < hb * (D + 2); i += nthreads) {
            const int h = i / (D + 2), c = i % (D + 2);
            out[h * head_stride + c] = c == 0 ? -INFINITY : 0.f;
        }
        return;
    }
    float m = -INFINITY, l = 0.f, acc[GPL][8];
    const int step = ks_n * KPW;  // keys per pass of a head's warps

    if (win) {
        // The window's positions in the model's space: the query as it is, each pass's keys
        // loaded into registers at once, then its values (holding both at once spilled
        // registers in the 16-bit kernels).
        const int ring_idx = window_rings[r.s];
        float qv[GPL][8];
#pragma unroll
        for (int g = 0; g < GPL; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int c = (kl + LPK * g) * 8 + e;
                qv[g][e] = c < D ? to_f(q[((size_t)t * num_heads + h0 + hh) * D + c]) : 0.f;
                acc[g][e] = 0.f;
            }
        // Keys and values as they are: no norms.
        auto key8 = [&](int k, int gi, float(&kv)[8]) {
            tq_float8(kv, new_k, ring_k, r, a + k, ring_idx, float_window, num_kv_heads, kvh, D, gi * 8);
        };
        auto val8 = [&](int k, int gi, float(&vv)[8]) {
            tq_float8(vv, new_v, ring_v, r, a + k, ring_idx, float_window, num_kv_heads, kvh, D, gi * 8);
        };
        auto one = [](int) { return 1.f; };
        tq_pass<D>(b - a, ks * KPW, step, qv, scale, softcap, key8, one, val8, one, m, l, acc);
    } else {
        // This warp's query head, on its way while the first tile is.
        float qv_in[QPL];
#pragma unroll
        for (int k = 0; k < QPL; ++k) {
            const int c = lane + 32 * k;
            qv_in[k] = c < D ? to_f(q[((size_t)t * num_heads + h0 + hh) * D + c]) : 0.f;
        }

        const uint32_t* bt = block_tables + seq_info[4 * r.s + 3];
        const int kcb = D * kbits / 8, vcb = D * vbits / 8;
        const int krow = kcb + 4, vrow = vcb + 4;
        const uint32_t kmask = (1u << kbits) - 1, vmask = (1u << vbits) - 1;
        // Keys per tile: their key rows, then (from a 16-aligned offset, so that each row keeps
        // its alignment in the cache) their value rows.
        const int tk = (TL_TILE_BYTES - 16) / (krow + vrow);
        const int voff = (tk * krow + 15) & ~15;
        const int ntiles = (b - a + tk - 1) / tk;
        // Tile i into buffer i % 2: by asynchronous copies of 4 bytes where every row is
        // 4-aligned, else (3-bit codes at d = 16 or 80) through registers.
        const bool async = krow % 4 == 0 && vrow % 4 == 0;
        auto issue = [&](int i) {
            uint8_t* dst = &tile_s[i & 1][0];
            const int ta = a + i * tk, nk = min(tk, b - ta);
            const int unit = async ? 4 : 2;
            const int kw = krow / unit, vw = vrow / unit, per = kw + vw;
            for (int x = tid; x < nk * per; x += nthreads) {
                const int k = x / per, w = x % per, j = ta + k;
                const size_t row = ((size_t)bt[j / block_size] * block_size + j % block_size) * num_kv_heads + kvh;
                const uint8_t* src = w < kw ? kc + row * krow + w * unit : vc + row * vrow + (w - kw) * unit;
                uint8_t* d = w < kw ? dst + k * krow + w * unit : dst + voff + k * vrow + (w - kw) * unit;
                if (async) cp_async4(d, src);
                else *reinterpret_cast<uint16_t*>(d) = *reinterpret_cast<const uint16_t*>(src);
            }
            cp_async_commit();
        };
        issue(0);

        // The query, divided by the key scales and rotated by its warp (buffer 1, free until the
        // second tile is issued); this lane's groups into registers.
        __syncthreads();  // the tables read before the wait, by other threads
#pragma unroll
        for (int k = 0; k < QPL; ++k) {
            const int c = lane + 32 * k;
            if (c < D) q_s[warp][c] = qv_in[k] / kscale_s[c];
        }
        tq_rotate<true, D>(&q_s[warp][0], &tmp_s[warp][0], 1, kdense ? ktab + TQ_ROTATION : sign_s, kdense != 0);
        float qv[GPL][8];
#pragma unroll
        for (int g = 0; g < GPL; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int c = (kl + LPK * g) * 8 + e;
                qv[g][e] = c < D ? q_s[warp][c] : 0.f;
                acc[g][e] = 0.f;
            }
        __syncthreads();  // every warp has its query: buffer 1 may take tile 1

        for (int i = 0; i < ntiles; ++i) {
            if (i + 1 < ntiles) issue(i + 1);
            else cp_async_commit();  // an empty group: "all but the newest" is then tile i
            cp_async_wait_prev();
            __syncthreads();  // tile i in shared memory for every thread
            const uint8_t* ks_base = &tile_s[i & 1][0];
            const int ta = a + i * tk, nk = min(tk, b - ta);
            const uint8_t* vs_base = ks_base + voff;
            // Codebook lookups, times each row's norm.
            auto key8 = [&](int k, int gi, float(&kv)[8]) {
                const uint32_t w = tq_codes8_aligned<D>(ks_base + k * krow, gi, kbits);
#pragma unroll
                for (int e = 0; e < 8; ++e) kv[e] = ktab_s[(w >> (e * kbits)) & kmask];
            };
            auto val8 = [&](int k, int gi, float(&vv)[8]) {
                const uint32_t w = tq_codes8_aligned<D>(vs_base + k * vrow, gi, vbits);
#pragma unroll
                for (int e = 0; e < 8; ++e) vv[e] = vtab_s[(w >> (e * vbits)) & vmask];
            };
            auto knorm = [&](int k) { return tq_norm_aligned(ks_base + k * krow, kcb); };
            auto vnorm = [&](int k) { return tq_norm_aligned(vs_base + k * vrow, vcb); };
            tq_pass<D>(nk, ks * KPW, step, qv, scale, softcap, key8, knorm, val8, vnorm, m, l, acc);
            __syncthreads();  // every warp is done with buffer i % 2 before tile i + 2 goes there
        }
    }

    // The lane groups' states merged within the warp (butterfly over the groups, the same
    // pattern every launch), then the head's warps' in warp order.
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        const float M = fmaxf(m, m2);
        const float w1 = m == -INFINITY ? 0.f : expf(m - M), w2 = m2 == -INFINITY ? 0.f : expf(m2 - M);
        l = l * w1 + l2 * w2;
#pragma unroll
        for (int g = 0; g < GPL; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] = acc[g][e] * w1 + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * w2;
        m = M;
    }
    // One warp per head: its state is the head's, straight to `out`; else to shared memory.
    if (sub == 0) {
        float* oh = out + hh * head_stride;
        const bool own = ks_n == 1;
        float* vals = own ? oh + 2 : &sum_s[warp][0];
#pragma unroll
        for (int g = 0; g < GPL; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int c = (kl + LPK * g) * 8 + e;
                if (c < D) vals[c] = acc[g][e];
            }
        if (kl == 0) {
            *(own ? oh : &st_m[warp]) = m;
            *(own ? oh + 1 : &st_l[warp]) = l;
        }
    }
    if (ks_n == 1) return;
    __syncthreads();
    for (int i = tid; i < hb * (D + 1); i += nthreads) {
        const int h = i / (D + 1), c = i % (D + 1);
        float M = -INFINITY;
        for (int k = 0; k < ks_n; ++k) M = fmaxf(M, st_m[h * ks_n + k]);
        float s = 0.f;
        for (int k = 0; k < ks_n; ++k) {
            const int w = h * ks_n + k;
            if (st_m[w] == -INFINITY) continue;
            s = fmaf(expf(st_m[w] - M), c < D ? sum_s[w][c] : st_l[w], s);
        }
        float* oh = out + h * head_stride;
        if (c < D) oh[2 + c] = s;
        else { oh[0] = M; oh[1] = s; }
    }
}

template <typename TQ, int D>
__device__ void tq_attn_combine(TQ* __restrict__ out, const float* __restrict__ part,
                                const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ seq_info,
                                const float* __restrict__ vtab, int num_heads, int nsplit, int ntot, int vdense,
                                int row0, int skip) {
    constexpr int ZQ = TC_THREADS / D;                          // threads per coordinate (split ranges)
    constexpr int ZPT = (TA_MAXSPLIT + ZQ - 1) / ZQ;            // splits per thread
    static_assert(D <= TC_THREADS, "a thread per coordinate at least");
    static_assert(TA_MAXSPLIT % 32 == 0 && TA_MAXSPLIT <= TC_THREADS, "a thread per split, whole warps");
    __shared__ float o_s[D], tmp_s[D], red_s[TA_MAXSPLIT / 32], sign_s[2 * D];
    __shared__ float m_s[TA_MAXSPLIT], w_s[TA_MAXSPLIT], sum_s[ZQ][D], sumw_s[ZQ][D], ml_s[2];
    pdl_launch_dependents();
    const int t = row0 + blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (!vdense)  // written once at start-up: read before the wait
        for (int i = tid; i < 2 * D; i += TC_THREADS) sign_s[i] = vtab[TQ_ROTATION + i];
    pdl_wait();  // launched as a dependent: the partial states after this
    // As in tq_attn_partial; a decode step (no skip) does not wait on these loads.
    if (skip != INT_MAX && (int)seq_info[4 * row_seq[t] + 1] >= skip) return;

    // Every split's max and sum and this thread's coordinate of its sums for its range of
    // splits, all loaded in one round (a split without positions holds -inf, 0 and zeros), then
    // merged in split order: the coded splits' sum rotated back once, the window's added.
    const float* pp = part + ((size_t)blockIdx.x * num_heads + h) * ntot * (D + 2);
    const int c = tid % D, zq = tid / D;  // threads past ZQ * D only help with the rest
    float v[ZPT];
#pragma unroll
    for (int k = 0; k < ZPT; ++k) {
        const int z = zq * ZPT + k;
        v[k] = zq < ZQ && z < ntot ? __ldcg(pp + (size_t)z * (D + 2) + 2 + c) : 0.f;
    }
    float lz = 0.f;
    if (tid < TA_MAXSPLIT) {
        m_s[tid] = tid < ntot ? __ldcg(pp + (size_t)tid * (D + 2)) : -INFINITY;
        lz = tid < ntot ? __ldcg(pp + (size_t)tid * (D + 2) + 1) : 0.f;
    }
    __syncthreads();
    if (tid < 32) {
        float M = -INFINITY;
        for (int z = tid; z < TA_MAXSPLIT; z += 32) M = fmaxf(M, m_s[z]);
        M = warp_max(M);
        if (tid == 0) ml_s[0] = M;
    }
    __syncthreads();
    const float M = ml_s[0];
    if (tid < TA_MAXSPLIT) {
        const float e = m_s[tid] == -INFINITY ? 0.f : expf(m_s[tid] - M);
        w_s[tid] = e;
        const float l = warp_sum(lz * e);
        if ((tid & 31) == 0) red_s[tid >> 5] = l;
    }
    __syncthreads();
    if (tid == 0) {
        float L = 0.f;
        for (int w = 0; w < TA_MAXSPLIT / 32; ++w) L += red_s[w];
        ml_s[1] = L;
    }
    if (zq < ZQ) {
        float s = 0.f, sw = 0.f;
#pragma unroll
        for (int k = 0; k < ZPT; ++k) {
            const int z = zq * ZPT + k;
            if (z < TA_MAXSPLIT) {
                if (z < nsplit) s = fmaf(v[k], w_s[z], s);
                else sw = fmaf(v[k], w_s[z], sw);
            }
        }
        sum_s[zq][c] = s;
        sumw_s[zq][c] = sw;
    }
    __syncthreads();
    const float L = ml_s[1];
    if (tid < D) {
        float o = 0.f;
        for (int g = 0; g < ZQ; ++g) o += sum_s[g][tid];
        o_s[tid] = o;
    }
    tq_rotate<false, D, true>(o_s, tmp_s, 1, vdense ? vtab + TQ_ROTATION : sign_s, vdense != 0);
    if (tid < D) {
        float o = o_s[tid];
        for (int g = 0; g < ZQ; ++g) o += sumw_s[g][tid];
        out[((size_t)t * num_heads + h) * D + tid] = from_f<TQ>(o / L);
    }
}

#define TQ_PARTIAL(NAME, TQ, TR, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(TL_WARPS * 32) NAME(                                         \
        float* part, const TQ* q, const uint8_t* kc, const uint8_t* vc, const uint32_t* row_seq,              \
        const uint32_t* seq_info, const uint32_t* block_tables, const float* ktab, const float* vtab,         \
        const float* kscale, const TQ* new_k, const TQ* new_v, const TR* ring_k, const TR* ring_v,            \
        const uint32_t* window_rings, int num_heads, int num_kv_heads, int hb, int block_size, int kbits,     \
        int vbits, int kdense, float scale, int window, float softcap, int float_window, int nsplit,          \
        int min_chunk, int wchunk, int row0, int skip) {                                                      \
        tq_attn_partial<TQ, TR, D>(part, q, kc, vc, row_seq, seq_info, block_tables, ktab, vtab, kscale, new_k, \
                                   new_v, ring_k, ring_v, window_rings, num_heads, num_kv_heads, hb,          \
                                   block_size, kbits, vbits, kdense, scale, window, softcap, float_window,    \
                                   nsplit, min_chunk, wchunk, row0, skip);                                    \
    }

#define TQ_COMBINE(NAME, TQ, D)                                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                                  \
        NAME(TQ* out, const float* part, const uint32_t* row_seq, const uint32_t* seq_info, const float* vtab, \
             int num_heads, int nsplit, int ntot, int vdense, int row0, int skip) {                           \
        tq_attn_combine<TQ, D>(out, part, row_seq, seq_info, vtab, num_heads, nsplit, ntot, vdense, row0, skip); \
    }

#define TQ_DIMS(M, ...)                                                                                        \
    M(16, __VA_ARGS__) M(32, __VA_ARGS__) M(64, __VA_ARGS__) M(80, __VA_ARGS__) M(96, __VA_ARGS__)            \
    M(128, __VA_ARGS__) M(256, __VA_ARGS__)

#define TQ_PARTIAL_D(D, N, R, TQ, TR) TQ_PARTIAL(tq_attn_partial_##N##_##R##_##D, TQ, TR, D)
#define TQ_COMBINE_D(D, N, TQ) TQ_COMBINE(tq_attn_combine_##N##_##D, TQ, D)

TQ_DIMS(TQ_PARTIAL_D, f32, f32, float, float)
TQ_DIMS(TQ_PARTIAL_D, f32, bf16, float, __nv_bfloat16)
TQ_DIMS(TQ_PARTIAL_D, f32, f16, float, __half)
TQ_DIMS(TQ_PARTIAL_D, bf16, bf16, __nv_bfloat16, __nv_bfloat16)
TQ_DIMS(TQ_PARTIAL_D, f16, f16, __half, __half)
TQ_DIMS(TQ_COMBINE_D, f32, float)
TQ_DIMS(TQ_COMBINE_D, bf16, __nv_bfloat16)
TQ_DIMS(TQ_COMBINE_D, f16, __half)
