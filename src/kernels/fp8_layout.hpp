// Where the FP8 operands' scales and token-major copies live: plain arithmetic, shared by the host (workspace
// sizes, launches) and the device (the quantizers, the GEMMs).
//
// K-block-major activation scales: sa[kb, m] at kb * fp8_scale_pitch(rows) + m, rows rounded up to a multiple
// of 4 floats (TMA row strides are multiples of 16 bytes); the FP8 GEMM reads them (fp8_gemm.hpp).
//
// The weight gradients' token-major operands (fp8_token_major.hpp): expert e's rows, the expert-major rows
// [first_row, ...), from column token_major_start(first_row, e), a multiple of 128 (so that every group of
// 128 rows is one K block of the weight-gradient GEMM), the segments apart; the copy of `experts` experts
// sharing `capacity` rows has token_major_columns(capacity, experts) columns. Their scales are powers of two
// (fp8::power_of_two_scale_from_amax), each kept as a TokenMajorScale: the upper 16 bits of its fp32 value, a
// bf16 (exact), so that the weight-gradient GEMM reads half the bytes an fp32 scale would take and widens one
// with one shift.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

using TokenMajorScale = uint16_t;

// The fp32 value of a TokenMajorScale, on the host (the tests read the scales back with it; the weight-gradient
// GEMM widens them itself, device/gemm/block_scales.cuh).
inline float token_major_scale_value(TokenMajorScale bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  __builtin_memcpy(&value, &word, sizeof(value));
  return value;
}

// Floats between two K blocks of a K-block-major scale tensor of `rows` rows.
constexpr int64_t fp8_scale_pitch(int64_t rows) { return (rows + 3) / 4 * 4; }

constexpr int64_t token_major_columns(int64_t capacity, int64_t experts) {
  return (capacity + 127) / 128 * 128 + 128 * experts;
}

constexpr int64_t token_major_start(int64_t first_row, int64_t expert) {
  return (first_row + 127) / 128 * 128 + 128 * expert;
}

}  // namespace megamoe::kernels
