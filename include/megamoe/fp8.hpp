// Blockwise FP8 (E4M3) emulation on the CPU, bit-exact with the GPU conversion
// `cvt.rn.satfinite.e4m3x2.f32`: round to nearest even, finite values beyond 448 saturate to +-448,
// +-inf saturate to +-448, NaN becomes 0x7F, subnormals down to 2^-9 are kept.
//
// Scales (DeepSeek-V3 recipe): one fp32 scale per 1x128 group of an activation row, one per 128x128
// block of a weight matrix; scale = amax / 448 (1 when the group is all zero), q = e4m3(v / scale),
// dequantized value = float(q) * scale.
//
// The GPU side must match these choices bit for bit:
// - NaN converts to 0x7F whatever its sign (what cvt.rn.satfinite.e4m3x2.f32 writes); 0x7F and 0xFF decode
//   to NaN. -0.0 converts to 0x80 and decodes to -0.0.
// - Both divisions (amax / 448 and v / scale) are IEEE fp32 round-to-nearest divisions (__fdiv_rn, no
//   fast-math, no multiply by a reciprocal) and denormals are not flushed. The dequantize multiply is one
//   fp32 multiply.
// - A group's amax ignores NaN elements (fmaxf semantics), so a NaN only makes its own element NaN.
// - scale_from_amax(NaN) is NaN (the condition is !(amax <= 0), not amax > 0). An infinite element makes
//   amax and the scale infinite: the group's finite values quantize to +-0 and the infinite ones to NaN,
//   so the whole group dequantizes to NaN (0 * inf), which surfaces the overflow instead of hiding it.
// - Edge case kept as is, not patched: amax below 448 * 2^-149 (a denormal group) gives a scale that
//   underflows to 0; its elements then divide by zero (nonzero -> +-448, zero -> NaN) and dequantize to
//   0 or NaN.
//
// The array functions throw std::invalid_argument when rows < 0 or cols is not a non-negative multiple
// of 128.
#pragma once

#include <cstdint>

namespace megamoe::fp8 {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr int64_t kGroup = 128;  // scale group along a row; weight blocks are kGroup x kGroup

uint8_t float_to_e4m3(float value);
float e4m3_to_float(uint8_t bits);
inline float round_to_e4m3(float value) { return e4m3_to_float(float_to_e4m3(value)); }

// The scale of one group from its absolute maximum.
float scale_from_amax(float amax);

// The scale rule of the weight gradients' token-major operands (docs/FP8.md, point B8): the smallest power of
// two 2^k with 448 * 2^k >= amax, k at least -126 (a normal fp32, so that 1 / scale is exact too), read off the
// bits of amax (no division); 1 for an all-zero group, +inf for an infinite amax (the group then dequantizes to
// NaN, as with scale_from_amax), NaN for NaN. The quotients v / scale are exact, and a power of two is exact as
// a bf16, the form the GPU keeps these scales in. At most 2x coarser than scale_from_amax (a group's codes use
// magnitudes down to 224 instead of 448) above the clamp, never finer.
float power_of_two_scale_from_amax(float amax);

// Activations [rows, cols], cols a multiple of 128: q [rows, cols], scales [rows, cols / 128].
void quantize_rows_1x128(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales);
void dequantize_rows_1x128(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, float* x);

// Weights [rows, cols], cols a multiple of 128, rows any: q [rows, cols],
// scales [ceil(rows / 128), cols / 128] (row-major over blocks).
void quantize_blocks_128x128(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scales);
void dequantize_blocks_128x128(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                               float* w);

// Round-trip helpers (quantize then dequantize in place), what the FP8 reference layer uses.
void fake_quantize_rows_1x128(float* x, int64_t rows, int64_t cols);
void fake_quantize_blocks_128x128(float* w, int64_t rows, int64_t cols);
// fake_quantize_rows_1x128 with power_of_two_scale_from_amax for the scale.
void fake_quantize_rows_1x128_power_of_two(float* x, int64_t rows, int64_t cols);

}  // namespace megamoe::fp8
