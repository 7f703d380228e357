// FP8 (E4M3) quantisation on the GPU, bit-exact with the CPU emulation in include/megamoe/fp8.hpp (same scale
// rule, same IEEE division, same rounding): per-token 1x128 groups of activations, 128x128 blocks of weights.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/status.hpp"

namespace megamoe::kernels {

// x [rows, cols] bf16 row-major, cols a multiple of 128 -> q [rows, cols] E4M3 bytes and one fp32 scale per
// 1x128 group: scales [rows, cols / 128] row-major when scales_pitch is 0, else K-block-major, the group
// (row, kb) at scales[kb * scales_pitch + row] (scales_pitch >= rows: fp8_scale_pitch(rows) gives the layout the
// FP8 GEMM reads, kernels/fp8_gemm.hpp). Asynchronous on `stream`.
Status quantize_rows_1x128_bf16(const __nv_bfloat16* x, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                cudaStream_t stream, int64_t scales_pitch = 0);

// GEMM1's output h [rows, 2I] fp32 (gate columns 0..I-1, then up columns; unrounded, so that a is quantized
// from the values the FP8 reference quantizes) -> a = silu(g) * u in fp32, as the SwiGLU epilogues compute it
// (device/epilogue/transforms.cuh), quantized in 1x128 groups along I by the rules of quantize_rows_1x128:
// aq [rows, I] E4M3 bytes and the scales
// K-block-major, group (row, kb) at scales[kb * scales_pitch + row] (scales_pitch >= rows; the FP8 GEMM's
// layout, kernels/fp8_gemm.hpp). rows_used, optional device int: only rows [0, *rows_used) (clamped into
// [0, rows]) are read and written, the layer's expert rows counted on the device. Asynchronous on `stream`.
Status swiglu_quantize_rows_1x128(const float* h, int64_t rows, int64_t I, const int32_t* rows_used,
                                  uint8_t* aq, float* scales, int64_t scales_pitch, cudaStream_t stream);

// w [rows, cols] bf16 row-major (cols a multiple of 128, rows any) -> q [rows, cols] E4M3 bytes and one fp32
// scale per 128 x 128 block, scales [ceil(rows / 128), cols / 128] row-major (the last block row may be
// partial: its scale covers the rows that exist). Expert weights [E, N, K] quantize as one matrix of E * N
// rows when N is a multiple of 128 (every block then lies inside one expert, and the scales are
// [E, N / 128, K / 128]). Bit for bit fp8::quantize_blocks_128x128. Asynchronous on `stream`.
Status quantize_blocks_128x128_bf16(const __nv_bfloat16* w, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                    cudaStream_t stream);

// The FP8 backward's step between its two dgrads (docs/FP8.md, the planned backward), per routed row r of
// [0, rows) (or [0, *rows_used)): g [rows, I] fp32, the dgrad of GEMM2 before the routing weight; h [rows, 2I]
// fp32 from the forward; w = row_weight[r]. da = w g; dh = SwiGLU'(da) (gate columns, then up columns), as the
// bf16 epilogue computes it (device/epilogue/transforms.cuh), quantized 1x128 along 2I: dh_q [rows, 2I] and
// K-block-major scales dh_s [2I / 128, scales_pitch]. Optional: a_out [rows, I] fp32 = a = silu(g_h) u_h
// (unweighted: the FP8 reference's dW2 is dy^T a with dy = w dOut, its point B8), and the routing-weight
// gradient <g, a> summed in a fixed order into dot_rows[r][0] (the row's other dot_parts - 1 partials set to
// 0; a null row pointer skips the row).
Status swiglu_backward_quantize_rows_1x128(const float* g, const float* h, const float* row_weight, int64_t rows,
                                           int64_t I, const int32_t* rows_used, uint8_t* dh_q, float* dh_s,
                                           int64_t scales_pitch, float* a_out, float* const* dot_rows, int dot_parts,
                                           cudaStream_t stream);

// The transposed copies the backward's FP8 GEMMs read (both operands of an FP8 wgmma are K-major): `groups`
// matrices q [N, K] of E4M3 bytes with their 128 x 128 block scales [N / 128, K / 128] (row-major, per group,
// as quantize_blocks_128x128_bf16 makes them) -> qt [K, N] and scales_t [K / 128, N / 128]. A 128 x 128 block's
// amax is the same set of values either way, so the result is bit for bit the quantization of the transposed
// matrix. N and K multiples of 128; q and qt 16-byte aligned. Asynchronous on `stream`.
Status transpose_blocks_128x128_e4m3(const uint8_t* q, const float* scales, int64_t groups, int64_t N, int64_t K,
                                     uint8_t* qt, float* scales_t, cudaStream_t stream);

// Loads every quantization kernel now (under lazy module loading a first launch waits for running kernels,
// which a layer's virtual rank spinning at a barrier would make a deadlock until its timeout).
Status fp8_quantize_preload();

}  // namespace megamoe::kernels
