// E4M3 on the device, bit for bit the CPU emulation of include/megamoe/fp8.hpp: the scale rule, the rounding of
// a value by its scale, and the value of a code. Shared by every quantizing kernel.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe::device {

inline constexpr float kE4M3Max = 448.0f;

// fp8::scale_from_amax: an all-zero (or all-NaN: the amax ignores NaN) group has scale 1.
__device__ __forceinline__ float scale_from_amax(float amax) { return !(amax <= 0.0f) ? amax / kE4M3Max : 1.0f; }

// fp8::float_to_e4m3 of v / scale (IEEE division, round to nearest even, saturating to +-448, NaN -> 0x7F).
__device__ __forceinline__ uint32_t e4m3_of(float v, float scale) {
  return __nv_cvt_float_to_fp8(v / scale, __NV_SATFINITE, __NV_E4M3);
}

// fp8::e4m3_to_float: every E4M3 code is exact in fp32.
__device__ __forceinline__ float e4m3_value(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code & 0xffu), __NV_E4M3);
  return __half2float(__half(h));
}

}  // namespace megamoe::device
