// The dispatched E4M3 rows of the layer's experts copied into expert order, before the GEMMs whose A operand
// they are (GEMM1's x and the dgrad's d_out). The layer makes this copy with the token-major quantizer of the
// same rows (fp8_token_major.hpp, token_major_quantize_e4m3_gathering, one read of the rows for both); this
// plain copy is its twin in the tests. The FP8 GEMM reads a contiguous A through TMA boxes at
// the rate of its TMA-operand form; gathering rows by index inside it runs 0.75-0.80x that (docs/PERF.md runs
// 57 and 61), so one copy pass of the rows (2 bytes of traffic per byte of A) buys back a fifth of those GEMMs.
//
// Row r < *rows_used of the output is source row row_src[r] of q [source_rows, cols] (clamped into
// [0, source_rows), as the GEMM's gathered form clamps it), its 1x128 scales from scales [source_rows, cols / 128]
// (row-major: the receive buffers' layout) written K-block-major into out_s [cols / 128, scales_pitch] (the
// FP8 GEMM's A-scale layout, fp8_layout.hpp). Rows from *rows_used (clamped into [0, capacity]) to capacity
// are not written (a GEMM's last partial tile reads them, for rows whose outputs it never stores). The row count
// is *rows_used alone: the layer's expert offsets end there, from 0 and non-decreasing as route_rows writes
// them. Bit copies: the GEMM on the copy gives the bits of the gathered GEMM.
//
// Requirements (kInvalidArgument otherwise): cols a positive multiple of 128; capacity >= 0; source_rows >= 1
// when capacity > 0; scales_pitch >= capacity; q and out_q 16-byte aligned, no pointer null. Asynchronous on
// `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/status.hpp"

namespace megamoe::kernels {

Status gather_rows_e4m3(const uint8_t* q, const float* scales, int64_t source_rows, const int32_t* row_src,
                        int64_t cols, const int32_t* rows_used, int64_t capacity, uint8_t* out_q, float* out_s,
                        int64_t scales_pitch, cudaStream_t stream);

// Loads the kernel now (see fp8_quantize_preload).
Status gather_rows_preload();

}  // namespace megamoe::kernels
