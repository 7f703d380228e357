// Elementwise transforms of the epilogues, in fp32 on the accumulator values; outputs are rounded to bf16
// once, round-to-nearest-even, when they are packed.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace megamoe::device {

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Fast sigmoid: ex2 and rcp on the special-function unit (exact enough for a bf16 result; sigmoid of a
// large negative g underflows to 0 cleanly, since rcp(inf) = 0).
__device__ __forceinline__ float sigmoid_fast(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }

// a = silu(g) * u.
__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid_fast(g) * u; }

// The SwiGLU backward of one element, given da (the gradient of a, already scaled by the row's routing
// weight where that applies): dg = da * u * s * (1 + g * (1 - s)), du = da * silu(g), with s = sigmoid(g).
// Also returns a = silu(g) * u, which the routing-weight gradient contracts with da.
struct SwiGLUGrad {
  float dg, du, a;
};
__device__ __forceinline__ SwiGLUGrad swiglu_backward(float da, float g, float u) {
  const float s = sigmoid_fast(g);
  const float silu = g * s;
  return SwiGLUGrad{da * u * s * (1.0f + g * (1.0f - s)), da * silu, silu * u};
}

}  // namespace megamoe::device
