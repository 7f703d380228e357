// The blockwise-scaled FP8 GEMM kernel (fp8_gemm.hpp), composed from the device building blocks: one
// persistent, warp-specialised CTA of 384 threads per SM, tile 128 x 128, one 128-deep K block per stage;
// alone or in 2-CTA clusters (a pair of vertically adjacent tiles sharing the weight panel, each CTA loading
// one half of it and multicasting it to both, so a CTA's stage costs the L2 three quarters of its bytes).
//   warpgroup 0, the producer (setmaxnreg down), walks the schedule:
//     thread 0 issues the A and B boxes of each stage with TMA (TileLoader, the bf16 engine's loader: a stage
//       of 128-byte rows is the same bytes for 128 e4m3 as for 64 bf16, see fp8_mainloop.cuh);
//     thread 32 loads the stage's A scales with TMA (load_block_scales: sa of the tile's 128 rows);
//     or, with A's rows gathered by index (the layer's receive buffer read in expert order), all 128 threads
//     copy the stage's A rows and each one row's scale with cp.async (TileLoader's gathered tile,
//     gather_block_scale), thread 0 still issuing B through TMA;
//   warpgroups 1 and 2, the consumers (setmaxnreg up): 64 rows each; per stage wgmma x 4 into a temporary
//     accumulator and the fp32 promotion with the scales (mma_tile_fp8_blockwise, which waits for the next
//     stage and reads the weight block's scale from global memory one K block ahead while the tensor cores
//     run), then the bf16 epilogue of the engine (epilogue_plain through BoxStore: TMA stores for whole 64-row
//     slices, else the threads), or with an fp32 D its fp32 boxes the same way (epilogue_fp32_tma).
// Work items (expert, m-tile, n-tile) are numbered on the device (GroupedTiles) from the expert row offsets;
// the dense GEMM is one group of M rows. Every role walks the same grid-stride schedule; the producer decodes
// each item and the consumers read its decoding (TileSlots), which lands with the tile's first stage.
#pragma once

#include <algorithm>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/epilogue/swiglu_fp8.cuh"
#include "device/gemm/block_scales.cuh"
#include "device/gemm/fp8_mainloop.cuh"
#include "device/gemm/operands.cuh"
#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "device/ptx/sync.cuh"
#include "device/sched/grouped_tiles.cuh"
#include "device/sched/schedulers.cuh"
#include "device/sched/tile_slots.cuh"
#include "device/shared_storage.cuh"

