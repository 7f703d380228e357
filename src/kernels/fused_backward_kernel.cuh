// The fused backward's data path: one persistent launch per rank that dispatches d_out with the forward's
// routing, runs the two dgrad GEMMs on the rows it receives as they land, stores every d_x row home and
// combines its own tokens, with the communication overlapped with the tensor-core work. The weight gradients
// (K-grouped GEMMs over each expert's rows) follow as the engine's launches (ep_layer.cu). It composes the
// shared roles (fused_roles.cuh) with the engine's parts, and computes exactly what the modular backward's
// dgrad GEMMs and combine compute (the same tiles, the same epilogues, the same summation orders).
//
// One CTA of 384 threads per SM of the rank's share, all resident (a cooperative launch). Phases:
//   1. dispatch role (every CTA): every token's d_out once per destination rank (the forward's
//      slots), then per destination one release of how many rows went there (rows_arrived[src]).
//   2. every CTA: the expert-major offsets and row blocks from the counts the forward left (route_offsets)
//      and the GEMM work in waves of experts (ExpertWaves: dgrad1 of expert e, then dgrad2 of e - 1, ...).
//   3. arrival role (CTA src % CTAs for source src): once all of a source's d_out rows have landed,
//      its rows of every expert (a contiguous range per expert, from the forward's routing) count towards
//      their 128-row blocks' rows_ready.
//   4. GEMM roles (every CTA, items drawn in increasing order from a shared counter):
//      dgrad1: da = d_out W2 (d_out rows gathered from recv_dout, W2 N-major); the SwiGLU backward epilogue
//        (h streamed through the pipeline after the K stages, the outputs written over it) stores dh and
//        w * a (TMA), and each row's routing-gradient partial of the tile's columns into its slot on the
//        source; then act_ready[block] += 1 per 64-row slice, and per row token_done += 1 on the source (its
//        partial is home).
//      dgrad2: dx = dh W13 (dh through TMA once every dgrad1 slice of its block stored it, W13 N-major); each
//        row stored into its combine slot on the source, then token_done += 1 there.
//   5. combine (every CTA): a token once each routed slot has its dgrad1 partials and dgrad2 rows home:
//      d_x in slot order, d_topk_weights as each slot's partials in n-tile order.
//   6. counters back to 0, the rank barrier, NaN outputs if any rank recorded an error.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"
#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogue_stages.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/gemm/mainloop.cuh"
#include "device/gemm/operands.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/tma.cuh"
#include "device/sched/expert_waves.cuh"
#include "device/sched/schedulers.cuh"
#include "kernels/ep_route_rows.cuh"
#include "kernels/fused_items.cuh"
#include "kernels/fused_roles.cuh"

