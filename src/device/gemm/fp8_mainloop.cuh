// The consumer side of a blockwise-scaled FP8 main loop: one warpgroup's 64 x BN accumulators of a work item,
// one 128-deep K block per pipeline stage.
//
// Stage geometry: both operands e4m3 and K-major, one K block = 128 e4m3 = 128 bytes per row = one span of
// the 128-byte swizzle. In bytes this is exactly the stage of the bf16 engine (MainloopShape of form kNT: a
// row of 64 bf16 = 128 bytes, A 128 rows then B BN rows), so the same shape, TMA boxes (tensor maps over the
// e4m3 bytes viewed as bf16 pairs) and descriptors serve; the next k32 slice of e4m3 is 32 bytes on, like
// the next k16 slice of bf16.
//
// Per K block: wgmma.m64nBNk32 x 4 into one of two temporary accumulators (`partial`, the first wgmma
// overwrites it), commit, read the stage's A scales while the tensor cores run; then wait until only this
// block's group is in flight, release the previous block's stage and promote the previous block
// (fp8_promotion.cuh): acc += partial * sa * sb in fp32 registers. So the tensor cores sum block k while the
// threads promote block k - 1, instead of idling through every promotion (three accumulators of BN / 2
// registers per thread). Blocks are promoted in K order, so the result is that of one accumulator. The weight
// block's scale of the next K block is loaded from global memory (block_scales.cuh) one block ahead, so its
// latency hides behind a whole block's wgmma.
#pragma once

#include <cstdint>

#include "device/gemm/block_scales.cuh"
#include "device/gemm/fp8_promotion.cuh"
#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/wgmma.cuh"
#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

// acc = sum over the tile's K blocks of scale * (the block's wgmma sum). cwg: consumer warpgroup (rows
// 64 cwg .. 64 cwg + 63 of the tile); lt: thread in the warpgroup; scales: the ring's A-scale slots;
// b_scales: the tile's weight-block scales, one per K block (WeightScales::of).
// One K block of mma_tile_fp8_blockwise: its wgmma into `partial`, then (kt > 0) the promotion of the previous
// block from `previous_partial` once its group has completed.
template <class Shape>
struct Fp8BlockStep {
  static constexpr int kN = Shape::kBN / 2;
  const StagePipeline<Shape::kStages>& pipe;
  PipeState<Shape::kStages>& st;
  uint8_t* stages;
  const StageScales* scales;
  const float* b_scales;
  const TileCoord& tile;
  int cwg, lt, warp, lane, k_tiles;
  PipeState<Shape::kStages> previous;  // the stage of the block not yet promoted
  float previous_scale[2];              // and its row scales
  float b_next;

  __device__ __forceinline__ void run(int kt, float (&acc)[kN], float (&partial)[kN], float (&previous_partial)[kN]) {
    using Mma = WgmmaE4m3<Shape::kBN>;
    const float b_scale = b_next;
    if (kt + 1 < k_tiles) b_next = __ldg(b_scales + kt + 1);
    pipe.consumer_wait(st);
    const uint32_t sa = smem_addr(stages + st.index * Shape::kStageBytes);
    const uint32_t sb = sa + Shape::kABytes;
    const uint32_t a_base = sa + cwg * kBoxBytes;  // rows 64 cwg .. of the tile (64 rows x 128 bytes)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t da = make_smem_desc(a_base + kk * Shape::kAStep, Shape::kALbo, 1024);
      const uint64_t db = make_smem_desc(sb + kk * Shape::kBStep, Shape::kBLbo, 1024);
      Mma::mma(partial, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    const float* a_scales = tile_scales(scales[st.index], tile.row0);
    const float scale[2] = {promotion_scale(a_scales, b_scale, cwg, warp, lane, 0),
                            promotion_scale(a_scales, b_scale, cwg, warp, lane, 1)};
    if (kt > 0) {
      wgmma_wait<1>();
      fence_accumulators(previous_partial);
      pipe.template consumer_release<1>(previous, lt, 0);
      promote_block(acc, previous_partial, previous_scale);
    }
    previous = st;
    previous_scale[0] = scale[0];
    previous_scale[1] = scale[1];
    st.advance();
  }

  // After the last block: its promotion.
  __device__ __forceinline__ void finish(float (&acc)[kN], float (&last_partial)[kN]) {
    wgmma_wait<0>();
    fence_accumulators(last_partial);
    pipe.template consumer_release<1>(previous, lt, 0);
    promote_block(acc, last_partial, previous_scale);
  }
};

// acc = sum over the tile's K blocks of scale * (the block's wgmma sum). cwg: consumer warpgroup (rows
// 64 cwg .. 64 cwg + 63 of the tile); lt: thread in the warpgroup; scales: the ring's A-scale slots;
// b_scales: the tile's weight-block scales, one per K block (WeightScales::of).
template <class Shape>
__device__ __forceinline__ void mma_tile_fp8_blockwise(float (&acc)[Shape::kBN / 2],
                                                       const StagePipeline<Shape::kStages>& pipe,
                                                       PipeState<Shape::kStages>& st, uint8_t* stages,
                                                       const StageScales* scales, const float* b_scales,
                                                       const TileCoord& tile, int cwg, int lt) {
  static_assert(Shape::kForm == GemmForm::kNT && Shape::kCluster == 1, "FP8 operands are both K-major, single CTAs");
  static_assert(Shape::kBN == 128, "a tile column block is one 128-wide weight-scale block");
  static_assert(Shape::kBK * 2 == 128 && Shape::kAStep == 32 && Shape::kBStep == 32, "a stage row is one K block");
  constexpr int kN = Shape::kBN / 2;
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i] = 0.0f;
  // Overwritten by each block's first wgmma; zeroed so that they are never read undefined.
  float partial0[kN], partial1[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    partial0[i] = 0.0f;
    partial1[i] = 0.0f;
  }
  const int k_tiles = max(tile.k_tiles, 0);
  if (k_tiles == 0) return;
  Fp8BlockStep<Shape> step{pipe, st, stages, scales, b_scales, tile, cwg, lt, lt >> 5, lt & 31, k_tiles,
                           st, {0.0f, 0.0f}, __ldg(b_scales)};
  // Blocks alternate between the two temporaries (unrolled by two so that each is a fixed register set).
  for (int kt = 0; kt < k_tiles; kt += 2) {
    step.run(kt, acc, partial0, partial1);
    if (kt + 1 < k_tiles) step.run(kt + 1, acc, partial1, partial0);
  }
  if ((k_tiles - 1) % 2 == 0) {
    step.finish(acc, partial0);
  } else {
    step.finish(acc, partial1);
  }
}

}  // namespace megamoe::device
