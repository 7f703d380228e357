// The scales of blockwise FP8 (DeepSeek-V3 recipe: include/megamoe/fp8.hpp) travelling with the main loop's
// stages: for a 128 x BN tile and one 128-deep K block, the A scales of the tile's 128 rows (one per 1 x 128
// group of a row: sa[row, kb]) and the one B scale of the tile's 128 x 128 weight block (sb[n_block, kb]).
//
// One producer warp copies them into the stage's scale slot with 4-byte cp.async (the A scales of a tile are
// a strided column of sa [rows, K / 128], which TMA cannot fetch as a box) and arrives on the stage's full
// barrier when its copies have landed (cp.async.mbarrier.arrive.noinc: each of the 32 lanes is one of the
// barrier's initial arrivals, on top of the TMA thread's). The consumers read the scales with ordinary
// shared-memory loads, so the barrier wait alone orders them (no proxy fence: wgmma never reads them).
#pragma once

#include <cstdint>

#include "device/pipeline.cuh"
#include "device/ptx/mbarrier.cuh"
#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

// 4 bytes from `src` to shared address `dst`; with valid == false nothing is read and `dst` is zero-filled.
// (The 4-byte form of cp_async_16 in ptx/cp_async.cuh; .ca: only 4 and 8 byte copies may not bypass L1.)
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// One stage's scales (the tile is 128 rows high).
struct StageScales {
  float a[128];  // sa of the tile's rows; 0 for rows past the tile's valid rows
  float b;       // sb of the tile's weight block
  float pad[3];  // 16-byte multiple
};

inline constexpr int kScaleWarpLanes = 32;  // full-barrier arrivals of the scale warp per stage

// Where the scales come from. sa: [rows, k_blocks] fp32 row-major (rows of all groups, contiguous);
// sb: [groups, n_blocks, k_blocks] fp32 row-major.
struct BlockScaleSources {
  const float* sa;
  const float* sb;
  int k_blocks;  // K / 128
  int n_blocks;  // ceil(N / 128)
};

// The producer warp's copies for K block kb of `tile` (n_block = tile.n_idx: the tile is 128 columns wide),
// then this lane's arrival on the stage's full barrier. lane: 0..31 of the scale warp.
template <int kStages>
__device__ __forceinline__ void load_block_scales(const StagePipeline<kStages>& pipe, const PipeState<kStages>& st,
                                                  StageScales* slot, const BlockScaleSources& src,
                                                  const TileCoord& tile, int kb, int lane) {
  const uint32_t dst = smem_addr(slot);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = lane + 32 * i;
    const bool valid = r < tile.rows;
    const float* from = valid ? src.sa + (static_cast<int64_t>(tile.row0) + r) * src.k_blocks + kb : src.sa;
    cp_async_4(dst + 4 * r, from, valid);
  }
  if (lane == 0) {
    const int64_t block = static_cast<int64_t>(tile.e) * src.n_blocks + tile.n_idx;
    cp_async_4(dst + 4 * 128, src.sb + block * src.k_blocks + kb, true);
  }
  pipe.producer_commit_copies(st);
}

}  // namespace megamoe::device
