// TMA tensor maps (CUtensorMap) of bf16 and fp32 tensors, encoded on the host through the driver entry point the
// CUDA runtime hands out (no link against libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "megamoe/status.hpp"

namespace megamoe {

// A row-major bf16 tensor of `rank` (2 or 3) dimensions, dims[0] innermost (elements), boxes of `box`
// elements with box[0] * 2 == 128 bytes: one span of the 128-byte swizzle every tile here uses.
// Out-of-range elements of a box load as zeros and are not stored.
Status make_bf16_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims, const uint32_t* box);

// The two shapes the GEMMs use: a [rows, cols] matrix in boxes of box_rows x 64 columns (rows 0 maps one row),
// and per-expert matrices [experts, rows, cols] in boxes of box_rows x 64 columns of one expert.
Status make_bf16_rows_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, uint32_t box_rows);
Status make_bf16_experts_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, int64_t experts,
                             uint32_t box_rows);

// A 2-D fp32 tensor [dims[1], pitch] (dims[0] <= pitch elements used per row, pitch * 4 bytes a multiple of 16,
// as TMA strides must be): boxes of box[0] x box[1] elements (box[0] * 4 a multiple of 16) land as plain
// row-major arrays, or with swizzle_128b (box[0] * 4 == 128) in the 128-byte swizzle of the bf16 maps (a box
// 1024-aligned in shared memory). Out-of-range elements load as zeros and are not stored.
Status make_fp32_tensor_map_2d(CUtensorMap* map, const void* base, const uint64_t* dims, uint64_t pitch,
                               const uint32_t* box, bool swizzle_128b = false);

// A 2-D tensor of 16-bit elements [dims[1], dims[0]] (dims[0] * 2 bytes a multiple of 16): boxes of box[0] x
// box[1] elements (box[0] * 2 a multiple of 16) land as plain row-major arrays; out-of-range elements load as
// zeros.
Status make_u16_tensor_map_2d(CUtensorMap* map, const void* base, const uint64_t* dims, const uint32_t* box);

}  // namespace megamoe
