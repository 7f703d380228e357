// The grouped-GEMM engine's kernel, composed from the device building blocks: one persistent,
// warp-specialised CTA of 384 threads per SM.
//   warpgroup 0, the producer (setmaxnreg down): walks the schedule and fills pipeline stages (TileLoader:
//     thread 0 issues the TMA boxes; with gathered operands all 128 threads copy rows by index);
//   warpgroups 1 and 2, the consumers (setmaxnreg up): each owns 64 rows of the 128 x BN tile, runs the
//     main loop (mma_tile) and then the epilogue of the activation (epilogues.cuh) through its boxes.
// Work items are numbered on the device (GroupedTiles) and every role walks the same schedule (static grid
// stride, or dynamic through a shared-memory ring). This header is included by the per-form translation
// units only.
#pragma once

#include <algorithm>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogue_stages.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/gemm/mainloop.cuh"
#include "device/gemm/operands.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "device/ptx/sync.cuh"
#include "device/sched/grouped_tiles.cuh"
#include "device/sched/schedulers.cuh"
#include "device/shared_storage.cuh"
#include "device/tile_clocks.cuh"
#include "kernels/cluster_launch.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/grouped_gemm_launch.hpp"

namespace megamoe::kernels {

using device::GemmForm;

inline constexpr int kGemmThreads = 384;
inline constexpr int kScheduleRing = 8;  // work items in flight from the drawing thread to the other roles

// kBf16C_ (form 3): C rounded to bf16 instead of stored in fp32 (GemmKernelParams::c16), an instantiation of its
// own so that the fp32 kernels carry no second epilogue.
template <GemmForm kForm_, GemmActivation kAct_, int kBN, int kCluster, GemmStoreMode kStore, bool kGatherA_,
          bool kGatherB_, bool kBf16C_ = false>
struct EngineConfig {
  static constexpr GemmForm kForm = kForm_;
  static constexpr GemmActivation kAct = kAct_;
  static constexpr bool kGatherA = kGatherA_;
  static constexpr bool kGatherB = kGatherB_;
  static constexpr bool kBf16C = kBf16C_;
  static_assert(!kBf16C || kForm == GemmForm::kTN, "only form 3 stores fp32, or bf16 instead");
  static constexpr bool kTmaStore = kStore == GemmStoreMode::kTmaTile;
  static_assert(!kTmaStore || kForm != GemmForm::kTN, "form 3 stores fp32 through the threads");
  // The SwiGLU backward in 256-wide tiles writes its outputs over the h stages they come from (three 64-column
  // boxes fit a stage: epilogue_swiglu_grad_in_place), so it keeps one staging box and takes a fourth stage.
  static constexpr bool kGradInPlace = kAct == GemmActivation::kSwiGLUBackward && kBN == 256;
  // TMA stores keep the warpgroup's whole 64 x BN slice in flight (BN / 64 boxes) and pay with a stage.
  static constexpr int kSlots = kTmaStore && !kGradInPlace ? kBN / 64 : 1;
  static constexpr int kStages = kBN == 256 ? (kTmaStore && !kGradInPlace ? 3 : 4) : (kTmaStore ? 5 : 6);
  using Shape = device::MainloopShape<kForm, kBN, kStages, kCluster>;
  using Loader = device::TileLoader<Shape, kGatherA, kGatherB>;
  using Tiles = device::GroupedTiles<Shape::kBM, kBN, Shape::kBK, kCluster, Shape::kKGrouped>;
  using Schedule = device::DynamicSchedule<kScheduleRing>;
  // Gathering producers need registers for their row indices (and index look-ahead), and the SwiGLU
  // backward's producer a loop over the epilogue's stages; the consumers give them up. Below these budgets
  // ptxas spills in the producer branch.
  static constexpr bool kBusyProducer = Loader::kGathers || kAct == GemmActivation::kSwiGLUBackward;
  static constexpr int kProducerRegs = Loader::kGathers ? 72 : (kBusyProducer ? 48 : 40);
  static constexpr int kConsumerRegs = Loader::kGathers ? 216 : (kBusyProducer ? 224 : 232);
  static_assert(device::kRegisterSplitFits<kGemmThreads, kProducerRegs, kConsumerRegs>, "register budget");
  // The SwiGLU backward's h stages: with a gathering producer warpgroup every reader arrives on the stage's
  // read barrier, which the producer threads wait on before they refill it (device/epilogue/epilogue_stages.cuh).
  static constexpr bool kEachReaderArrives = kAct == GemmActivation::kSwiGLUBackward && Loader::kGathers;

