// The fused forward: one persistent launch per rank that numbers the tokens, dispatches them, routes the rows
// it receives, runs GEMM1 + SwiGLU and GEMM2 on them, stores every result row home and combines its own
// tokens, with the communication overlapped with the tensor-core work. It composes the layer's device code
// (ep_layout.cuh, ep_dispatch.cuh, ep_route_rows.cuh, ep_combine.cuh, comm/rank_barrier.cuh) and the
// engine's parts (TileLoader, mma_tile, the SwiGLU and plain epilogues through BoxStore), and leaves the
// workspace exactly as the modular forward does, so the backward runs on either.
//
// One CTA of 384 threads per SM of the rank's share, all resident. Phases (grid: GridBarrier):
//   1. layout_count, grid barrier, layout_assign: counts to every receiver, each signalled (counts_arrived).
//   2. dispatch role (every CTA): every token once per destination rank; then per destination one
//      release of how many token rows went there (rows_arrived[src] on the receiver).
//   3. every CTA: waits for the counts of all R sources, derives the expert-major offsets and row blocks
//      (route_offsets) and numbers the GEMM work (ExpertWaves: GEMM1 of expert e, then GEMM2 of e - 1, ...).
//   4. route role (every CTA): per source, as soon as its token rows have all landed, the tables
//      of its rows (row_src, row_weight, row_dest, row_dot_dest, and row_signal: the token's counter on the
//      source), each row adding 1 to its 128-row block's rows_ready.
//   5. GEMM roles (every CTA, taking items in increasing order from a shared counter): producer warpgroup
//      (gathered x rows for GEMM1 once their block is routed, TMA loads of a for GEMM2 once every GEMM1 slice
//      of the block has stored it), two consumer warpgroups (wgmma; GEMM1: SwiGLU epilogue storing a and h,
//      then act_ready[block] += 1 per slice; GEMM2: y rows straight into their combine slots on the source
//      ranks, then per row token_done += 1 on the source; both hand-overs while the next item's first
//      wgmma run).
//   6. combine (every CTA): a token once all its slots x GEMM2 n-tiles have come home, in slot order.
//   7. counters back to 0, the rank barrier, NaN outputs if any rank recorded an error.
// Every wait is bounded and reported with what it waited for (FusedWait); the kernel never waits on the host.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"
#include "comm/rank_barrier.cuh"
#include "device/comm/grid_barrier.cuh"
#include "device/comm/signal.cuh"
#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/gemm/mainloop.cuh"
#include "device/gemm/operands.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/tma.cuh"
#include "device/sched/expert_waves.cuh"
#include "device/sched/schedulers.cuh"
#include "device/shared_storage.cuh"
#include "kernels/ep_combine.cuh"
#include "kernels/ep_dispatch.cuh"
#include "kernels/ep_layout.cuh"
#include "kernels/ep_route_rows.cuh"
#include "kernels/fused_forward.hpp"
#include "kernels/fused_items.cuh"
#include "kernels/fused_roles.cuh"

