// The consumer side of a blockwise-scaled FP8 main loop: one warpgroup's 64 x BN accumulators of a work item,
// one 128-deep K block per pipeline stage.
//
// Stage geometry: both operands e4m3 and K-major, one K block = 128 e4m3 = 128 bytes per row = one span of
// the 128-byte swizzle. In bytes this is exactly the stage of the bf16 engine (MainloopShape of form kNT: a
// row of 64 bf16 = 128 bytes, A 128 rows then B BN rows), so the same shape, TMA boxes (tensor maps over the
// e4m3 bytes viewed as bf16 pairs) and descriptors serve; the next k32 slice of e4m3 is 32 bytes on, like
// the next k16 slice of bf16.
//
// Per K block: wgmma.m64nBNk32 x 4 into `partial` (the first overwrites it), commit; while the tensor cores
// run, read the stage's A scales, wait for the next block's stage and load its weight block's scale from
// global memory (block_scales.cuh), so that nothing but the promotion stands between one block's wgmma and
// the next one's; wait for the group, release the stage, then promote (fp8_promotion.cuh):
// acc += partial * sa * sb in fp32 registers. Two accumulators of BN / 2 registers each per thread. The loop
// walks the ring with each stage's index a constant (for_each_ring_stage, ring_state.hpp): the descriptors are
// then constant offsets from the ring's base, which ptxas keeps in uniform registers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device/gemm/block_scales.cuh"
#include "device/gemm/fp8_promotion.cuh"
#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/wgmma.cuh"
#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

// A tile's accumulator and the per-block partial, both zero before the first K block.
template <int kN>
__device__ __forceinline__ void zero_fp8_accumulators(float (&acc)[kN], float (&partial)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    acc[i] = 0.0f;
    partial[i] = 0.0f;
  }
}

