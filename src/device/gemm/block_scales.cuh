// The scales of blockwise FP8 (DeepSeek-V3 recipe: include/megamoe/fp8.hpp) as the main loop consumes them:
// for a 128 x BN tile and one 128-deep K block, the A scales of the tile's 128 rows (one per 1 x 128 group of
// a row: sa[kb, row]) and the one B scale of the tile's 128 x 128 weight block (sb[n_block, kb]).
//
// The A scales are stored K-block-major (sa [K / 128, pitch]: one K block's scales of every row contiguous),
// so a stage's 128 of them are one TMA box of 512 bytes that completes on the stage's full barrier like the
// operand boxes (one more arrival, with its own transaction count, by the thread that issues it). The B
// scale is one float per K block for the whole tile: the consumer threads read it from global memory
// themselves, one K block ahead (mma_tile_fp8_blockwise), instead of passing it through shared memory.
// Neither path is an ordinary shared-memory hand-over between threads, so there is nothing for a proxy fence
// or a race checker to order beyond the barrier wait. With A's rows gathered by index the scales are gathered
// with them, by the producer threads' cp.async (gather_block_scale).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/pipeline.cuh"
#include "device/ptx/cp_async.cuh"
#include "device/ptx/mbarrier.cuh"
#include "device/ptx/tma.cuh"
#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

// One stage's A scales. A TMA box must start on a 16-byte boundary of its inner dimension (seen on the
// H200: a box of scales starting at row 130 stopped the kernel with an illegal instruction), and a tile's
// first row is any row, so the box starts at the tile's first row rounded down to a multiple of 4 and is
// 4 rows longer than the tile: the tile's row r has its scale at a[(row0 & 3) + r] (tile_scales). Rows past
// the tensor's end load as 0; rows outside the tile carry their own scales (their outputs are never stored).
// 128-byte aligned: a TMA destination.
inline constexpr int kScaleBoxRows = 128 + 4;
struct alignas(128) StageScales {
  float a[kScaleBoxRows];
};

inline constexpr uint32_t kStageScaleBytes = sizeof(StageScales::a);

__device__ __forceinline__ int scale_box_row0(int row0) { return row0 & ~3; }
// The scales of the tile's rows (row 0 first) in a stage's slot.
__device__ __forceinline__ const float* tile_scales(const StageScales& slot, int row0) { return slot.a + (row0 & 3); }
inline constexpr int kScaleArrivals = 1;  // full-barrier arrivals per stage of the thread that loads the scales

// Both operands scaled per row and K block (the weight gradients' token-major operands,
// kernels/fp8_token_major.hpp): one stage's 128 scales of the tile's A rows and kColumns of its B rows (the
// output columns), each one TMA box of a K-block-major scale tensor [k_blocks, rows]; tiles start at multiples
// of their size there, so the boxes need no offset. One producer thread loads both with one transaction count.
// The scales are powers of two kept as the upper halves of their fp32 bits (kernels/fp8_layout.hpp's
// TokenMajorScale): every consumer thread reads 32 column scales a K block, and at 4 bytes each those reads
// took as many shared-memory wavefronts as two thirds of the wgmma operands (docs/FP8.md, "The weight
// gradients").
template <int kColumns = 128>
struct alignas(128) StageChannelScales {
  uint16_t a[128];
  uint16_t b[kColumns];
};

// A scale of StageChannelScales as fp32.
__device__ __forceinline__ float widen_channel_scale(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

template <int kStages, int kColumns>
__device__ __forceinline__ void load_channel_scales(const StagePipeline<kStages>& pipe, const PipeState<kStages>& st,
                                                    StageChannelScales<kColumns>* slot, const CUtensorMap* map_sa,
                                                    const CUtensorMap* map_sb, int m0, int n0, int kb) {
  pipe.producer_expect_tx(st, static_cast<uint32_t>(sizeof(slot->a) + sizeof(slot->b)));
  tma_load_2d(slot->a, map_sa, m0, kb, pipe.full_barrier(st));
  tma_load_2d(slot->b, map_sb, n0, kb, pipe.full_barrier(st));
}

// Where the B scales come from: sb [groups, n_blocks, k_blocks] fp32 row-major.
struct WeightScales {
  const float* sb;
  int k_blocks;  // K / 128
  int n_blocks;  // ceil(N / 128)

  // The k_blocks scales of the weight block of `tile` (n_block = tile.n_idx: the tile is 128 columns wide).
  __device__ __forceinline__ const float* of(const TileCoord& tile) const { return of_block(tile, tile.n_idx); }
  // The same of weight block row n_block of the tile's group.
  __device__ __forceinline__ const float* of_block(const TileCoord& tile, int n_block) const {
    return sb + (static_cast<int64_t>(tile.e) * n_blocks + n_block) * k_blocks;
  }
};

// Gathered rows: tile row r's scale for K block kb, copied by the gathering producer thread r with its row
// copies (cp.async; its arrival on the stage's full barrier covers it). sa_rows: the source's scales
// [source_rows, k_blocks] row-major; src_row: the source row of tile row r, or -1 (zero-filled: a row past the
// expert, never stored). The slot is laid out as the TMA path lays it out (tile_scales).
__device__ __forceinline__ void gather_block_scale(StageScales* slot, int row0, int r, const float* sa_rows,
                                                   int src_row, int k_blocks, int kb) {
  const bool valid = src_row >= 0;
  const float* src = valid ? sa_rows + static_cast<int64_t>(src_row) * k_blocks + kb : sa_rows;
  cp_async_4(smem_addr(slot->a + (row0 & 3) + r), src, valid);
}

// One thread: the A scales of K block kb of `tile` into the stage's slot, through `map_sa` (the fp32 tensor
// [k_blocks, pitch] of sa, boxes of kScaleBoxRows rows x 1 K block), with this thread's arrival and
// transaction count.
template <int kStages>
__device__ __forceinline__ void load_block_scales(const StagePipeline<kStages>& pipe, const PipeState<kStages>& st,
                                                  StageScales* slot, const CUtensorMap* map_sa, const TileCoord& tile,
                                                  int kb) {
  pipe.producer_expect_tx(st, kStageScaleBytes);
  tma_load_2d(slot->a, map_sa, scale_box_row0(tile.row0), kb, pipe.full_barrier(st));
}

}  // namespace megamoe::device