namespace megamoe::kernels {

inline constexpr int kFp8GemmThreads = 384;

// Everything the kernel reads, by value.
struct Fp8GemmParams {
  const int32_t* group_offsets;  // device, num_groups + 1 entries; nullptr: dense, one group of max_rows rows
  int num_groups;
  int max_rows;  // rows of A and D (the tensor maps' extent); offsets are clamped into [0, max_rows]
  int N;
  int K;                            // e4m3 elements (a multiple of 128)
  device::OperandSources src;       // B panel rows of an n-tile (the TMA path of TileLoader)
  device::WeightScales b_scales;
  const float* sa_rows;             // gathered A: the source rows' scales [source rows, K / 128] row-major
  device::EpilogueArgs epi;         // D through OutputRows (contiguous, or a pointer per row), no row scale
  float* d32;                       // non-null: D stored in fp32 instead, [max_rows, N] contiguous
  int tma_store;                    // 1: the D tensor map is valid (bf16 D, or fp32 d32 in 32-column boxes)
  device::SwigluFp8Out swiglu;      // gate-up configurations: where a's codes and scales go
};

// kOverlap_: the consumers' loop is mma_tile_fp8_blockwise_overlapped (two partial accumulators: 232
// registers for them, 40 for the producer) instead of mma_tile_fp8_blockwise.
// kGateUp_: GEMM1 of the FP8 layer with its SwiGLU epilogue (fp32 h and the 1 x 128-quantized a, see
// fp8_run_gate_up_pair): a work item is a pair of gate-up tiles, B's rows taken 64 gate and 64 up at a time.
template <int kCluster, bool kGatherA_, bool kOverlap_ = false, bool kGateUp_ = false>
struct Fp8GemmConfig {
  static_assert(!kGatherA_ || kCluster == 1, "gathered rows are not multicast");
  static_assert(!kGateUp_ || !kGatherA_, "the gate-up pair reads A through TMA");
  static constexpr bool kGatherA = kGatherA_;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kGateUp = kGateUp_;
  // Gate-up: an item is two tiles (its two halves), each K / 128 stages.
  static constexpr int kHalves = kGateUp ? 2 : 1;
  static constexpr int kBN = 128;
  // 5 x 32 KB stages + 2 x 2 staging boxes (TMA stores keep a warpgroup's whole 64 x 128 slice in flight)
  // + the tile numbering's tables fit in 227 KB; a sixth stage does not.
  static constexpr int kStages = 5;
  static constexpr int kSlots = kBN / 64;
  // The bf16-pair view: kBK = 64 "bf16" = 128 e4m3 = one K block (fp8_mainloop.cuh).
  using Shape = device::MainloopShape<device::GemmForm::kNT, kBN, kStages, kCluster>;
  using Loader = device::TileLoader<Shape, kGatherA, false>;
  using Tiles = device::GroupedTiles<Shape::kBM, kBN, Shape::kBK, kCluster, false>;
  // Full barrier of a stage: the operand TMA thread's expect-tx arrival plus the scale thread's; gathered,
  // the TMA thread's plus every gathering thread's (its copies include its row's scale).
  static constexpr int kFullArrivals = Loader::kFullArrivals + (kGatherA ? 0 : device::kScaleArrivals);
  // Empty barrier of a stage: every consumer warp's release (every consumer thread's when gathered), and one
  // per consumer warpgroup of the cluster peer (fp8_mainloop.cuh).
  static constexpr int kEmptyArrivals = device::kFp8EmptyArrivals<Shape, kGatherA>;
  static constexpr int kScaleThread = 32;  // producer thread that loads the A scales (another warp than thread 0)
  // Consumers hold two fp32 accumulators of 64 registers each (acc, partial) plus addressing; overlapped,
  // a second partial.
  // The overlapped gate-up pair in a 2-CTA cluster spills at 232 (one predicate held across its items): it
  // takes 240, its producer 24.
  static constexpr bool kWidest = kOverlap && kGateUp && kCluster == 2;
  static constexpr int kProducerRegs = kWidest ? 24 : kOverlap ? 40 : 56;
  static constexpr int kConsumerRegs = kWidest ? 240 : kOverlap ? 232 : 224;
  static_assert(device::kRegisterSplitFits<kFp8GemmThreads, kProducerRegs, kConsumerRegs>, "register budget");

