// act(gate) * up over a fused [rows, 2 * inter] gate/up projection (see ops/gated_act.rs, the
// reference). act(gate) is rounded to T before the product, as the separate ops round it.
#include "common.cuh"

__device__ __forceinline__ float act(float x, int gelu) {
    if (gelu) return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return x / (1.f + expf(-x));
}

template <typename T>
__device__ void gated_act(T* __restrict__ out, const T* __restrict__ y, int y_stride, int inter, int n, int gelu) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = i / inter, c = i % inter;
        const T* row = y + (size_t)r * y_stride;
        const float a = to_f(from_f<T>(act(to_f(row[c]), gelu)));
        out[i] = from_f<T>(a * to_f(row[inter + c]));
    }
}

#define GA(NAME, T)                                                                                            \
    extern "C" __global__ void NAME(T* out, const T* y, int y_stride, int inter, int n, int gelu) {            \
        gated_act<T>(out, y, y_stride, inter, n, gelu);                                                        \
    }
GA(gated_act_f32, float)
GA(gated_act_bf16, __nv_bfloat16)
GA(gated_act_f16, __half)
