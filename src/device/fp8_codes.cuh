// E4M3 on the device, bit for bit the CPU emulation of include/megamoe/fp8.hpp: the scale rule, the rounding of
// a group's values by its scale, and the values of codes. Shared by every quantizing kernel.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe::device {

inline constexpr float kE4M3Max = 448.0f;

// fp8::scale_from_amax: an all-zero (or all-NaN: the amax ignores NaN) group has scale 1.
__device__ __forceinline__ float scale_from_amax(float amax) { return !(amax <= 0.0f) ? amax / kE4M3Max : 1.0f; }

// The quotients v / scale of one group's values, bit for bit the IEEE division (round to nearest even) the
// CPU emulation does. A division per value made the quantizers bound by instructions (the token-major one
// issued about 40 a value), so the group's reciprocal is refined once, with the first two steps of the
// division's own sequence (the estimate and one Newton step), and each quotient is a product corrected by one
// FMA (v - q0 scale is exact in an FMA): the sequence the IEEE division itself runs whenever its range check
// passes, which it does for every scale in [2^-64, 2^64] and every value from 2^-11 to 449 scales in
// magnitude (a group's values are at most its amax, 448 scales); values below 2^-11 scales, where the range
// check may fail, have quotients whose codes are +-0 either way (their last bits may differ). The correction turns
// v = -0 into +0, so the value's sign is OR-ed back (idempotent for every other value; a NaN stays NaN).
// Scales outside that range (a denormal or infinite group) divide each value.
// tests/gpu/fp8_codes_test.cu checks the quotients against the division over every significand.
inline constexpr float kReciprocalScaleMin = 0x1p-64f;
inline constexpr float kReciprocalScaleMax = 0x1p64f;

__device__ __forceinline__ float refined_reciprocal(float scale) {
  float estimate;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(estimate) : "f"(scale));
  return __fmaf_rn(estimate, __fmaf_rn(estimate, -scale, 1.0f), estimate);
}

__device__ __forceinline__ float quotient_by_reciprocal(float v, float scale, float reciprocal) {
  const float q0 = __fmul_rn(v, reciprocal);
  const float q = __fmaf_rn(__fmaf_rn(-q0, scale, v), reciprocal, q0);
  return __uint_as_float(__float_as_uint(q) | (__float_as_uint(v) & 0x80000000u));
}

template <int kCount>
__device__ __forceinline__ void group_quotients(const float (&v)[kCount], float scale, float (&q)[kCount]) {
  if (scale >= kReciprocalScaleMin && scale <= kReciprocalScaleMax) {
    const float reciprocal = refined_reciprocal(scale);
#pragma unroll
    for (int i = 0; i < kCount; ++i) q[i] = quotient_by_reciprocal(v[i], scale, reciprocal);
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) q[i] = __fdiv_rn(v[i], scale);
  }
}

// fp8::float_to_e4m3 of two values (saturating to +-448, NaN -> 0x7F), the first in the low byte: one paired
// conversion.
__device__ __forceinline__ uint32_t e4m3x2_of(float v0, float v1) {
  return __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
}

// The same of four values, the first in the low byte.
__device__ __forceinline__ uint32_t e4m3x4_of(float v0, float v1, float v2, float v3) {
  return e4m3x2_of(v0, v1) | (e4m3x2_of(v2, v3) << 16);
}

// A value as a group's amax sees it: the bits of its magnitude (a non-negative float orders as its bits), a
// NaN as 0 (fp8::amax_step ignores NaN; an infinity stays).
__device__ __forceinline__ uint32_t amax_bits(float v) {
  constexpr uint32_t kInfinityBits = 0x7f800000u;
  const uint32_t bits = __float_as_uint(v) & 0x7fffffffu;
  return bits <= kInfinityBits ? bits : 0u;
}

// The codes of quotients already formed (v / scale), four to a word (value 4 w + k in byte k of word w).
template <int kCount>
__device__ __forceinline__ void e4m3_words_of_quotients(const float (&q)[kCount], uint32_t (&words)[kCount / 4]) {
  static_assert(kCount % 4 == 0, "whole words");
#pragma unroll
  for (int w = 0; w < kCount / 4; ++w) words[w] = e4m3x4_of(q[4 * w], q[4 * w + 1], q[4 * w + 2], q[4 * w + 3]);
}