  struct alignas(1024) SharedStorage {
    uint8_t stages[kStages][Shape::kStageBytes];  // each 1024-aligned: kStageBytes is a multiple of 1024
    uint8_t staging[2][kSlots][device::kBoxBytes];
    device::StageScales scales[kStages];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    device::SliceRows slice_rows[2];
    int dense_offsets[2];
    device::TileSlots<8> tile_slots;  // decoded tiles, producer to consumers (at least kStages slots)
    typename Tiles::Storage tiles;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + slack to align the base
  static_assert(sizeof(SharedStorage::tile_slots.tile) / sizeof(device::TileCoord) >= kStages,
                "a tile slot is reused only after its tile's first stage was released (tile_slots.cuh)");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget");
};

template <class Cfg>
__device__ __forceinline__ void fp8_run_producer(const CUtensorMap* tm_a, const CUtensorMap* tm_b,
                                                 const CUtensorMap* tm_sa, const Fp8GemmParams& p, typename Cfg::SharedStorage& smem,
                                                 const typename Cfg::Tiles& tiles, const device::StaticSchedule& sched,
                                                 int rank, int ptid) {
  using Shape = typename Cfg::Shape;
  const bool tma_thread = ptid == 0;
  if (!Cfg::kGatherA && !tma_thread && ptid != Cfg::kScaleThread) return;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  typename Cfg::Loader loader{tm_a, tm_b, p.src, {}};
  device::PipeState<Shape::kStages> st;
  const int k_blocks = p.K / 128;
  for (int j = 0;; ++j) {
    const int t = sched.item(j);
    // Read per item, not held in a register across the loop (the overlapped gate-up pair's producer in a
    // cluster spilled it, at 40 registers and at 24).
    if (t >= tiles.total_now()) break;
    const device::TileCoord tile = tiles.decode(t, rank);
    loader.begin_tile(tile, ptid);
    if constexpr (Cfg::kGatherA) {
      // This thread's row of the tile: its scale goes with the stage's copies.
      const int scale_row = ptid < tile.rows ? device::gather_row(p.src.a, tile.row0 + ptid) : -1;
      for (int kt = 0; kt < tile.k_tiles; ++kt) {
        pipe.producer_acquire(st);
        if (kt == 0 && tma_thread) smem.tile_slots.publish(j, tile);  // before its arrival on the stage
        device::gather_block_scale(&smem.scales[st.index], tile.row0, ptid, p.sa_rows, scale_row, k_blocks, kt);
        loader.load(pipe, st, smem.stages[st.index], tile, kt, ptid, rank);  // then this thread's arrival
        st.advance();
      }
    } else {
      // A gate-up item's halves are the tiles of weight-panel rows 64 (2 q + half) (gate) and I + the same (up).
      for (int half = 0; half < Cfg::kHalves; ++half) {
        device::TileCoord panel = tile;
        if constexpr (Cfg::kGateUp) panel.n_idx = 2 * tile.n_idx + half;
        for (int kt = 0; kt < tile.k_tiles; ++kt) {
          pipe.producer_acquire(st);
          if (tma_thread) {
            if (half == 0 && kt == 0) smem.tile_slots.publish(j, tile);  // before its arrival on the stage
            loader.load(pipe, st, smem.stages[st.index], panel, kt, ptid, rank);
          } else {
            device::load_block_scales(pipe, st, &smem.scales[st.index], tm_sa, tile, kt);
          }
          st.advance();
        }
      }
    }
  }
}

// The K loop of one tile (fp8_mainloop.cuh) in the configuration's form; up_b_scales: gate-up tiles only.
template <class Cfg, int kCwg>
__device__ __forceinline__ void fp8_tile_mainloop(float (&acc)[Cfg::Shape::kBN / 2],
                                                  const device::StagePipeline<Cfg::Shape::kStages>& pipe,
                                                  device::PipeState<Cfg::Shape::kStages>& st,
                                                  typename Cfg::SharedStorage& smem, const float* b_scales,
                                                  const float* up_b_scales, const device::TileCoord& tile, int lt,
                                                  int rank) {
  using Shape = typename Cfg::Shape;
  if constexpr (Cfg::kOverlap) {
    device::mma_tile_fp8_blockwise_overlapped<Shape, Cfg::kGatherA, Cfg::kGateUp>(
        acc, pipe, st, smem.stages[0], smem.scales, b_scales, tile, kCwg, lt, static_cast<uint32_t>(rank),
        up_b_scales);
  } else {
    device::mma_tile_fp8_blockwise<Shape, Cfg::kGatherA, Cfg::kGateUp>(acc, pipe, st, smem.stages[0], smem.scales,
                                                                       b_scales, tile, kCwg, lt,
                                                                       static_cast<uint32_t>(rank), up_b_scales);
  }
}

// fp32 D of a warpgroup's slice: a whole slice leaves through TMA; else the threads store the slice's rows
// inside the expert (rows [slice0, slice0 + valid) of D), once the staging boxes are free of earlier TMA
// stores (begin_tile).
template <class Cfg, int kCwg, class Columns, class Store>
__device__ __forceinline__ void fp8_store_fp32(const float (&acc)[Cfg::Shape::kBN / 2], const CUtensorMap* tm_d,
                                               const Fp8GemmParams& p, typename Cfg::SharedStorage& smem,
                                               Store& store, const device::SliceCoord& s, Columns columns) {
  constexpr int kBN = Cfg::Shape::kBN;
  const bool tma = p.tma_store != 0 && s.valid >= 64;
  store.begin_tile(tma, p.epi.c, p.epi.aux, s.slice0, s.valid);
  if (tma) {
    device::epilogue_fp32_tma<kBN>(acc, tm_d, p.N, s.slice0, columns, store);
  } else {
    device::epilogue_fp32<kBN>(acc, p.d32, s.slice0 + max(s.valid, 0), p.N, s.slice0, columns, false,
                               smem.staging[kCwg][0], 2 + kCwg, s.lt);
  }
}

// A gate-up pair q of GEMM1 with the SwiGLU epilogue: channels 128 q + [0, 128) of h and a, one 1 x 128 group
// of a (swiglu_fp8.cuh). Each half runs its K loop with the gate block's (row q of W13's scales) and the up
// block's (row I / 128 + q) weight scales and stores its h columns (gate and up) in fp32; half 0's a waits in
// the warpgroup's 16 KB of staging boxes (free between the half's h stores and the next half's: registers
// would not hold it beside the overlapped loop's accumulators), half 1 reads it back, quantizes the group from
// both halves into the first box and stores the codes from there, before its own h stores reuse the boxes
// (their begin_tile barrier orders the codes' reads before the h writes).
template <class Cfg, int kCwg, class Store>
__device__ __forceinline__ void fp8_run_gate_up_pair(float (&acc)[Cfg::Shape::kBN / 2], const CUtensorMap* tm_d,
                                                     const Fp8GemmParams& p, typename Cfg::SharedStorage& smem,
                                                     const device::StagePipeline<Cfg::Shape::kStages>& pipe,
                                                     device::PipeState<Cfg::Shape::kStages>& st, Store& store,
                                                     const device::TileCoord& tile, int lt, int rank) {
  constexpr int kBN = Cfg::Shape::kBN;
  constexpr int kA = kBN / 4;  // values of a per thread and half
  static_assert(sizeof(smem.staging[0]) >= sizeof(float) * kA * 128, "half 0's a fits the warpgroup's staging boxes");
  const int q = tile.n_idx;
  // One copy of the K loop and of the h stores for both halves (a run-time half): unrolled, the kernel's code
  // grew to 164 KB and GEMM1 ran 30% slower than the plain one (docs/PERF.md run 97).
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    // The scale pointers are worked out per half, not held across the K loop.
    fp8_tile_mainloop<Cfg, kCwg>(acc, pipe, st, smem, p.b_scales.of_block(tile, q),
                                 p.b_scales.of_block(tile, p.swiglu.I / 128 + q), tile, lt, rank);
    float4* const stash = reinterpret_cast<float4*>(smem.staging[kCwg][0]);  // [kA / 4][128 threads]
    const device::SliceCoord s{tile.row0 + kCwg * 64, tile.rows - kCwg * 64, 0, q, lt, lt >> 5, lt & 31};
    float a[kA];
    device::gate_up_activation(acc, a);
    if (half == 1) {
      // Half 0's a, before this half's h stores reuse the boxes.
      float first[kA];
#pragma unroll
      for (int i = 0; i < kA / 4; ++i) {
        const float4 v = stash[i * 128 + lt];
        first[4 * i] = v.x;
        first[4 * i + 1] = v.y;
        first[4 * i + 2] = v.z;
        first[4 * i + 3] = v.w;
      }
      // The codes go through the first box, once every thread has read its stash out of it, and leave as
      // whole rows: stored straight from the fragment, 4 bytes to each of 16 rows a warp store, they queued
      // in the load-store unit (docs/PERF.md run 99).
      uint8_t* const codes_box = smem.staging[kCwg][0];
      device::named_barrier_sync(2 + kCwg, 128);
      device::quantize_gate_up_pair(first, a, p.swiglu, codes_box, q, s.slice0, s.valid, s.warp, s.lane);
      device::named_barrier_sync(2 + kCwg, 128);
      device::store_gate_up_codes(codes_box, p.swiglu, q, s.slice0, s.valid, lt);
    }
    const int channel0 = 128 * q + 64 * half;
    fp8_store_fp32<Cfg, kCwg>(acc, tm_d, p, smem, store, s,
                              device::GateUpColumns<kBN>{channel0, p.swiglu.I + channel0});
    if (half == 0) {
      // The h stores have read the boxes (TMA: waited for; the threads' path ends on the warpgroup's barrier).
      if (lt == 0) device::tma_store_wait_read<0>();
      device::named_barrier_sync(2 + kCwg, 128);
#pragma unroll
      for (int i = 0; i < kA / 4; ++i) stash[i * 128 + lt] = make_float4(a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]);
    }
  }
}