  struct alignas(1024) SharedStorage {
    uint8_t stages[kStages][Shape::kStageBytes];  // each 1024-aligned: kStageBytes is a multiple of 1024
    uint8_t staging[2][kSlots][device::kBoxBytes];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t epilogue_read[kStages];  // kEachReaderArrives only
    device::SliceRows slice_rows[2];
    typename Schedule::Storage schedule;
    typename Tiles::Storage tiles;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + slack to align the base
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget");
};

template <class Cfg>
__device__ __forceinline__ void run_producer(const CUtensorMap* tm_a, const CUtensorMap* tm_b, const CUtensorMap* tm_h,
                                             const GemmKernelParams& p,
                                             typename Cfg::SharedStorage& smem, const typename Cfg::Tiles& tiles,
                                             const device::StaticSchedule& sched, bool dynamic, int rank, int ptid) {
  using Shape = typename Cfg::Shape;
  using Loader = typename Cfg::Loader;
  if (!Loader::kGathers && ptid != 0) return;  // one thread issues every TMA box
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  const int total = tiles.total();
  // Every CTA draws (dynamic scheduling is for clusters of 1).
  const typename Cfg::Schedule schedule{&smem.schedule, p.work_counter, total + static_cast<int>(gridDim.x) - 1};
  Loader loader{tm_a, tm_b, p.src, {}};
  device::PipeState<Shape::kStages> st;
  device::EpilogueStageRefill<Shape, Cfg::kEachReaderArrives> refill{smem.epilogue_read};
  for (int j = 0;; ++j) {
    const int t = dynamic ? (ptid == 0 ? schedule.draw(j) : schedule.read(j)) : sched.item(j);
    if (t >= total) break;
    const device::TileCoord tile = tiles.decode(t, rank);
    if constexpr (!Shape::kKGrouped) {
      if (tile.rows > 0) (void)p.ready.wait(tile.m_block);
    }
    loader.begin_tile(tile, ptid);
    for (int kt = 0; kt < tile.k_tiles; ++kt) {
      pipe.producer_acquire(st);
      refill.before_refill(st);
      loader.load(pipe, st, smem.stages[st.index], tile, kt, ptid, rank);
      st.advance();
    }
    if constexpr (Cfg::kAct == GemmActivation::kSwiGLUBackward) {
      // The epilogue's h, one stage per 64-column box of the tile (gate and up columns).
      const int n0 = tile.n_idx * Shape::kBN;
      for (int box = 0; box < Shape::kBN / 64 && n0 + box * 64 < p.N; ++box) {
        pipe.producer_acquire(st);
        refill.before_refill(st);
        loader.load_epilogue_boxes(pipe, st, smem.stages[st.index], tm_h, n0 + box * 64, p.N + n0 + box * 64,
                                   tile.row0, ptid);
        refill.filled(st);
        st.advance();
      }
    }
  }
}

template <class Cfg>
__device__ __forceinline__ void run_consumer(const CUtensorMap* tm_c, const CUtensorMap* tm_aux,
                                             const GemmKernelParams& p, typename Cfg::SharedStorage& smem,
                                             const typename Cfg::Tiles& tiles, const device::StaticSchedule& sched,
                                             bool dynamic, int rank, int tid) {
  using Shape = typename Cfg::Shape;
  constexpr int kBN = Shape::kBN;
  const int cwg = tid / 128 - 1;  // rows 64 cwg .. 64 cwg + 63 of the tile
  const int ctid = tid - 128;
  const int lt = tid & 127;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  const typename Cfg::Schedule schedule{&smem.schedule, p.work_counter};
  device::BoxStore<Cfg::kSlots, Cfg::kTmaStore> store(smem.staging[cwg][0], &smem.slice_rows[cwg], 2 + cwg, lt);
  device::PipeState<Shape::kStages> st;
  device::TileClocks clocks;  // a diagnostic build's counts (tile_clocks.cuh); otherwise nothing
  float acc[kBN / 2];
  for (int j = 0;; ++j) {
    const int t = dynamic ? schedule.read(j) : sched.item(j);
    // Read from shared memory per item, not held across the epilogue (where every register counts).
    if (t >= tiles.total_now()) break;
    const device::TileCoord tile = tiles.decode(t, rank);
    clocks.tile_start();
    // The wait mma_tile begins with, timed apart: a stage waited for twice is full both times.
    if constexpr (device::TileClocks::kEnabled) {
      if (tile.k_tiles > 0) pipe.consumer_wait(st);
    }
    clocks.first_stage_ready();
    device::mma_tile<Shape, Cfg::Loader::kGathers>(acc, pipe, st, smem.stages[0], tile, cwg, ctid, lt,
                                                    static_cast<uint32_t>(rank));
    clocks.main_loop_done(tile.k_tiles);
    const int n0 = tile.n_idx * kBN;
    if constexpr (Shape::kKGrouped) {
      const int64_t group = static_cast<int64_t>(tile.e) * p.M * p.N;
      const int m0 = tile.m_idx * Shape::kBM + cwg * 64;
      const auto store = [&](auto* C) {
        // Only the transposed tile (dW13) is stored from the fragment: the row-major one's stores from there are
        // half sectors, 7% slower than through the staging boxes (docs/PERF.md run 160); as whole sectors
        // (8-byte fp32 pairs) they measured the same as staging (run 161).
        if (p.transpose_c != 0) {
          device::epilogue_fp32_transposed_direct<kBN>(acc, C, p.M, p.N, m0, n0, p.accumulate != 0, lt);
        } else {
          device::epilogue_fp32<kBN>(acc, C, p.M, p.N, m0, n0, p.accumulate != 0, smem.staging[cwg][0], 2 + cwg,
                                     lt);
        }
      };
      if constexpr (Cfg::kBf16C) {
        store(p.c16 + group);
      } else {
        store(p.c32 + group);
      }
    } else {
      const device::SliceCoord s{tile.row0 + cwg * 64, tile.rows - cwg * 64, n0, tile.n_idx, lt, lt >> 5, lt & 31};
      // A TMA box is clipped only at the tensor's edge, and rows past the expert belong to the next one: TMA
      // stores need the whole slice inside the expert (uniform over the warpgroup).
      store.begin_tile(p.tma_store != 0 && s.valid >= 64, p.epi.c, p.epi.aux, s.slice0, s.valid);
      if constexpr (Cfg::kAct == GemmActivation::kSwiGLU) {
        device::epilogue_swiglu<kBN>(acc, p.epi, s, tm_c, tm_aux, store);
      } else if constexpr (Cfg::kAct == GemmActivation::kSwiGLUBackward) {
        if constexpr (Cfg::kGradInPlace) {
          static_assert(Shape::kABytes == device::kHBoxBytes && 3 * device::kHBoxBytes <= Shape::kStageBytes,
                        "the h boxes sit where the loader puts them, and the gate, up and w * a boxes fit a stage");
          device::EpilogueStagesInPlace<Shape, Cfg::kEachReaderArrives> hstages{
              pipe, st, smem.stages[0], smem.epilogue_read, lt, static_cast<uint32_t>(rank)};
          device::epilogue_swiglu_grad_in_place<kBN>(acc, p.epi, s, cwg, tm_c, tm_aux, store, hstages);
        } else {
          device::EpilogueStages<Shape, Cfg::kEachReaderArrives> hstages{
              pipe, st, smem.stages[0], smem.epilogue_read, 2 + cwg, lt, static_cast<uint32_t>(rank)};
          device::epilogue_swiglu_grad<kBN>(acc, p.epi, s, cwg, tm_c, tm_aux, store, hstages);
        }
      } else {
        device::epilogue_plain<kBN>(acc, p.epi, s, tm_c, store);
      }
    }
    clocks.epilogue_done();
  }
  store.finish();
  clocks.report({static_cast<int>(Shape::kForm), static_cast<int>(Cfg::kAct), kBN, Shape::kCluster,
                 Cfg::kTmaStore ? 1 : 0, Cfg::Loader::kGathers ? 1 : 0, p.N, p.K},
                cwg, lt);
}

template <class Cfg>
__global__ void __launch_bounds__(kGemmThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                        const __grid_constant__ CUtensorMap tm_c, const __grid_constant__ CUtensorMap tm_aux,
                        const __grid_constant__ CUtensorMap tm_h, const GemmKernelParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Shape = typename Cfg::Shape;
  auto& smem = device::shared_storage<typename Cfg::SharedStorage>();
  const int tid = threadIdx.x;
  const bool dynamic = Shape::kCluster == 1 && p.work_counter != nullptr;
  // SwiGLU: a tile covers BN accumulator columns of the 2I (BN / 2 gate and BN / 2 up columns).
  const int n_tiles = (p.N + Shape::kBN - 1) / Shape::kBN;
  const typename Cfg::Tiles tiles{&smem.tiles, p.num_groups, n_tiles, p.M, p.K};
  if (tid == 0) {
    const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
    pipe.init(Cfg::Loader::kFullArrivals, Shape::kConsumerGroups * Shape::kCluster);
    if constexpr (Cfg::kEachReaderArrives) device::init_epilogue_read_barriers<Shape>(smem.epilogue_read);
    // The drawn item numbers are read by both consumer warpgroups and by the other gathering threads.
    if (dynamic) {
      const typename Cfg::Schedule schedule{&smem.schedule, p.work_counter};
      schedule.init(256 + (Cfg::Loader::kGathers ? device::kProducerThreads - 1 : 0));
    }
    device::mbarrier_init_fence();
  }
  device::begin_dependent_grid();  // the group offsets and both operands come from earlier kernels
  tiles.build(p.group_offsets, p.max_rows, p.longest_first != 0, tid, kGemmThreads);
  // In a cluster the peer multicasts into this CTA's shared memory and arrives on its barriers: both CTAs
  // must have initialised them first.
  if constexpr (Shape::kCluster > 1) device::cluster_sync();
  const int rank = Shape::kCluster == 1 ? 0 : static_cast<int>(device::cluster_cta_rank());
  const int cluster = Shape::kCluster == 1 ? static_cast<int>(blockIdx.x) : static_cast<int>(device::cluster_id_x());
  const device::StaticSchedule sched{cluster, static_cast<int>(gridDim.x) / Shape::kCluster};
  if (tid < 128) {
    device::setmaxnreg_dec<Cfg::kProducerRegs>();
    run_producer<Cfg>(&tm_a, &tm_b, &tm_h, p, smem, tiles, sched, dynamic, rank, tid);
  } else {
    device::setmaxnreg_inc<Cfg::kConsumerRegs>();
    run_consumer<Cfg>(&tm_c, &tm_aux, p, smem, tiles, sched, dynamic, rank, tid);
  }
  // No CTA may exit while its peer can still arrive on its barriers or multicast into its memory.
  if constexpr (Shape::kCluster > 1) device::cluster_sync();
#endif
}

// ---------------------------------------------------------------- host side of one configuration

template <class Cfg>
Status launch_config(const GemmLaunch& l, cudaStream_t stream) {
  constexpr int kCluster = Cfg::Shape::kCluster;
  int num_sms = 0;
  MEGAMOE_RETURN_IF_ERROR(hopper_device_sms("grouped GEMM", &num_sms));
  ClusterLaunch launch;
  MEGAMOE_RETURN_IF_ERROR(prepare_cluster_launch<kCluster>(grouped_gemm_kernel<Cfg>, kGemmThreads, Cfg::kSmemBytes,
                                                           stream, num_sms, l.tuning.max_ctas, "grouped GEMM",
                                                           &launch));
  device::register_tile_clock_dump();  // a diagnostic build only (tile_clocks.cuh)
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaLaunchKernelEx(&launch.config, grouped_gemm_kernel<Cfg>, l.a, l.b, l.c, l.aux, l.h, l.p));
  MEGAMOE_CHECK_LAUNCH(stream, "grouped_gemm_kernel");
  return Status::ok();
}

template <class Cfg>
Status preload_config() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, grouped_gemm_kernel<Cfg>));
  return Status::ok();
}