namespace megamoe::kernels {

// Everything the kernel reads, by value.
struct FusedForwardParams {
  ep::Params layer;
  const __nv_bfloat16* x;
  const void* topk_idx;  // int64 or int32, as the kernel's Index
  const float* topk_weights;
  __nv_bfloat16* out;
  int layout_blocks;  // CTAs [0, layout_blocks) number the tokens
  int wave_lag;       // ExpertWaves::lag
  int n_tiles[2];     // GEMM1 (over 2I), GEMM2 (over H)
  int k_tiles[2];     // 64-deep stages: GEMM1 over H, GEMM2 over I
  device::OperandSources gemm1_src;  // A: x rows gathered from recv_x through row_src; B: W13 gate/up panels
  device::OperandSources gemm2_src;  // B: W2 panels (A, a, through TMA)
  device::EpilogueArgs gemm1_epi;    // C = a, aux = h
  device::EpilogueArgs gemm2_epi;    // C = y rows through row_dest
  uint64_t* timeline;                // optional, diagnostics: kFusedTimelineStamps per CTA (ep::FusedStamp)
};


using FusedForwardConfig = FusedGemmConfig<device::GemmForm::kNT>;

// ---------------------------------------------------------------- roles

// Phase 4: the rows of every source, source by source (this rank's own first: they land first), each as
// soon as all its token rows have landed (source_rows_landed: every source's arrivals are waited for, also
// when this rank routes nothing because its capacity overflowed, `route` false). A route out of range that a
// peer wrote (its row would never be ready) breaks the group.
__device__ inline void route_role(const FusedForwardParams& p, const ep::RouteTables& t, bool route, int cta,
                                  int* shared) {
  const ep::Params& L = p.layer;
  const ep::Shape& s = L.shape;
  uint32_t* rows_ready = ep::at<uint32_t>(L.local, L.layout.rows_ready);
  for (int i = 0; i < s.num_ranks; ++i) {
    const int src = (s.rank + i) % s.num_ranks;
    const int32_t tokens = source_rows_landed(L, src, cta == 0, shared);
    if (tokens < 0 || !route) continue;
    bool ok = true;
    for (int64_t slot = static_cast<int64_t>(cta) * kFusedThreads + threadIdx.x; slot < tokens;
         slot += static_cast<int64_t>(gridDim.x) * kFusedThreads) {
      ok &= ep::route_item(L, t, static_cast<int64_t>(src) * s.max_tokens + slot,
                           [&](int64_t row, int e, int64_t, int) {
                             // Release: the row's tables (and, through this CTA's acquire above, its landed x
                             // row) before the count.
                             device::signal_add<device::Scope::kGpu>(
                                 rows_ready + t.block_start[e] + (row - t.offsets[e]) / 128, 1u);
                           });
    }
    if (__syncthreads_or(!ok) && threadIdx.x == 0) ep::break_group(L, ep::kErrorPeerIndex, src, 0);
  }
}

// Phase 5, producer warpgroup (ptid 0..127): the stages of every item this CTA draws.
template <class Cfg>
__device__ void gemm_producer(const CUtensorMap* tm_w13, const CUtensorMap* tm_a_load, const CUtensorMap* tm_w2,
                              const FusedForwardParams& p, typename Cfg::SharedStorage& smem,
                              const typename Cfg::Waves& waves, const typename Cfg::Schedule& schedule, int ptid) {
  using Shape = typename Cfg::Shape;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  typename Cfg::GatherLoader gemm1{nullptr, tm_w13, p.gemm1_src, {}};
  typename Cfg::TmaLoader gemm2{tm_a_load, tm_w2, p.gemm2_src, {}};
  device::PipeState<Shape::kStages> st;
  device::EpilogueStageRefill<Shape, false> no_epilogue_stages{nullptr};  // the forward's epilogues read no stage
  produce_items(p.layer, waves, schedule, 2u * static_cast<uint32_t>(p.n_tiles[0]), p.timeline,
                Cfg::kProducerBarrier, ptid, [&](const device::TileCoord& tile, int gemm) {
                  if (gemm == 0) {
                    gemm1.begin_tile(tile, ptid);
                    load_k_stages<false>(gemm1, pipe, st, smem.stages, no_epilogue_stages, tile, ptid);
                  } else {
                    load_k_stages<true>(gemm2, pipe, st, smem.stages, no_epilogue_stages, tile, ptid);
                  }
                });
}

// Phase 5, consumer warpgroups (tid 128..383): main loop and epilogue of every item this CTA draws.
template <class Cfg>
__device__ void gemm_consumer(const CUtensorMap* tm_a_store, const CUtensorMap* tm_h_store,
                              const FusedForwardParams& p, typename Cfg::SharedStorage& smem,
                              const typename Cfg::Waves& waves, const typename Cfg::Schedule& schedule, int tid) {
  using Shape = typename Cfg::Shape;
  constexpr int kBN = Shape::kBN;
  const ep::Params& L = p.layer;
  const int cwg = tid / 128 - 1;  // rows 64 cwg .. 64 cwg + 63 of the tile
  const int ctid = tid - 128;
  const int lt = tid & 127;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  device::BoxStore<Cfg::kSlots, true> store(smem.staging[cwg][0], &smem.slice_rows[cwg], 2 + cwg, lt);
  device::PipeState<Shape::kStages> st;
  PendingHandover pending{&smem.pending[cwg]};
  const auto handover = [&] { pending.run(L, lt); };
  float acc[kBN / 2];
  for (int j = 0;; ++j) {
    const int t = schedule.read(j);
    if (t >= waves.total_now()) break;
    int gemm = 0;
    const device::TileCoord tile = waves.decode(t, &gemm);
    const device::SliceCoord s{tile.row0 + cwg * 64, tile.rows - cwg * 64, tile.n_idx * kBN, tile.n_idx,
                               lt, lt >> 5, lt & 31};
    if (gemm == 0) {
      device::mma_tile<Shape, true>(acc, pipe, st, smem.stages[0], tile, cwg, ctid, lt, 0, handover);
      // a and h are contiguous: whole slices leave through TMA, a partial one through the threads.
      store.begin_tile(s.valid >= 64, p.gemm1_epi.c, p.gemm1_epi.aux, s.slice0, s.valid);
      device::epilogue_swiglu<kBN>(acc, p.gemm1_epi, s, tm_a_store, tm_h_store, store);
      // a, for GEMM2
      pending.defer(store, ep::at<uint32_t>(L.local, L.layout.act_ready) + tile.m_block, nullptr, lt);
    } else {
      device::mma_tile<Shape, false>(acc, pipe, st, smem.stages[0], tile, cwg, ctid, lt, 0, handover);
      store.begin_tile(false, p.gemm2_epi.c, p.gemm2_epi.aux, s.slice0, s.valid);
      device::epilogue_plain<kBN>(acc, p.gemm2_epi, s, nullptr, store);
      pending.defer(store, nullptr, &s, lt);  // the rows' y columns of this tile
    }
  }
  handover();
  store.finish();
}

// ---------------------------------------------------------------- the kernel

template <typename Index>
__global__ void __launch_bounds__(kFusedThreads, 1)
    fused_forward_kernel(const __grid_constant__ CUtensorMap tm_w13, const __grid_constant__ CUtensorMap tm_a_load,
                         const __grid_constant__ CUtensorMap tm_w2, const __grid_constant__ CUtensorMap tm_a_store,
                         const __grid_constant__ CUtensorMap tm_h_store, const FusedForwardParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Cfg = FusedForwardConfig;
  auto& smem = device::shared_storage<Cfg::SharedStorage>();
  const ep::Params& L = p.layer;
  const ep::Shape& s = L.shape;
  const int tid = threadIdx.x;
  const int cta = blockIdx.x;
  const Index* idx = static_cast<const Index*>(p.topk_idx);
  const auto nan_out = [&] { fill_nan(p.out, L.num_tokens * s.hidden); };
  if (fused_kernel_refused(L, ep::kBarrierCombined, nan_out)) return;
  FusedGrid grid = FusedGrid::of(L);
  stamp(p.timeline, ep::kStampStart);
  const typename Cfg::Schedule schedule{&smem.schedule, ep::at<int>(L.local, L.layout.fused_work)};
  init_gemm_rings<Cfg>(smem, schedule);

  // 1. layout
  if (cta < p.layout_blocks) ep::layout_count<kFusedWarps>(L, idx, cta, p.layout_blocks, smem.scratch);
  grid.sync(L);
  if (cta < p.layout_blocks) ep::layout_assign<kFusedWarps>(L, idx, cta, p.layout_blocks, smem.scratch, true);
  grid.sync(L);
  stamp(p.timeline, ep::kStampLayout);

  // 2. dispatch
  dispatch_role(L, p.x, L.layout.recv_x, idx, p.topk_weights, smem.sent);
  stamp(p.timeline, ep::kStampDispatch);

  // 3. every source's counts -> offsets, row blocks, the GEMM work
  (void)cta_wait(L, ep::at<uint32_t>(L.local, L.layout.counts_arrived), static_cast<uint32_t>(s.num_ranks),
                 ep::fused_wait_id(ep::kWaitCounts, s.rank), GiveUp::kWhenBroken, smem.flags);
  const ep::RouteTables tables = ep::RouteTables::in(smem.scratch, s);
  // A count out of range that a peer wrote breaks the group (its rows can never be counted as ready).
  if (!ep::route_offsets(L, tables, cta == 0, cta == 0) && cta == 0 && tid == 0)
    ep::break_group(L, ep::kErrorPeerIndex, -1, 0, ep::kPeerCount);
  const typename Cfg::Waves waves{&smem.waves};
  waves.build(tables.offsets, s.experts_per_rank, p.n_tiles[0], p.n_tiles[1], p.k_tiles[0], p.k_tiles[1], p.wave_lag,
              tid, kFusedThreads);
  stamp(p.timeline, ep::kStampCounts);

  // 4. route
  route_role(p, tables, !tables.overflow(s), cta, smem.flags);
  stamp(p.timeline, ep::kStampRouted);

  // 5. GEMMs
  run_gemm_phase<Cfg>(
      [&](int ptid) { gemm_producer<Cfg>(&tm_w13, &tm_a_load, &tm_w2, p, smem, waves, schedule, ptid); },
      [&](int thread) { gemm_consumer<Cfg>(&tm_a_store, &tm_h_store, p, smem, waves, schedule, thread); });
  stamp(p.timeline, ep::kStampGemms);

  // 6. combine
  combine_role<true>(L, p.n_tiles[1], p.topk_weights, p.out, nullptr);
  stamp(p.timeline, ep::kStampCombined);

  // 7. clean up, meet the peers, NaN on failure
  fused_kernel_end(L, grid, ep::kBarrierCombined, p.timeline, nan_out);
#endif
}

}  // namespace megamoe::kernels
