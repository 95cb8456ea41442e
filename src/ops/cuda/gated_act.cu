// act(gate) * up over a fused [rows, 2 * inter] gate/up projection, the gate half then the up
// half, or (interleaved) pairs (gate i, up i) (see ops/gated_act.rs, the reference), 16 bytes of
// output per thread. act(gate) is rounded to T before the product, as the separate ops round it.
#include "common.cuh"

// inter is a whole number of 16-byte vectors; y's row stride too.
template <typename T>
__device__ void gated_act(T* __restrict__ out, const T* __restrict__ y, int y_stride, int inter, int rows, int gelu,
                          int interleaved) {
    pdl_launch_dependents();  // the down projection may start streaming its weights
    pdl_wait();               // launched as a dependent (ops/gated_act.rs): y comes after this
    constexpr int V = Vec16<T>::N;
    const int per_row = inter / V;
    const size_t n = (size_t)rows * per_row;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / per_row;
        const int c = (int)(i % per_row) * V;
        const T* row = y + r * y_stride;
        float g[V], u[V];
        if (interleaved) {
            float a[V], b[V];
            load16(row + 2 * c, a);
            load16(row + 2 * c + V, b);
#pragma unroll
            for (int e = 0; e < V / 2; ++e) {
                g[e] = a[2 * e]; u[e] = a[2 * e + 1];
                g[V / 2 + e] = b[2 * e]; u[V / 2 + e] = b[2 * e + 1];
            }
        } else {
            load16(row + c, g);
            load16(row + inter + c, u);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) g[e] = to_f(from_f<T>(mlp_act(g[e], gelu))) * u[e];
        store16(out + r * inter + c, g);
    }
}

#define GA(NAME, T)                                                                                            \
    extern "C" __global__ void NAME(T* out, const T* y, int y_stride, int inter, int rows, int gelu,           \
                                    int interleaved) {                                                         \
        gated_act<T>(out, y, y_stride, inter, rows, gelu, interleaved);                                        \
    }
GA(gated_act_f32, float)
GA(gated_act_bf16, __nv_bfloat16)
GA(gated_act_f16, __half)