// One K block of a warpgroup's FP8 tile: wgmma.m64nBNk32 x 4 on stage `stage` into `partial` (the first
// overwrites it), committed as one group; the caller waits for it. A run-time stage is for loops with wgmma in
// flight across their branches (ptxas serialises those across for_each_ring_stage's switch).
template <class Shape>
__device__ __forceinline__ void issue_fp8_block_on(float (&partial)[Shape::kBN / 2], uint8_t* stages, int stage,
                                                   int cwg) {
  static_assert(Shape::kForm == GemmForm::kNT, "FP8 operands are both K-major");
  static_assert(Shape::kBK * 2 == 128 && Shape::kAStep == 32 && Shape::kBStep == 32, "a stage row is one K block");
  const uint32_t sa = smem_addr(stages) + stage * Shape::kStageBytes;
  const uint64_t da0 = make_smem_desc(sa + cwg * kBoxBytes, Shape::kALbo, 1024);  // rows 64 cwg .. of the tile
  const uint64_t db0 = make_smem_desc(sa + Shape::kABytes, Shape::kBLbo, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    WgmmaE4m3<Shape::kBN>::mma(partial, advance_smem_desc(da0, kk * Shape::kAStep),
                               advance_smem_desc(db0, kk * Shape::kBStep), kk > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// The same on a constant stage: its descriptors are constant offsets from the ring's base, which ptxas builds
// in uniform registers.
template <class Shape, int kIndex>
__device__ __forceinline__ void issue_fp8_block_at(float (&partial)[Shape::kBN / 2], uint8_t* stages, int cwg) {
  issue_fp8_block_on<Shape>(partial, stages, kIndex, cwg);
}

// acc = sum over the tile's K blocks of scale * (the block's wgmma sum). cwg: consumer warpgroup (rows
// 64 cwg .. 64 cwg + 63 of the tile); lt: thread in the warpgroup; scales: the ring's A-scale slots;
// b_scales: the tile's weight-block scales, one per K block (WeightScales::of); cta_rank: the CTA in its
// cluster (a 2-CTA cluster's peer multicasts half of every stage, and is released too). kGathered: A's rows
// and their scales landed through the producer threads' cp.async (the generic proxy): the wgmma reads are
// fenced after the wait.
// Every consumer thread reads the stage's A scales with plain loads after its warp's wgmma were issued, so a
// warp that lags its warpgroup may not have read them when another warp's wgmma wait returns: each warp
// releases the stage for its own lanes (StagePipeline::consumer_release_warp), and with gathered rows, whose
// refill is the producer threads' plain cp.async writes, each thread for its own reads
// (consumer_release_own, the form racecheck follows). Per-thread release on the TMA path cost about 5% on
// the large grouped shapes (docs/PERF.md run 39). In a 2-CTA cluster one thread per warpgroup also releases
// the peer's copy, whose multicast B half it read through wgmma only.
// Arrivals on a stage's empty barrier under mma_tile_fp8_blockwise: every consumer warp of the CTA (every
// consumer thread when gathered), and one per consumer warpgroup of the cluster peer.
template <class Shape, bool kGathered>
inline constexpr int kFp8EmptyArrivals =
    (kGathered ? 128 : 4) * Shape::kConsumerGroups + (Shape::kCluster > 1 ? Shape::kConsumerGroups : 0);

// A consumer warpgroup's release of a stage it has read (the arrivals kFp8EmptyArrivals counts): each warp for
// its lanes, or with gathered rows each thread for its own reads; in a 2-CTA cluster one thread also for the
// peer's copy.
template <class Shape, bool kGathered>
__device__ __forceinline__ void release_fp8_stage(const StagePipeline<Shape::kStages>& pipe,
                                                  const PipeState<Shape::kStages>& done, int lt, uint32_t cta_rank) {
  if constexpr (kGathered) {
    pipe.consumer_release_own(done);
  } else {
    pipe.consumer_release_warp(done, lt & 31);
  }
  if constexpr (Shape::kCluster > 1) {
    static_assert(!kGathered, "gathered operands are not multicast");
    if (lt == 0) mbarrier_arrive_cluster_peer(&pipe.empty[done.index], cta_rank ^ 1);
  }
}

// kGateUp: the tile's weight panel is a gate half and an up half from two weight blocks (GEMM1 of the FP8
// layer with its SwiGLU epilogue); up_b_scales are the up block's scales, one per K block, and each half is
// promoted with its own (promote_block_gate_up). Otherwise up_b_scales is not read.
template <class Shape, bool kGathered = false, bool kGateUp = false>
__device__ __forceinline__ void mma_tile_fp8_blockwise(float (&acc)[Shape::kBN / 2],
                                                       const StagePipeline<Shape::kStages>& pipe,
                                                       PipeState<Shape::kStages>& st, uint8_t* stages,
                                                       const StageScales* scales, const float* b_scales,
                                                       const TileCoord& tile, int cwg, int lt, uint32_t cta_rank,
                                                       const float* up_b_scales = nullptr) {
  static_assert(Shape::kBN == 128, "a tile column block is one 128-wide weight-scale block");
  constexpr int kN = Shape::kBN / 2;
  const int warp = lt >> 5, lane = lt & 31;
  float partial[kN];  // overwritten by each block's first wgmma; zeroed so that it is never read undefined
  zero_fp8_accumulators(acc, partial);
  const int k_tiles = tile.k_tiles;
  if (k_tiles <= 0) return;
  const float* next_b_scale = b_scales + 1;
  float b_scale = __ldg(b_scales);
  const float* next_up_scale = kGateUp ? up_b_scales + 1 : nullptr;
  float up_scale = kGateUp ? __ldg(up_b_scales) : 0.0f;
  pipe.consumer_wait(st);
  for_each_ring_stage(st, k_tiles, [&](auto stage, uint32_t phase, bool last) {
    constexpr int s = decltype(stage)::value;
    const PipeState<Shape::kStages> here{s, phase};
    if constexpr (kGathered) fence_proxy_async_smem();
    issue_fp8_block_at<Shape, s>(partial, stages, cwg);
    const float* a_scales = tile_scales(scales[s], tile.row0);
    float scale[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      scale[0][h] = promotion_scale(a_scales, b_scale, cwg, warp, lane, h);
      if constexpr (kGateUp) scale[1][h] = promotion_scale(a_scales, up_scale, cwg, warp, lane, h);
    }
    // While the tensor cores run: the next block's stage and weight scale, so that after the promotion the
    // next wgmma can be issued at once.
    if (!last) {
      PipeState<Shape::kStages> next = here;
      next.advance();
      pipe.consumer_wait(next);
      b_scale = __ldg(next_b_scale++);
      if constexpr (kGateUp) up_scale = __ldg(next_up_scale++);
    }
    wgmma_wait<0>();
    fence_accumulators(partial);
    release_fp8_stage<Shape, kGathered>(pipe, here, lt, cta_rank);
    if constexpr (kGateUp) {
      promote_block_gate_up(acc, partial, scale);
    } else {
      promote_block(acc, partial, scale[0]);
    }
  });
}

// The overlapped loops' parts. Both partial sums zeroed with acc and pinned before the tile's first wgmma
// (a zeroing that ptxas schedules after it makes it wait for that wgmma).
template <int kN>
__device__ __forceinline__ void zero_overlapped_accumulators(float (&acc)[kN], float (&partial)[2][kN]) {
  zero_fp8_accumulators(acc, partial[0]);
#pragma unroll
  for (int i = 0; i < kN; ++i) partial[1][i] = 0.0f;
  fence_accumulators(partial[0]);
  fence_accumulators(partial[1]);
}

// The overlapped order over a tile's k_tiles (>= 1) blocks: issue(buffer) issues the block of stage st into
// partial[buffer], finish(buffer, stage) promotes the completed block in partial[buffer] and releases its
// stage. Block k is issued before block k - 1 is finished (wgmma_wait<1>). The blocks go in pairs (k into
// buffer 1, k + 1 into buffer 0) so that each buffer is a constant, and the last one or two are finished
// after the loop: no control flow merges while a wgmma is in flight (ptxas would serialise them).
template <int kStages, class Issue, class Finish>
__device__ __forceinline__ void run_overlapped_blocks(PipeState<kStages>& st, int k_tiles, Issue&& issue,
                                                      Finish&& finish) {
  using Zero = std::integral_constant<int, 0>;
  using One = std::integral_constant<int, 1>;
  PipeState<kStages> previous = st;
  issue(Zero{});
  st.advance();
  // The next block into buffer `into`, then the previous one (in `out`) finished once its group completed.
  const auto step = [&](auto into, auto out) {
    const PipeState<kStages> issued = st;
    issue(into);
    st.advance();
    wgmma_wait<1>();
    finish(out, previous);
    previous = issued;
  };
  int kt = 1;
  for (; kt + 1 < k_tiles; kt += 2) {
    step(One{}, Zero{});
    step(Zero{}, One{});
  }
  if (kt < k_tiles) {  // an even number of blocks: the last one into buffer 1
    step(One{}, Zero{});
    wgmma_wait<0>();
    finish(One{}, previous);
  } else {
    wgmma_wait<0>();
    finish(Zero{}, previous);
  }
}

// The same sums with each block's promotion overlapped with the next block's wgmma (Fp8GemmTuning's
// overlap_promotion): two partial accumulators, block k issued before block k - 1 is promoted
// (run_overlapped_blocks), so that the warpgroup's own wgmma keep the tensor cores busy while it promotes;
// in mma_tile_fp8_blockwise both warpgroups promote while the tensor cores idle (docs/GEMM.md). The blocks are
// promoted in the same order with the same scales: bitwise the result of mma_tile_fp8_blockwise. It holds 64
// more registers per thread (the kernel's consumers get 232). ptxas keeps the wgmma unserialised only when it
// sees the loop as uniform: the trip count is shuffled from lane 0 here, and the kernel's role branch is on
// a shuffled warpgroup index.
template <class Shape, bool kGathered = false, bool kGateUp = false>
__device__ __forceinline__ void mma_tile_fp8_blockwise_overlapped(float (&acc)[Shape::kBN / 2],
                                                                  const StagePipeline<Shape::kStages>& pipe,
                                                                  PipeState<Shape::kStages>& st, uint8_t* stages,
                                                                  const StageScales* scales, const float* b_scales,
                                                                  const TileCoord& tile, int cwg, int lt,
                                                                  uint32_t cta_rank,
                                                                  const float* up_b_scales = nullptr) {
  static_assert(Shape::kBN == 128, "a tile column block is one 128-wide weight-scale block");
  constexpr int kN = Shape::kBN / 2;
  const int warp = lt >> 5, lane = lt & 31;
  float partial[2][kN];
  zero_overlapped_accumulators(acc, partial);
  const int k_tiles = __shfl_sync(0xffffffffu, tile.k_tiles, 0);
  if (k_tiles <= 0) return;
  const float* next_b_scale = b_scales;
  const float* next_up_scale = up_b_scales;
  float scale[2][2][2];  // [buffer][weight block: gate or the only one, up][row half]
  run_overlapped_blocks(
      st, k_tiles,
      [&](auto buffer) {
        constexpr int b = decltype(buffer)::value;
        pipe.consumer_wait(st);
        if constexpr (kGathered) fence_proxy_async_smem();
        issue_fp8_block_on<Shape>(partial[b], stages, st.index, cwg);
        const float b_scale = __ldg(next_b_scale++);
        const float* a_scales = tile_scales(scales[st.index], tile.row0);
        scale[b][0][0] = promotion_scale(a_scales, b_scale, cwg, warp, lane, 0);
        scale[b][0][1] = promotion_scale(a_scales, b_scale, cwg, warp, lane, 1);
        if constexpr (kGateUp) {
          const float up_scale = __ldg(next_up_scale++);
          scale[b][1][0] = promotion_scale(a_scales, up_scale, cwg, warp, lane, 0);
          scale[b][1][1] = promotion_scale(a_scales, up_scale, cwg, warp, lane, 1);
        }
      },
      [&](auto buffer, const PipeState<Shape::kStages>& done) {
        constexpr int b = decltype(buffer)::value;
        fence_accumulators(partial[b]);
        release_fp8_stage<Shape, kGathered>(pipe, done, lt, cta_rank);
        if constexpr (kGateUp) {
          promote_block_gate_up(acc, partial[b], scale[b]);
        } else {
          promote_block(acc, partial[b], scale[b][0]);
        }
      });
}

// The same loop with both operands scaled per row and K block (the weight gradients; block_scales.cuh's
// StageChannelScales): acc = sum over the tile's K blocks of (sa[m] sb[n]) * (the block's wgmma sum). The
// stage is released after the promotion, which reads the column scales from the stage's slot; every consumer
// warp releases for its lanes (the slots are refilled through TMA), and in a 2-CTA cluster one thread per
// warpgroup the peer's copy too (release_fp8_stage), so the empty barrier counts the consumer warps and the
// peer's consumer warpgroups (kFp8ChannelEmptyArrivals, which equals kFp8EmptyArrivals of the TMA path).
template <class Shape>
inline constexpr int kFp8ChannelEmptyArrivals = kFp8EmptyArrivals<Shape, false>;

template <class Shape>
__device__ __forceinline__ void mma_tile_fp8_channel_scaled(float (&acc)[Shape::kBN / 2],
                                                            const StagePipeline<Shape::kStages>& pipe,
                                                            PipeState<Shape::kStages>& st, uint8_t* stages,
                                                            const StageChannelScales<Shape::kBN>* scales,
                                                            int k_tiles, int cwg, int lt, uint32_t cta_rank) {
  static_assert(Shape::kBM == 128 && (Shape::kBN == 128 || Shape::kBN == 192), "128 x 128 or 128 x 192 tiles");
  constexpr int kN = Shape::kBN / 2;
  const int warp = lt >> 5, lane = lt & 31;
  float partial[kN];  // overwritten by each block's first wgmma; zeroed so that it is never read undefined
  zero_fp8_accumulators(acc, partial);
  if (k_tiles <= 0) return;
  pipe.consumer_wait(st);
  for_each_ring_stage(st, k_tiles, [&](auto stage, uint32_t phase, bool last) {
    constexpr int s = decltype(stage)::value;
    const PipeState<Shape::kStages> here{s, phase};
    issue_fp8_block_at<Shape, s>(partial, stages, cwg);
    const StageChannelScales<Shape::kBN>& slot = scales[s];
    const float row_scale[2] = {widen_channel_scale(slot.a[64 * cwg + Fragment::row(warp, lane, 0)]),
                                widen_channel_scale(slot.a[64 * cwg + Fragment::row(warp, lane, 1)])};
    // The next block's stage while the tensor cores run (as mma_tile_fp8_blockwise). The column scales are
    // read after the wait: read before it, with the scale products, the loop ran 8.5-20% slower (docs/PERF.md
    // run 112; their shared-memory reads contend with the wgmma's operand reads).
    if (!last) {
      PipeState<Shape::kStages> next = here;
      next.advance();
      pipe.consumer_wait(next);
    }
    wgmma_wait<0>();
    fence_accumulators(partial);
    promote_block_channels(acc, partial, row_scale, slot.b, lane);
    release_fp8_stage<Shape, false>(pipe, here, lt, cta_rank);
  });
}

// mma_tile_fp8_channel_scaled with each block's promotion overlapped with the next block's wgmma, as
// mma_tile_fp8_blockwise_overlapped (the same conditions for ptxas; the kernel's consumers get 232
// registers). A block's stage is released after its promotion, which reads the column scales from the
// stage's slot; its row scales are read when it is issued. Bitwise the result of mma_tile_fp8_channel_scaled.
template <class Shape>
__device__ __forceinline__ void mma_tile_fp8_channel_scaled_overlapped(float (&acc)[Shape::kBN / 2],
                                                                       const StagePipeline<Shape::kStages>& pipe,
                                                                       PipeState<Shape::kStages>& st,
                                                                       uint8_t* stages,
                                                                       const StageChannelScales<>* scales,
                                                                       int k_tiles_in, int cwg, int lt,
                                                                       uint32_t cta_rank) {
  static_assert(Shape::kBN == 128 && Shape::kBM == 128, "128 x 128 tiles");
  constexpr int kN = Shape::kBN / 2;
  const int warp = lt >> 5, lane = lt & 31;
  float partial[2][kN];
  zero_overlapped_accumulators(acc, partial);
  const int k_tiles = __shfl_sync(0xffffffffu, k_tiles_in, 0);
  if (k_tiles <= 0) return;
  float row_scale[2][2];
  run_overlapped_blocks(
      st, k_tiles,
      [&](auto buffer) {
        constexpr int b = decltype(buffer)::value;
        pipe.consumer_wait(st);
        issue_fp8_block_on<Shape>(partial[b], stages, st.index, cwg);
        const StageChannelScales<>& slot = scales[st.index];
        row_scale[b][0] = widen_channel_scale(slot.a[64 * cwg + Fragment::row(warp, lane, 0)]);
        row_scale[b][1] = widen_channel_scale(slot.a[64 * cwg + Fragment::row(warp, lane, 1)]);
      },
      [&](auto buffer, const PipeState<Shape::kStages>& done) {
        constexpr int b = decltype(buffer)::value;
        fence_accumulators(partial[b]);
        promote_block_channels(acc, partial[b], row_scale[b], scales[done.index].b, lane);
        release_fp8_stage<Shape, false>(pipe, done, lt, cta_rank);
      });
}

}  // namespace megamoe::device