// The launch shapes each form and activation is instantiated for: tile 256 with clusters of 1 or 2 and
// either store mode; tile 128 with single CTAs; gathered operands with single CTAs. `Visit` receives each
// configuration type and whether it matches the launch; the first match launches (or, for preloading,
// every configuration is visited).
// The SwiGLU backward epilogue runs in the TMA-tile configurations only: 128 wide it stages several boxes at
// once, which the single staging box of the thread-store configurations cannot hold, and 256 wide it trades
// the slots for a stage (kGradInPlace); the TMA configurations also serve outputs that take the thread path.
template <GemmForm kForm, GemmActivation kAct, bool kGatherA, bool kGatherB, bool kBf16C, class Visit>
Status for_each_config_with(Visit&& visit) {
  constexpr bool kBf16 = kForm != GemmForm::kTN;
  constexpr bool kWideThreads = kAct != GemmActivation::kSwiGLUBackward;  // thread-store configs
  constexpr GemmStoreMode kT = GemmStoreMode::kThreads, kM = GemmStoreMode::kTmaTile;
  if constexpr (kWideThreads)
    MEGAMOE_RETURN_IF_ERROR(visit(EngineConfig<kForm, kAct, 256, 1, kT, kGatherA, kGatherB, kBf16C>{}));
  if constexpr (kWideThreads)
    MEGAMOE_RETURN_IF_ERROR(visit(EngineConfig<kForm, kAct, 128, 1, kT, kGatherA, kGatherB, kBf16C>{}));
  if constexpr (kBf16) {
    MEGAMOE_RETURN_IF_ERROR(visit(EngineConfig<kForm, kAct, 256, 1, kM, kGatherA, kGatherB, kBf16C>{}));
    MEGAMOE_RETURN_IF_ERROR(visit(EngineConfig<kForm, kAct, 128, 1, kM, kGatherA, kGatherB, kBf16C>{}));
  }
  if constexpr (!kGatherA && !kGatherB) {
    if constexpr (kWideThreads)
      MEGAMOE_RETURN_IF_ERROR(visit(EngineConfig<kForm, kAct, 256, 2, kT, false, false, kBf16C>{}));
    if constexpr (kBf16) MEGAMOE_RETURN_IF_ERROR(visit(EngineConfig<kForm, kAct, 256, 2, kM, false, false, kBf16C>{}));
  }
  return Status::ok();
}

