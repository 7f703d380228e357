// The weight gradients' FP8 operands (docs/FP8.md, the backward plan's item 6; point B8 of the FP8 CPU reference):
// the routed rows of every local expert, held row-major in expert order, transposed to token-major and quantized
// along the routed rows, one scale per channel and group of 128 rows. The weight-gradient GEMM reduces over the
// routed rows, so these are its K-major operands, and a group of 128 rows is one of its K blocks.
//
// Layout of the copy. Expert e's rows [offsets[e], offsets[e + 1]) land in the columns starting at
//   token_major_start(e) = round_up(offsets[e], 128) + 128 e
// (a multiple of 128 for every e, the segments apart), the last group's missing rows as zeros; other columns
// are not written. qt is [channels, token_major_columns(capacity, experts)] E4M3 bytes; the scales are
// K-block-major, channel c of K block kb = column / 128 at st[kb * channels + c] (what a TMA box of 128
// channels of one K block reads), [token_major_columns / 128, channels].
// Rounding (include/megamoe/fp8.hpp): a power-of-two scale over the group's values
// (fp8::power_of_two_scale_from_amax: NaN ignored, an all-zero group scale 1), kept as a TokenMajorScale
// (fp8_layout.hpp), codes e4m3(v / scale) with saturation (the quotients exact). Asynchronous on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/fp8_layout.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

// Rows that are fp32 values [capacity, channels] row-major (the expert rank's own values: a, dh).
// offsets: device int32 [experts + 1], from 0, non-decreasing, at most capacity (the layer's expert
// offsets; values outside are clamped into [0, capacity]). channels a multiple of 128.
Status token_major_quantize_fp32(const float* rows, int64_t channels, const int32_t* offsets, int experts,
                                 int64_t capacity, uint8_t* qt, TokenMajorScale* st, cudaStream_t stream);

// Rows that are dispatched E4M3 copies (x, d_out): routed row r is source row row_src[r] of q [source_rows,
// channels] with its 1x128 scales [source_rows, channels / 128] row-major (the receive buffers' layout),
// dequantized (code value * scale, one fp32 multiply) and, with row_weight, multiplied by row_weight[r] (dy =
// w dOut). A row_src outside [0, source_rows) reads as zeros. q 8-byte aligned.
Status token_major_quantize_e4m3(const uint8_t* q, const float* scales, int64_t source_rows, const int32_t* row_src,
                                 const float* row_weight, int64_t channels, const int32_t* offsets, int experts,
                                 int64_t capacity, uint8_t* qt, TokenMajorScale* st, cudaStream_t stream);

// token_major_quantize_e4m3 that also copies the routed rows into expert order, codes and scales as they are:
// each row r of an expert's (clamped) rows, the rows its groups cover, into row r of rows_q [capacity,
// channels] and its scales K-block-major into rows_s [channels / 128, rows_s_pitch] (rows_s_pitch >=
// capacity), from the one read of them that the transposition makes. Other rows are not written. For offsets
// from 0 and non-decreasing (the layer's) those are rows [0, offsets[experts]), and the bytes are what
// gather_rows_e4m3 (fp8_gather_rows.hpp) writes with rows_used = offsets + experts, except that a row_src
// outside [0, source_rows) is copied as zero codes and a zero scale (the gather clamps it). q and rows_q
// 8-byte aligned.
Status token_major_quantize_e4m3_gathering(const uint8_t* q, const float* scales, int64_t source_rows,
                                           const int32_t* row_src, const float* row_weight, int64_t channels,
                                           const int32_t* offsets, int experts, int64_t capacity, uint8_t* qt,
                                           TokenMajorScale* st, uint8_t* rows_q, float* rows_s, int64_t rows_s_pitch,
                                           cudaStream_t stream);

// a = silu(g) u from GEMM1's fp32 output h [capacity, 2I] (gate columns 0..I-1, then up), I channels, with the
// epilogues' arithmetic (the forward's a, fp32). I a multiple of 128; h 16-byte aligned.
Status token_major_quantize_swiglu(const float* h, int64_t I, const int32_t* offsets, int experts, int64_t capacity,
                                   uint8_t* qt, TokenMajorScale* st, cudaStream_t stream);

// dh = SwiGLU'(w g) per routed row r (w = row_weight[r], g [capacity, I] the dgrad of GEMM2, h as above), 2I
// channels: dg then du, the values swiglu_backward_quantize_rows_1x128 (fp8_quantize.hpp) computes.
Status token_major_quantize_swiglu_grad(const float* g, const float* h, const float* row_weight, int64_t I,
                                        const int32_t* offsets, int experts, int64_t capacity, uint8_t* qt,
                                        TokenMajorScale* st, cudaStream_t stream);

// Both SwiGLU operands of the weight gradients from one read of g and h (the two calls above read them twice
// between them): writes bit for bit what token_major_quantize_swiglu(h, I, ..., at_q, at_s, ...) and
// token_major_quantize_swiglu_grad(g, h, row_weight, I, ..., dht_q, dht_s, ...) write, with their requirements.
Status token_major_quantize_swiglu_pair(const float* g, const float* h, const float* row_weight, int64_t I,
                                        const int32_t* offsets, int experts, int64_t capacity, uint8_t* at_q,
                                        TokenMajorScale* at_s, uint8_t* dht_q, TokenMajorScale* dht_s,
                                        cudaStream_t stream);

// Loads every instantiation of the kernel now (see fp8_quantize_preload).
Status token_major_preload();

}  // namespace megamoe::kernels