// The codes of a group's values by its scale, four to a word (value 4 w + k in byte k of word w).
template <int kCount>
__device__ __forceinline__ void e4m3_words_of(const float (&v)[kCount], float scale, uint32_t (&words)[kCount / 4]) {
  float q[kCount];
  group_quotients(v, scale, q);
  e4m3_words_of_quotients(q, words);
}

// One 1x128 group held by a warp, 4 consecutive values per lane: the group's scale (amax from 0, NaN-ignoring
// as fp8::amax_step: an all-NaN group has amax 0 and scale 1, as on the CPU) and the lane's 4 E4M3 bytes.
// The amax is one warp reduction on the magnitudes' bits (a non-negative float orders as its bits; a NaN counts
// as 0): the same value as a butterfly of fmaxf, with one instruction where that has five dependent shuffles.
struct WarpGroupQuantized {
  uint32_t bytes;
  float scale;
};
__device__ __forceinline__ WarpGroupQuantized quantize_warp_group(const float (&v)[4]) {
  uint32_t magnitude = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i) magnitude = max(magnitude, amax_bits(v[i]));
  const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, magnitude));
  WarpGroupQuantized out{0u, scale_from_amax(amax)};
  uint32_t words[1];
  e4m3_words_of(v, out.scale, words);
  out.bytes = words[0];
  return out;
}

// fp8::power_of_two_scale_from_amax (the token-major copies' rule), from the bits of amax as on the CPU.
__device__ __forceinline__ float power_of_two_scale_from_amax(float amax) {
  if (amax <= 0.0f) return 1.0f;
  const uint32_t bits = __float_as_uint(amax);
  if (bits >= 0x7f800000u) return amax;  // +inf or NaN (amax is never negative)
  const int k = max(-126, static_cast<int>(bits >> 23) - 135 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0));
  return __uint_as_float(static_cast<uint32_t>(k + 127) << 23);
}

// The quotients v / scale of a group's values by a power-of-two scale (group_quotients' bits, fewer
// instructions): v / 2^k is exact, so it is v times 2^-k (also exact: k in [-126, 120]), one multiply a value.
// An infinite scale divides.
template <int kCount>
__device__ __forceinline__ void power_of_two_quotients(const float (&v)[kCount], float scale, float (&q)[kCount]) {
  const uint32_t bits = __float_as_uint(scale);
  if (bits < 0x7f800000u) {
    const float reciprocal = __uint_as_float(0x7f000000u - bits);  // 2^-k: biased exponent 254 - (k + 127)
#pragma unroll
    for (int i = 0; i < kCount; ++i) q[i] = __fmul_rn(v[i], reciprocal);
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) q[i] = __fdiv_rn(v[i], scale);
  }
}

// A power-of-two scale as the token-major copies keep it: the upper half of its fp32 bits (a bf16, exact).
__device__ __forceinline__ uint16_t power_of_two_scale_bits(float scale) {
  return static_cast<uint16_t>(__float_as_uint(scale) >> 16);
}

// One group of 128 of a token-major copy held by eight consecutive lanes (lanes 8 k .. 8 k + 7 of the warp),
// 16 values each: the group's power-of-two scale (the amax ignores NaN, as everywhere) and the lane's 16 E4M3
// bytes, value i in byte i % 4 of word i / 4. Every lane of the warp calls it (the shuffles stay inside each
// eight).
struct OctetGroupQuantized {
  uint32_t words[4];
  float scale;
};
__device__ __forceinline__ OctetGroupQuantized quantize_octet_group(const float (&v)[16]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = 1; offset < 8; offset *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  OctetGroupQuantized out;
  out.scale = power_of_two_scale_from_amax(amax);
  float q[16];
  power_of_two_quotients(v, out.scale, q);
  e4m3_words_of_quotients(q, out.words);
  return out;
}

// fp8::e4m3_to_float of the four codes of a word (byte k to value k), by two paired conversions to half:
// every E4M3 code is exact in half and in fp32.
__device__ __forceinline__ void e4m3x4_values(uint32_t word, float (&v)[4]) {
  const __half2_raw low = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xffffu), __NV_E4M3);
  const __half2_raw high = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(low)), b = __half22float2(__half2(high));
  v[0] = a.x;
  v[1] = a.y;
  v[2] = b.x;
  v[3] = b.y;
}

}  // namespace megamoe::device
