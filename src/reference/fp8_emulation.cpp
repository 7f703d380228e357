// CPU emulation of the blockwise FP8 (E4M3) recipe; see include/megamoe/fp8.hpp for the contract.
//
// The conversion works on the float's bit pattern with integer arithmetic only, so there is exactly one
// rounding step (a float -> double -> fp8 path would be exact too, but a float -> half -> fp8 one would
// double-round; integer code makes the single rounding obvious).
#include "megamoe/fp8.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace megamoe::fp8 {
namespace {

constexpr uint8_t kSignBit = 0x80;
constexpr uint8_t kMaxFiniteCode = 0x7E;  // 448 = 2^8 * 1.75
constexpr uint8_t kNaNCode = 0x7F;        // canonical NaN that cvt.rn.satfinite writes

void check_shape(const char* function, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0 || cols % kGroup != 0) {
    throw std::invalid_argument(std::string("megamoe::fp8::") + function + ": rows must be >= 0 and cols a " +
                                "non-negative multiple of 128, got rows=" + std::to_string(rows) +
                                " cols=" + std::to_string(cols));
  }
}

// NaN-ignoring max, what the GPU's fmaxf / max.f32 (without .NaN) does: a NaN element does not poison the
// scale of its group, it just encodes as NaN on its own.
float amax_step(float running, float value) {
  const float magnitude = std::fabs(value);
  return magnitude > running ? magnitude : running;
}

using ScaleRule = float (*)(float amax);

void quantize_group_range(const float* x, int64_t row_begin, int64_t row_end, int64_t col_begin, int64_t cols,
                          uint8_t* q, float* scale_out, ScaleRule rule = scale_from_amax) {
  float amax = 0.0f;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = col_begin; c < col_begin + kGroup; ++c) amax = amax_step(amax, x[r * cols + c]);
  }
  const float scale = rule(amax);
  *scale_out = scale;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = col_begin; c < col_begin + kGroup; ++c) {
      // True division, not a multiply by 1/scale: the reciprocal would add a second rounding the GPU
      // kernel does not have.
      q[r * cols + c] = float_to_e4m3(x[r * cols + c] / scale);
    }
  }
}

}  // namespace

uint8_t float_to_e4m3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = (bits >> 31) != 0 ? kSignBit : uint8_t{0};
  const int biased_exponent = static_cast<int>((bits >> 23) & 0xFFu);
  const uint32_t fraction = bits & 0x7FFFFFu;

  if (biased_exponent == 0xFF) {
    // satfinite: infinities clamp to the largest finite value; NaN is the canonical 0x7F whatever its sign.
    return fraction != 0 ? kNaNCode : static_cast<uint8_t>(sign | kMaxFiniteCode);
  }
  // Float subnormals (and zeros) have exponent 0 and lie far below 2^-10 = half the smallest E4M3 subnormal;
  // the same holds for every normal float with an unbiased exponent below -10.
  const int exponent = biased_exponent - 127;
  if (biased_exponent == 0 || exponent < -10) return sign;
  // |value| >= 512 is beyond 448 whatever the rounding.
  if (exponent > 8) return static_cast<uint8_t>(sign | kMaxFiniteCode);

  // Count |value| in units of the E4M3 spacing at its magnitude: 2^(exponent-3) in the normal range,
  // 2^-9 for everything below the smallest normal 2^-6. The 24-bit significand is value * 2^(23-exponent),
  // so the count is significand >> shift with shift = 23 + spacing_exponent - exponent (20 for normals,
  // 21..24 below 2^-6), rounded to nearest even on the dropped bits.
  const uint32_t significand = fraction | (1u << 23);
  const int spacing_exponent = std::max(exponent, -6) - 3;
  const int shift = 23 + spacing_exponent - exponent;
  uint32_t units = significand >> shift;
  const uint32_t dropped = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (dropped > half || (dropped == half && (units & 1u) != 0)) ++units;

  // Normal range: units is 8..16 (1.000 .. 10.000 in binary) and the code is (E << 3) + (units - 8) with
  // E = exponent + 7; writing it as ((exponent + 6) << 3) + units lets units == 16 carry into the next
  // binade for free. Below 2^-6, units is 0..8 and is the code itself (8 being the smallest normal).
  const uint32_t code =
      exponent >= -6 ? (static_cast<uint32_t>(exponent + 6) << 3) + units : units;
  // Rounding can go past 0x7E (to the NaN pattern or beyond) only from values above 448: saturate.
  return static_cast<uint8_t>(sign | std::min<uint32_t>(code, kMaxFiniteCode));
}

float e4m3_to_float(uint8_t bits) {
  const bool negative = (bits & kSignBit) != 0;
  const int exponent_field = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent_field == 0xF && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  // Every E4M3 value is a small integer times a power of two, so ldexp is exact.
  const float magnitude = exponent_field == 0
                              ? std::ldexp(static_cast<float>(mantissa), -9)
                              : std::ldexp(static_cast<float>(8 + mantissa), exponent_field - 7 - 3);
  return negative ? -magnitude : magnitude;
}

