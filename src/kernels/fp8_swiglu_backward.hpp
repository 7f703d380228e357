// The FP8 backward's SwiGLU step in one pass over g and h (docs/FP8.md, the FP8 backward's items 4 and 6).
//
// Per routed row r of every local expert (the rows of kernels/token_major_groups.cuh: expert e's rows
// [offsets[e], offsets[e + 1]), clamped into [0, capacity]): w = row_weight[r], g [capacity, I] fp32 the dgrad
// of GEMM2 before the routing weight, h [capacity, 2I] fp32 GEMM1's output (gate columns, then up). With
// da = w g, dh = SwiGLU'(da) (dg then du, 2I channels) and a = silu(gate) up, as the epilogues compute them
// (device/epilogue/transforms.cuh), it writes
//   - dh quantized 1 x 128 along 2I, row-major dh_q [capacity, 2I], scales K-block-major
//     dh_s[kb * dh_scales_pitch + r] (the A operand of the dgrad into x);
//   - the routing-weight gradient <g, a> (fp32, a fixed order) into dot_rows[r][0], the row's other dot_parts - 1
//     partials set to 0 (dot_rows optional; a null row pointer skips the row);
//   - the token-major copies of a (I channels: at_q, at_s) and of dh (2I channels: dht_q, dht_s) that the weight
//     gradients read, in the layout of kernels/fp8_token_major.hpp.
// Bit for bit what swiglu_backward_quantize_rows_1x128 (fp8_quantize.hpp, over the experts' rows) and
// token_major_quantize_swiglu_pair (fp8_token_major.hpp) write between them; the two read g and h once each,
// this kernel once for both (each block holds one group of 128 rows times 128 channels of a, dg and du in
// shared memory, so that it quantizes them along the rows and along the channels).
//
// Requirements (kInvalidArgument otherwise): I a positive multiple of 128, experts >= 1, capacity >= 0,
// dh_scales_pitch >= capacity, dot_parts >= 1 with dot_rows; g, h, at_q and dht_q 16-byte aligned, dh_q 4-byte
// aligned, no null pointer but dot_rows. Asynchronous on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/fp8_layout.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

struct SwigluBackwardFp8Outputs {
  uint8_t* dh_q = nullptr;
  float* dh_s = nullptr;
  int64_t dh_scales_pitch = 0;
  float* const* dot_rows = nullptr;
  int dot_parts = 0;
  uint8_t* at_q = nullptr;
  TokenMajorScale* at_s = nullptr;
  uint8_t* dht_q = nullptr;
  TokenMajorScale* dht_s = nullptr;
};

Status swiglu_backward_quantize_fp8(const float* g, const float* h, const float* row_weight, int64_t I,
                                    const int32_t* offsets, int experts, int64_t capacity,
                                    const SwigluBackwardFp8Outputs& out, cudaStream_t stream);

// Loads the kernel now (see fp8_quantize_preload).
Status swiglu_backward_fp8_preload();

}  // namespace megamoe::kernels
