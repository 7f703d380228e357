// Per-token 1x128 FP8 (E4M3) quantisation of bf16 activations on the GPU, bit-exact with the CPU
// emulation in include/megamoe/fp8.hpp (same scale rule, same IEEE division, same rounding).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/status.hpp"

namespace megamoe::kernels {

// x [rows, cols] bf16 row-major, cols a multiple of 128 -> q [rows, cols] E4M3 bytes,
// scales [rows, cols / 128] fp32 row-major. Asynchronous on `stream`.
Status quantize_rows_1x128_bf16(const __nv_bfloat16* x, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                cudaStream_t stream);

}  // namespace megamoe::kernels
