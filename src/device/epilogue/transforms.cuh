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

// An fp32 value into an output element, fp32 as it is or bf16 rounded once (to nearest even); accumulate adds
// the existing value first, in fp32 (one rounding of the sum). store_output4: four consecutive elements, 16-byte
// (fp32) or 8-byte (bf16) aligned.
__device__ __forceinline__ void store_output(float* dst, float v, bool accumulate) {
  *dst = accumulate ? v + *dst : v;
}
__device__ __forceinline__ void store_output(__nv_bfloat16* dst, float v, bool accumulate) {
  *dst = __float2bfloat16_rn(accumulate ? v + __bfloat162float(*dst) : v);
}
__device__ __forceinline__ void store_output4(float* dst, float4 v, bool accumulate) {
  if (accumulate) {
    const float4 old = *reinterpret_cast<const float4*>(dst);
    v.x += old.x;
    v.y += old.y;
    v.z += old.z;
    v.w += old.w;
  }
  *reinterpret_cast<float4*>(dst) = v;
}
__device__ __forceinline__ void store_output4(__nv_bfloat16* dst, float4 v, bool accumulate) {
  if (accumulate) {
    const uint2 old = *reinterpret_cast<const uint2*>(dst);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&old.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&old.y);
    v.x += __low2float(lo);
    v.y += __high2float(lo);
    v.z += __low2float(hi);
    v.w += __high2float(hi);
  }
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
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
