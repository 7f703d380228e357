// Where the weight gradients' token-major FP8 operands put each expert's routed rows (kernels/fp8_token_major.hpp):
// expert e's rows, the expert-major rows [first_row, ...), from column token_major_start(first_row, e), a multiple
// of 128 (so that every group of 128 rows is one K block of the weight-gradient GEMM), the segments apart; the
// copy of `experts` experts sharing `capacity` rows has token_major_columns(capacity, experts) columns. Plain
// arithmetic, shared by the host (workspace sizes) and the device (the quantizer, the GEMM).
#pragma once

#include <cstdint>

namespace megamoe::kernels {

constexpr int64_t token_major_columns(int64_t capacity, int64_t experts) {
  return (capacity + 127) / 128 * 128 + 128 * experts;
}

constexpr int64_t token_major_start(int64_t first_row, int64_t expert) {
  return (first_row + 127) / 128 * 128 + 128 * expert;
}

}  // namespace megamoe::kernels