float scale_from_amax(float amax) {
  // NaN takes the division branch on purpose so it propagates into the scale instead of silently becoming 1;
  // the GPU must write the condition the same way (!(amax <= 0), not amax > 0).
  return !(amax <= 0.0f) ? amax / kE4M3Max : 1.0f;
}

float power_of_two_scale_from_amax(float amax) {
  if (amax <= 0.0f) return 1.0f;
  if (!(amax < std::numeric_limits<float>::infinity())) return amax;  // +inf, or NaN
  const uint32_t bits = std::bit_cast<uint32_t>(amax);
  // amax = m 2^e (m in [1, 2), or a denormal, whose field e = 0 reads as 2^-127 here and is clamped below) and
  // 448 = 1.75 2^8: 448 2^(e - 8) >= amax exactly when m <= 1.75, a significand field of at most 0x600000.
  const int e = static_cast<int>(bits >> 23) - 127;
  const int k = std::max(-126, e - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0));
  return std::bit_cast<float>(static_cast<uint32_t>(k + 127) << 23);
}

void quantize_rows_1x128(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
  check_shape("quantize_rows_1x128", rows, cols);
  const int64_t groups = cols / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      quantize_group_range(x, r, r + 1, g * kGroup, cols, q, &scales[r * groups + g]);
    }
  }
}

void dequantize_rows_1x128(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, float* x) {
  check_shape("dequantize_rows_1x128", rows, cols);
  const int64_t groups = cols / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      x[r * cols + c] = e4m3_to_float(q[r * cols + c]) * scales[r * groups + c / kGroup];
    }
  }
}

void quantize_blocks_128x128(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
  check_shape("quantize_blocks_128x128", rows, cols);
  const int64_t row_blocks = (rows + kGroup - 1) / kGroup;
  const int64_t col_blocks = cols / kGroup;
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    // The last row-block may be partial: its amax covers only the rows that exist.
    const int64_t row_end = std::min(rows, (rb + 1) * kGroup);
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      quantize_group_range(w, rb * kGroup, row_end, cb * kGroup, cols, q, &scales[rb * col_blocks + cb]);
    }
  }
}

void dequantize_blocks_128x128(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, float* w) {
  check_shape("dequantize_blocks_128x128", rows, cols);
  const int64_t col_blocks = cols / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      w[r * cols + c] = e4m3_to_float(q[r * cols + c]) * scales[(r / kGroup) * col_blocks + c / kGroup];
    }
  }
}

namespace {

void fake_quantize_rows_by(float* x, int64_t rows, int64_t cols, ScaleRule rule) {
  // One group at a time, so no full-size temporary is needed; the arithmetic is the same as
  // quantize_rows_1x128 followed by dequantize_rows_1x128.
  uint8_t q[kGroup];
  const int64_t groups = cols / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float* group = x + r * cols + g * kGroup;
      float scale = 0.0f;
      quantize_group_range(group, 0, 1, 0, kGroup, q, &scale, rule);
      for (int64_t i = 0; i < kGroup; ++i) group[i] = e4m3_to_float(q[i]) * scale;
    }
  }
}

}  // namespace

void fake_quantize_rows_1x128(float* x, int64_t rows, int64_t cols) {
  check_shape("fake_quantize_rows_1x128", rows, cols);
  fake_quantize_rows_by(x, rows, cols, scale_from_amax);
}

void fake_quantize_rows_1x128_power_of_two(float* x, int64_t rows, int64_t cols) {
  check_shape("fake_quantize_rows_1x128_power_of_two", rows, cols);
  fake_quantize_rows_by(x, rows, cols, power_of_two_scale_from_amax);
}

void fake_quantize_blocks_128x128(float* w, int64_t rows, int64_t cols) {
  check_shape("fake_quantize_blocks_128x128", rows, cols);
  const int64_t row_blocks = (rows + kGroup - 1) / kGroup;
  const int64_t col_blocks = cols / kGroup;
  std::vector<uint8_t> q(static_cast<size_t>(kGroup * cols));
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t row_begin = rb * kGroup;
    const int64_t row_end = std::min(rows, row_begin + kGroup);
    // Quantize a horizontal band of blocks into a band-sized buffer, then dequantize it back in place.
    float* band = w + row_begin * cols;
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      float scale = 0.0f;
      quantize_group_range(band, 0, row_end - row_begin, cb * kGroup, cols, q.data(), &scale);
      for (int64_t r = 0; r < row_end - row_begin; ++r) {
        for (int64_t c = cb * kGroup; c < (cb + 1) * kGroup; ++c) {
          band[r * cols + c] = e4m3_to_float(q[r * cols + c]) * scale;
        }
      }
    }
  }
}

}  // namespace megamoe::fp8
