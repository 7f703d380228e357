// The consumer side of the main loop: one warpgroup's 64 x BN accumulators of a work item, summed over its
// K stages with wgmma (4 k16 steps per 64-deep stage), keeping one wgmma group in flight and releasing
// each stage as soon as the group that read it has completed.
#pragma once

#include <cstdint>

#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/wgmma.cuh"
#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

// In the K-grouped form the last stage of an expert reaches into the next expert's rows (or past the
// buffer): rows [valid, 64) of every A and B box of the stage are zeroed (whole 128-byte rows, so the
// swizzle does not matter) and handed to the async proxy before any wgmma reads the stage, so neither
// finite nor non-finite values of other experts leak in. Both consumer warpgroups share the work.
template <class Shape>
__device__ __forceinline__ void zero_foreign_rows(uint8_t* stage, int valid, int ctid) {
  constexpr int kThreads = 128 * Shape::kConsumerGroups;
  const int units_per_box = (Shape::kBK - valid) * 8;  // 16-byte units
  const int total_units = units_per_box * ((Shape::kBM + Shape::kBN) / 64);
  for (int u = ctid; u < total_units; u += kThreads) {
    const int c = u / units_per_box;
    const int o = u - c * units_per_box;
    *reinterpret_cast<uint4*>(stage + c * kBoxBytes + valid * 128 + o * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async_smem();
  named_barrier_sync(1, kThreads);
}

// No work beside the main loop.
struct NoSideWork {
  __device__ __forceinline__ void operator()() const {}
};

// acc = sum over the tile's K stages. cwg: consumer warpgroup (rows 64 cwg .. 64 cwg + 63 of the tile);
// ctid: thread among all consumer threads; lt: thread in the warpgroup. kGathered: some operand of the
// stage landed through cp.async (the generic proxy), so the reads of wgmma (the async proxy) are ordered
// after it by a proxy fence once the stage is full.
// side_work: the calling thread's own work that must not wait for this tile's data (it may be what the
// producer waits for before it loads): done while the first stage's wgmma run, or before the first wait
// if that stage has not landed yet, or at the end if the tile has no stage. It may be called more than
// once and must do its work once.
template <class Shape, bool kGathered, class SideWork = NoSideWork>
__device__ __forceinline__ void mma_tile(float (&acc)[Shape::kBN / 2], const StagePipeline<Shape::kStages>& pipe,
                                         PipeState<Shape::kStages>& st, uint8_t* stages, const TileCoord& tile,
                                         int cwg, int ctid, int lt, uint32_t cta_rank,
                                         SideWork&& side_work = SideWork{}) {
  using Mma = WgmmaBf16<Shape::kBN>;
#pragma unroll
  for (int i = 0; i < Shape::kBN / 2; ++i) acc[i] = 0.0f;
  const int k_tiles = max(tile.k_tiles, 0);
  PipeState<Shape::kStages> previous = st;
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (kt == 0 && !pipe.consumer_ready(st)) side_work();
    pipe.consumer_wait(st);
    if constexpr (kGathered) fence_proxy_async_smem();
    uint8_t* stage = stages + st.index * Shape::kStageBytes;
    if constexpr (Shape::kKGrouped) {
      const int valid = tile.rows - kt * Shape::kBK;
      if (valid < Shape::kBK) zero_foreign_rows<Shape>(stage, valid, ctid);
    }
    const uint32_t sa = smem_addr(stage);
    const uint32_t sb = sa + Shape::kABytes;
    wgmma_fence();
    const uint32_t a_base = sa + cwg * kBoxBytes;  // K-major: rows 64 cwg..; MN-major: box cwg
    const uint64_t da0 = make_smem_desc(a_base, Shape::kALbo, 1024);
    const uint64_t db0 = make_smem_desc(sb, Shape::kBLbo, 1024);
#pragma unroll
    for (int kk = 0; kk < Shape::kBK / 16; ++kk) {
      Mma::template mma<Shape::kTransA, Shape::kTransB>(acc, advance_smem_desc(da0, kk * Shape::kAStep),
                                                        advance_smem_desc(db0, kk * Shape::kBStep), 1);
    }
    wgmma_commit();
    if (kt == 0) side_work();
    wgmma_wait<1>();
    if (kt > 0) pipe.template consumer_release<Shape::kCluster>(previous, lt, cta_rank);
    previous = st;
    st.advance();
  }
  if (k_tiles == 0) side_work();
  wgmma_wait<0>();
  if (k_tiles > 0) pipe.template consumer_release<Shape::kCluster>(previous, lt, cta_rank);
  fence_accumulators(acc);
}

}  // namespace megamoe::device