template <class Cfg, int kCwg>
__device__ __forceinline__ void fp8_run_consumer(const CUtensorMap* tm_d, const Fp8GemmParams& p,
                                                 typename Cfg::SharedStorage& smem, const typename Cfg::Tiles& tiles,
                                                 const device::StaticSchedule& sched, int rank, int tid) {
  using Shape = typename Cfg::Shape;
  constexpr int kBN = Shape::kBN;
  // rows 64 cwg .. 64 cwg + 63 of the tile: a constant of this instantiation, so that the main loop's operand
  // offsets need no arithmetic on the thread index per K block.
  constexpr int cwg = kCwg;
  const int lt = tid & 127;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  device::BoxStore<Cfg::kSlots, true> store(smem.staging[cwg][0], &smem.slice_rows[cwg], 2 + cwg, lt);
  device::PipeState<Shape::kStages> st;
  float acc[kBN / 2];
  for (int j = 0;; ++j) {
    const int t = sched.item(j);
    // Read from shared memory per item, not held across the epilogue (where every register counts).
    if (t >= tiles.total_now()) break;
    // The producer's decoding of the tile, which landed with its first stage (tile_slots.cuh; every tile has
    // K / 128 >= 1 stages: check_shape in fp8_gemm.cu rejects any other K).
    pipe.consumer_wait(st);
    const device::TileCoord tile = smem.tile_slots.read(j);
    if constexpr (Cfg::kGateUp) {
      fp8_run_gate_up_pair<Cfg, cwg>(acc, tm_d, p, smem, pipe, st, store, tile, lt, rank);
      continue;
    }
    fp8_tile_mainloop<Cfg, cwg>(acc, pipe, st, smem, p.b_scales.of(tile), nullptr, tile, lt, rank);
    const device::SliceCoord s{tile.row0 + cwg * 64, tile.rows - cwg * 64, tile.n_idx * kBN, tile.n_idx,
                               lt, lt >> 5, lt & 31};
    if (p.d32 != nullptr) {
      fp8_store_fp32<Cfg, cwg>(acc, tm_d, p, smem, store, s, device::TileColumns{s.n0});
      continue;
    }
    // A TMA box is clipped only at the tensor's edge, and rows past an expert belong to the next one: TMA
    // stores need the whole slice inside the group (uniform over the warpgroup).
    store.begin_tile(p.tma_store != 0 && s.valid >= 64, p.epi.c, p.epi.aux, s.slice0, s.valid);
    device::epilogue_plain<kBN>(acc, p.epi, s, tm_d, store);
  }
  store.finish();
}