namespace megamoe::kernels {

// Everything the kernel reads, by value.
struct FusedBackwardParams {
  ep::Params layer;
  const __nv_bfloat16* d_out;
  __nv_bfloat16* d_x;
  float* d_topk_weights;
  int wave_lag;    // ExpertWaves::lag
  int n_tiles[2];  // dgrad1 (over I), dgrad2 (over H)
  int k_tiles[2];  // 64-deep stages: dgrad1 over H, dgrad2 over 2I
  device::OperandSources dgrad1_src;  // A: d_out rows gathered from recv_dout through row_src
  device::OperandSources dgrad2_src;  // (A: dh, B: W13, both through TMA)
  device::EpilogueArgs dgrad1_epi;    // C = dh (2I wide), aux = w * a, row scale w, partials to the sources
  device::EpilogueArgs dgrad2_epi;    // C = dx rows through row_dest
  uint64_t* timeline;                 // optional, diagnostics: ep::kFusedTimelineStamps per CTA
};

using FusedBackwardConfig = FusedGemmConfig<device::GemmForm::kNN>;
static_assert(FusedBackwardConfig::Shape::kABytes == device::kHBoxBytes &&
                  3 * device::kHBoxBytes <= FusedBackwardConfig::Shape::kStageBytes,
              "dgrad1's h boxes sit where the loader puts them, and its gate, up and w * a boxes fit a stage");

// ---------------------------------------------------------------- roles

// Phase 3: CTA `cta` takes the sources src with src % CTAs == cta (this rank's own first). Once all
// of a source's d_out rows have landed, its rows of expert e, expert-major rows [base[src][e], + count), add
// to the rows_ready of the blocks they fall in (one release per block and expert: the CTA's acquire of the
// arrivals comes before it). Every source is waited for, also when nothing is counted (`count` false: the
// offsets overflowed), so that rows_arrived has seen every arrival before it is reset.
__device__ inline void arrival_role(const FusedBackwardParams& p, const ep::RouteTables& t, bool count, int cta,
                                    int* shared) {
  const ep::Params& L = p.layer;
  const ep::Shape& s = L.shape;
  const int R = s.num_ranks, EL = s.experts_per_rank;
  const int32_t* counts = ep::at<int32_t>(L.local, L.layout.recv_counts);
  uint32_t* rows_ready = ep::at<uint32_t>(L.local, L.layout.rows_ready);
  const int64_t max_rows_per_source = static_cast<int64_t>(s.max_tokens) * s.top_k;
  for (int i = 0; i < R; ++i) {
    const int src = (s.rank + i) % R;
    if (src % static_cast<int>(gridDim.x) != cta) continue;
    if (source_rows_landed(L, src, true, shared) < 0 || !count) continue;
    for (int e = threadIdx.x; e < EL; e += kFusedThreads) {
      const int32_t n = counts[src * (EL + 1) + e];
      if (n <= 0 || n > max_rows_per_source) continue;  // out of range: route_offsets counted it as 0
      const int64_t lo = t.base[src * EL + e] - t.offsets[e];  // within the expert
      for (int64_t block = lo / 128; block * 128 < lo + n; ++block) {
        const int64_t first = block * 128 > lo ? block * 128 : lo;
        const int64_t end = (block + 1) * 128 < lo + n ? (block + 1) * 128 : lo + n;
        device::signal_add<device::Scope::kGpu>(rows_ready + t.block_start[e] + block,
                                                static_cast<uint32_t>(end - first));
      }
    }
  }
}

// Phase 4, producer warpgroup (ptid 0..127): the stages of every item this CTA draws, and for dgrad1 the h
// boxes its epilogue reads, streamed through the ring after the tile's K stages.
template <class Cfg>
__device__ void backward_producer(const CUtensorMap* tm_w2, const CUtensorMap* tm_h, const CUtensorMap* tm_dh_load,
                                  const CUtensorMap* tm_w13, const FusedBackwardParams& p,
                                  typename Cfg::SharedStorage& smem, const typename Cfg::Waves& waves,
                                  const typename Cfg::Schedule& schedule, int ptid) {
  using Shape = typename Cfg::Shape;
  constexpr int kBN = Shape::kBN;
  const int I = p.layer.shape.intermediate;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  typename Cfg::GatherLoader dgrad1{nullptr, tm_w2, p.dgrad1_src, {}};
  typename Cfg::TmaLoader dgrad2{tm_dh_load, tm_w13, p.dgrad2_src, {}};
  device::PipeState<Shape::kStages> st;
  device::EpilogueStageRefill<Shape, true> refill{smem.epilogue_read};  // the h stages the consumers read
  produce_items(p.layer, waves, schedule, 2u * static_cast<uint32_t>(p.n_tiles[0]), p.timeline,
                Cfg::kProducerBarrier, ptid, [&](const device::TileCoord& tile, int gemm) {
                  if (gemm != 0) {
                    load_k_stages<true>(dgrad2, pipe, st, smem.stages, refill, tile, ptid);
                    return;
                  }
                  dgrad1.begin_tile(tile, ptid);
                  load_k_stages<false>(dgrad1, pipe, st, smem.stages, refill, tile, ptid);
                  // The epilogue's h, one stage per 64-column box of the tile (gate and up columns).
                  const int n0 = tile.n_idx * kBN;
                  for (int box = 0; box < kBN / 64 && n0 + box * 64 < I; ++box) {
                    pipe.producer_acquire(st);
                    refill.before_refill(st);
                    dgrad1.load_epilogue_boxes(pipe, st, smem.stages[st.index], tm_h, n0 + box * 64,
                                               I + n0 + box * 64, tile.row0, ptid);
                    refill.filled(st);
                    st.advance();
                  }
                });
}

// Phase 4, consumer warpgroups (tid 128..383): main loop and epilogue of every item this CTA draws.
template <class Cfg>
__device__ void backward_consumer(const CUtensorMap* tm_dh_store, const CUtensorMap* tm_wa_store,
                                  const FusedBackwardParams& p, typename Cfg::SharedStorage& smem,
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
  const auto publish_slice = [&] { pending.run_slice(lt); };
  float acc[kBN / 2];
  // (The workspace addresses below are formed where they are used, from the kernel's parameters: every
  // register counts in the SwiGLU backward's epilogue, and a pointer held through it spilled. For the same
  // reason this walk is not shared with the forward's: a common walk taking the epilogue as a lambda spilled
  // 8 bytes here, and so did the whole hand-over as the main loop's side work (4-8 bytes). What stays pending
  // is a dh slice's publication (the wait for its TMA stores, then its count on act_ready): the side work of a
  // dgrad2 item's main loop, done before the main loop of a dgrad1 item; the rows' counts go at once.)
  for (int j = 0;; ++j) {
    const int t = schedule.read(j);
    if (t >= waves.total_now()) break;
    int gemm = 0;
    const device::TileCoord tile = waves.decode(t, &gemm);
    const device::SliceCoord s{tile.row0 + cwg * 64, tile.rows - cwg * 64, tile.n_idx * kBN, tile.n_idx,
                               lt, lt >> 5, lt & 31};
    if (gemm == 0) {
      publish_slice();
      device::mma_tile<Shape, true>(acc, pipe, st, smem.stages[0], tile, cwg, ctid, lt, 0);
      // dh and w * a are contiguous: whole slices leave through TMA, a partial one through the threads.
      store.begin_tile(s.valid >= 64, p.dgrad1_epi.c, p.dgrad1_epi.aux, s.slice0, s.valid);
      device::EpilogueStagesInPlace<Shape, true> hstages{pipe, st, smem.stages[0], smem.epilogue_read, lt, 0};
      device::epilogue_swiglu_grad_in_place<kBN>(acc, p.dgrad1_epi, s, cwg, tm_dh_store, tm_wa_store, store, hstages);
      // dh, for dgrad2; the rows' routing-gradient partials of this tile's columns
      pending.defer(store, ep::at<uint32_t>(L.local, L.layout.act_ready) + waves.block_of(tile.e, tile.row0), &s,
                    lt);
      pending.run_rows(L, lt);
    } else {
      device::mma_tile<Shape, false>(acc, pipe, st, smem.stages[0], tile, cwg, ctid, lt, 0, publish_slice);
      store.begin_tile(false, p.dgrad2_epi.c, p.dgrad2_epi.aux, s.slice0, s.valid);
      device::epilogue_plain<kBN>(acc, p.dgrad2_epi, s, nullptr, store);
      pending.defer(store, nullptr, &s, lt);  // the rows' d_x columns of this tile
      pending.run(L, lt);
    }
  }
  publish_slice();
  store.finish();
}

// ---------------------------------------------------------------- the kernel

__global__ void __launch_bounds__(kFusedThreads, 1)
    fused_backward_kernel(const __grid_constant__ CUtensorMap tm_w2, const __grid_constant__ CUtensorMap tm_h,
                          const __grid_constant__ CUtensorMap tm_dh_store,
                          const __grid_constant__ CUtensorMap tm_wa_store,
                          const __grid_constant__ CUtensorMap tm_dh_load, const __grid_constant__ CUtensorMap tm_w13,
                          const FusedBackwardParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Cfg = FusedBackwardConfig;
  // Not device::shared_storage: with every access typed as shared, ptxas spills 12 bytes in this kernel's
  // diagnostics path (its register budget is that tight), and spills fail the build; generic accesses here.
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<Cfg::SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                                      ~uintptr_t(1023));
  const ep::Params& L = p.layer;
  const ep::Shape& s = L.shape;
  const int tid = threadIdx.x;
  const int cta = blockIdx.x;
  const auto nan_outputs = [&] {
    fill_nan(p.d_x, L.num_tokens * s.hidden);
    fill_nan(p.d_topk_weights, L.num_tokens * s.top_k);
  };
  if (fused_kernel_refused(L, ep::kBarrierGradCombined, nan_outputs)) return;
  stamp(p.timeline, ep::kStampStart);
  const typename Cfg::Schedule schedule{&smem.schedule, ep::at<int>(L.local, L.layout.fused_work)};
  init_gemm_rings<Cfg>(smem, schedule);
  __syncthreads();
  stamp(p.timeline, ep::kStampLayout);  // (no layout: the forward's routing)