template <GemmForm kForm, GemmActivation kAct, bool kBf16C, class Visit>
Status for_each_config_gather(Visit&& visit) {
  MEGAMOE_RETURN_IF_ERROR((for_each_config_with<kForm, kAct, false, false, kBf16C>(visit)));
  MEGAMOE_RETURN_IF_ERROR((for_each_config_with<kForm, kAct, true, false, kBf16C>(visit)));
  if constexpr (kForm == GemmForm::kTN) {
    MEGAMOE_RETURN_IF_ERROR((for_each_config_with<kForm, kAct, false, true, kBf16C>(visit)));
    MEGAMOE_RETURN_IF_ERROR((for_each_config_with<kForm, kAct, true, true, kBf16C>(visit)));
  }
  return Status::ok();
}

template <GemmForm kForm, GemmActivation kAct, class Visit>
Status for_each_config(Visit&& visit) {
  MEGAMOE_RETURN_IF_ERROR((for_each_config_gather<kForm, kAct, false>(visit)));
  if constexpr (kForm == GemmForm::kTN) MEGAMOE_RETURN_IF_ERROR((for_each_config_gather<kForm, kAct, true>(visit)));
  return Status::ok();
}

// Launches the configuration that matches `l` (its tuning is already resolved by the host code).
template <GemmForm kForm, GemmActivation kAct>
Status launch_matching(const GemmLaunch& l, cudaStream_t stream) {
  bool launched = false;
  Status s = for_each_config<kForm, kAct>([&](auto cfg) -> Status {
    using Cfg = decltype(cfg);
    if (launched || Cfg::Shape::kBN != l.tuning.tile_n || Cfg::Shape::kCluster != l.tuning.cluster_size ||
        Cfg::kTmaStore != (l.tuning.store == GemmStoreMode::kTmaTile) || Cfg::kGatherA != l.gather_a ||
        Cfg::kGatherB != l.gather_b || Cfg::kBf16C != (l.p.c16 != nullptr))
      return Status::ok();
    launched = true;
    return launch_config<Cfg>(l, stream);
  });
  MEGAMOE_RETURN_IF_ERROR(s);
  if (!launched) return Status(StatusCode::kNotSupported, "grouped GEMM: no kernel for this launch shape");
  return Status::ok();
}

template <GemmForm kForm, GemmActivation kAct>
Status preload_all() {
  return for_each_config<kForm, kAct>([](auto cfg) { return preload_config<decltype(cfg)>(); });
}

}  // namespace megamoe::kernels