template <class Cfg>
__global__ void __launch_bounds__(kFp8GemmThreads, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                    const __grid_constant__ CUtensorMap tm_sa, const __grid_constant__ CUtensorMap tm_d,
                    const Fp8GemmParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Shape = typename Cfg::Shape;
  auto& smem = device::shared_storage<typename Cfg::SharedStorage>();
  const int tid = threadIdx.x;
  // Gate-up: work items are the pairs of tiles, one per 128 channels of I = N / 2.
  const int n_tiles = Cfg::kGateUp ? p.N / (2 * Shape::kBN) : (p.N + Shape::kBN - 1) / Shape::kBN;
  // The numbering's reduction length is in the bf16-pair view: K / 2 "elements", 64 per stage.
  const typename Cfg::Tiles tiles{&smem.tiles, p.group_offsets != nullptr ? p.num_groups : 1, n_tiles, 0, p.K / 2};
  if (tid == 0) {
    const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
    pipe.init(Cfg::kFullArrivals, Cfg::kEmptyArrivals);
    smem.dense_offsets[0] = 0;
    smem.dense_offsets[1] = p.max_rows;
    device::mbarrier_init_fence();
  }
  device::begin_dependent_grid();  // the group offsets and both operands come from earlier kernels
  __syncthreads();  // the dense offsets are read by every thread of build()
  tiles.build(p.group_offsets != nullptr ? p.group_offsets : smem.dense_offsets, p.max_rows, false, tid,
              kFp8GemmThreads);
  // In a cluster the peer multicasts into this CTA's shared memory and arrives on its barriers: both CTAs
  // must have initialised them first.
  if constexpr (Shape::kCluster > 1) device::cluster_sync();
  const int rank = Shape::kCluster == 1 ? 0 : static_cast<int>(device::cluster_cta_rank());
  const int cluster = Shape::kCluster == 1 ? static_cast<int>(blockIdx.x) : static_cast<int>(device::cluster_id_x());
  const device::StaticSchedule sched{cluster, static_cast<int>(gridDim.x) / Shape::kCluster};
  // The role of the thread's warpgroup. Overlapped, ptxas must see the consumers' code as uniform (wgmma in
  // flight across a divergent path are serialised, C7520): the index is shuffled from lane 0.
  const int warpgroup = Cfg::kOverlap ? __shfl_sync(0xffffffffu, tid / 128, 0) : tid / 128;
  if (warpgroup == 0) {
    device::setmaxnreg_dec<Cfg::kProducerRegs>();
    fp8_run_producer<Cfg>(&tm_a, &tm_b, &tm_sa, p, smem, tiles, sched, rank, tid);
  } else {
    device::setmaxnreg_inc<Cfg::kConsumerRegs>();
    if (warpgroup == 1) {
      fp8_run_consumer<Cfg, 0>(&tm_d, p, smem, tiles, sched, rank, tid);
    } else {
      fp8_run_consumer<Cfg, 1>(&tm_d, p, smem, tiles, sched, rank, tid);
    }
  }
  // No CTA may exit while its peer can still arrive on its barriers or multicast into its memory.
  if constexpr (Shape::kCluster > 1) device::cluster_sync();
#endif
}

}  // namespace megamoe::kernels