  // 1. dispatch d_out with the forward's slots
  dispatch_role(L, p.d_out, L.layout.recv_dout, static_cast<const int32_t*>(nullptr), nullptr, smem.sent);
  stamp(p.timeline, ep::kStampDispatch);

  // 2. offsets and row blocks from the forward's counts, the GEMM work
  const ep::RouteTables tables = ep::RouteTables::in(smem.scratch, s);
  (void)ep::route_offsets(L, tables, false, false);  // the forward reported (and broke the group on) bad counts
  const typename Cfg::Waves waves{&smem.waves};
  waves.build(tables.offsets, s.experts_per_rank, p.n_tiles[0], p.n_tiles[1], p.k_tiles[0], p.k_tiles[1], p.wave_lag,
              tid, kFusedThreads);
  stamp(p.timeline, ep::kStampCounts);

  // 3. arrivals
  arrival_role(p, tables, !tables.overflow(s), cta, smem.flags);
  stamp(p.timeline, ep::kStampRouted);

  // 4. GEMMs
  run_gemm_phase<Cfg>(
      [&](int ptid) { backward_producer<Cfg>(&tm_w2, &tm_h, &tm_dh_load, &tm_w13, p, smem, waves, schedule, ptid); },
      [&](int thread) { backward_consumer<Cfg>(&tm_dh_store, &tm_wa_store, p, smem, waves, schedule, thread); });
  stamp(p.timeline, ep::kStampGemms);

  // 5. combine: each routed slot counts its dgrad1 partials and its dgrad2 rows
  combine_role<false>(L, p.n_tiles[0] + p.n_tiles[1], nullptr, p.d_x, p.d_topk_weights);
  stamp(p.timeline, ep::kStampCombined);

  // 6. clean up, meet the peers, NaN on failure (the grid's first barriers: made here, it holds no registers
  // through the GEMMs)
  FusedGrid grid = FusedGrid::of(L);
  fused_kernel_end(L, grid, ep::kBarrierGradCombined, p.timeline, nan_outputs);
#endif
}

}  // namespace megamoe::kernels
