// The GEMM phase both fused kernels share: the producer warpgroup's walk over the items its CTA draws, each
// behind its readiness gate, and the consumers' hand-overs after an item's epilogue (a first-GEMM slice
// published for the second GEMM's TMA loads; the rows that reached their source counted on their tokens),
// done while the next item's tensor-core work runs.
// Each kernel supplies what differs: the loaders of its two GEMMs and its epilogues.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "comm/ep_workspace.hpp"
#include "device/comm/signal.cuh"
#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogue_stages.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/gemm/operands.cuh"
#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/tma.cuh"
#include "device/sched/expert_waves.cuh"
#include "device/sched/grouped_tiles.cuh"
#include "device/sched/schedulers.cuh"
#include "kernels/fused_roles.cuh"

namespace megamoe::kernels {

// Consumer warpgroup: the hand-overs of its last item, kept pending until the next item's first stage is under
// way (mma_tile's side work), so that the store completion and the release fence they wait for overlap the
// tensor cores' work instead of idling them between items (run 27: the fused GEMM window lost 2-3 us per item
// against the standalone GEMMs, and not at the readiness gates). Each thread keeps its own part:
//   thread 0, a first-GEMM slice whose TMA stores it issued: the second GEMM loads the slice through TMA, so
//     the stores must be complete and handed from the async proxy before the release that counts the slice
//     on its row block (act_ready);
//   threads 0..63, a row each whose results went home (a row of the combine, a routing-gradient partial):
//     one count on the row's token on its source (row_signal; the table is read here, not held through the
//     epilogue, where every register counts). The release orders every thread's stores of the item: they
//     came before the barrier in defer().
// Nothing is pending across a wait on this CTA's own data (mma_tile runs the side work before it waits for a
// stage that has not landed), so a producer held at a gate by one of these counts is never waited on.
struct PendingHandover {
  // What is pending, in shared memory (one per consumer warpgroup; written by its thread 0 before the barrier
  // in defer(), rewritten only after the next item's epilogue, by which time every thread has run its part):
  // registers are what the SwiGLU backward's epilogue has least of.
  struct Slot {
    uint32_t* slice_counter;
    int rows_slice0;
    int rows_valid;
  };
  Slot* slot;
  bool slice_pending = false, rows_pending = false;

  // After an item's epilogue: block_counter, the block counter of a first-GEMM slice (or null); rows, the
  // slice whose rows went home (or null).
  template <class Store>
  __device__ __forceinline__ void defer(Store& store, uint32_t* block_counter, const device::SliceCoord* rows,
                                        int lt) {
    if (lt == 0) *slot = Slot{block_counter, rows != nullptr ? rows->slice0 : 0, rows != nullptr ? rows->valid : 0};
    store.barrier();
    slice_pending = rows_pending = true;
  }

  // Both parts.
  __device__ __forceinline__ void run(const ep::Params& L, int lt) {
    run_slice(lt);
    run_rows(L, lt);
  }
  // The slice's part alone (thread 0's wait for its stores, the release on the block counter).
  __device__ __forceinline__ void run_slice(int lt) {
    if (!slice_pending) return;
    slice_pending = false;
    uint32_t* const counter = slot->slice_counter;
    if (lt == 0 && counter != nullptr) {
      device::tma_store_wait_all<0>();
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      device::signal_add<device::Scope::kGpu>(counter, 1u);
    }
  }
  // The rows' part alone (their token counts on the sources).
  __device__ __forceinline__ void run_rows(const ep::Params& L, int lt) {
    if (!rows_pending) return;
    rows_pending = false;
    const Slot item = *slot;
    if (lt < 64 && lt < item.rows_valid) {
      uint32_t* done = ep::at<uint32_t* const>(L.local, L.layout.row_signal)[item.rows_slice0 + lt];
      if (done != nullptr) device::signal_add<device::Scope::kSystem>(done, 1u);
    }
  }
};

// The GEMM configuration of both fused kernels, by the form of their GEMMs (the forward's are NT, the
// backward's dgrads NN): 128 x 256 tiles, the first GEMM's A gathered, the second's through TMA, one ring for
// both, and one shared-memory layout for both kernels (sized by the form). The forward sends a whole 64 x BN
// slice of a and h through TMA stores from its staging boxes (four a warpgroup) and keeps three stages; the
// backward's dgrad1 writes its outputs over the h stages they come from (epilogue_swiglu_grad_in_place) and its
// dgrad2 sends rows home through the threads, so it keeps one staging box a warpgroup and takes a fourth stage.
template <device::GemmForm kForm>
struct FusedGemmConfig {
  static constexpr int kBN = 256;
  static constexpr bool kBackward = kForm == device::GemmForm::kNN;
  static constexpr int kStages = kBackward ? 4 : 3;
  static constexpr int kSlots = kBackward ? 1 : kBN / 64;
  static constexpr int kScheduleRing = 8;
  using Shape = device::MainloopShape<kForm, kBN, kStages, 1>;
  using GatherLoader = device::TileLoader<Shape, true, false>;  // the first GEMM
  using TmaLoader = device::TileLoader<Shape, false, false>;    // the second GEMM
  using Waves = device::ExpertWaves<kFusedMaxExperts>;
  using Schedule = device::DynamicSchedule<kScheduleRing>;
  // Both GEMMs fill the same ring, so a stage counts the gathering loader's arrivals; a second-GEMM stage gets
  // them as plain arrivals of the producer threads besides the TMA thread's.
  static constexpr int kFullArrivals = GatherLoader::kFullArrivals;
  static constexpr int kProducerRegs = 72;
  static constexpr int kConsumerRegs = 216;
  static constexpr int kRegsAtLaunch = device::kRegistersAtLaunch<kFusedThreads>;
  static_assert(device::kRegisterSplitFits<kFusedThreads, kProducerRegs, kConsumerRegs>, "register budget");
  static constexpr int kProducerBarrier = 4;  // named barrier of the producer warpgroup (2, 3: the consumers')

  struct alignas(1024) SharedStorage {
    // The pipeline stages; before the GEMMs the same bytes hold the layout's and the routing's tables.
    union {
      uint8_t stages[kStages][Shape::kStageBytes];
      int32_t scratch[kStages * Shape::kStageBytes / 4];
    };
    uint8_t staging[2][kSlots][device::kBoxBytes];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t epilogue_read[kStages];  // the backward's h stages (device/epilogue/epilogue_stages.cuh)
    device::SliceRows slice_rows[2];
    PendingHandover::Slot pending[2];
    typename Schedule::Storage schedule;
    typename Waves::Storage waves;
    uint32_t sent[kFusedMaxRanks];
    int flags[2];  // a CTA's shared decisions: [0] a wait's outcome, [1] a peer-written count
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget");
  static constexpr int64_t kScratchBytes = kStages * Shape::kStageBytes;
};

// Thread 0, at the kernel's start: the stage ring both GEMMs fill and the schedule's ring of drawn items.
template <class Cfg>
__device__ __forceinline__ void init_gemm_rings(typename Cfg::SharedStorage& smem,
                                                const typename Cfg::Schedule& schedule) {
  if (threadIdx.x != 0) return;
  const device::StagePipeline<Cfg::Shape::kStages> pipe{smem.full, smem.empty};
  pipe.init(Cfg::kFullArrivals, Cfg::Shape::kConsumerGroups);
  device::init_epilogue_read_barriers<typename Cfg::Shape>(smem.epilogue_read);
  schedule.init(256 + device::kProducerThreads - 1);  // every consumer thread, the other producer threads
  device::mbarrier_init_fence();
}

// Every thread: the GEMM phase. The routing tables' shared memory becomes pipeline stages, which TMA (the
// async proxy) writes next; then the producer warpgroup (producer(ptid)) and the consumer warpgroups
// (consumer(tid)) each with their register budget, back to the launch's for what follows the phase.
template <class Cfg, class Producer, class Consumer>
__device__ __forceinline__ void run_gemm_phase(Producer&& producer, Consumer&& consumer) {
  device::fence_proxy_async_smem();
  __syncthreads();
  const int tid = threadIdx.x;
  if (tid < 128) {
    device::setmaxnreg_dec<Cfg::kProducerRegs>();
    producer(tid);
    device::setmaxnreg_inc<Cfg::kRegsAtLaunch>();
  } else {
    device::setmaxnreg_inc<Cfg::kConsumerRegs>();
    consumer(tid);
    device::setmaxnreg_dec<Cfg::kRegsAtLaunch>();
  }
  __syncthreads();
}

// Producer warpgroup (ptid 0..127): every item the CTA draws, in the schedule's order. Thread 0 draws it and
// waits at its gate: a first-GEMM item (gemm 0) until rows_ready[block] holds the block's rows, a second-GEMM
// item until act_ready[block] holds every first-GEMM slice of the block (slices_per_block). The gates wait for
// this rank's own routing and first GEMM, which always finish unless the group broke, so they do not give up
// on a recorded error (a tile loaded before its rows are routed would store through the previous call's row
// pointers). The warpgroup then meets (named barrier `barrier_id`) and load(tile, gemm) fills the item's
// stages. timeline: the diagnostics of GateClock, if any.
template <class Waves, class Schedule, class Load>
__device__ __forceinline__ void produce_items(const ep::Params& L, const Waves& waves, const Schedule& schedule,
                                              uint32_t slices_per_block, uint64_t* timeline, int barrier_id, int ptid,
                                              Load&& load) {
  const uint32_t* rows_ready = ep::at<uint32_t>(L.local, L.layout.rows_ready);
  const uint32_t* act_ready = ep::at<uint32_t>(L.local, L.layout.act_ready);
  GateClock clock{timeline};
  const int total = waves.total();
  for (int j = 0;; ++j) {
    const int t = ptid == 0 ? schedule.draw(j) : schedule.read(j);
    if (t >= total) break;
    int gemm = 0;
    const device::TileCoord tile = waves.decode(t, &gemm);
    ++clock.items;
    if (ptid == 0 && tile.rows > 0) {
      const uint64_t since = clock.start();
      if (gemm == 0) {
        (void)fused_wait(L, rows_ready + tile.m_block, static_cast<uint32_t>(tile.rows),
                         ep::fused_wait_id(ep::kWaitRowBlock, tile.m_block), GiveUp::kWhenBroken, L.timeout_ns);
      } else {
        (void)fused_wait(L, act_ready + tile.m_block, slices_per_block,
                         ep::fused_wait_id(ep::kWaitActBlock, tile.m_block), GiveUp::kWhenBroken, L.timeout_ns);
      }
      // The TMA loads behind the gate (the async proxy) read what the acquire made visible.
      cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
      clock.stop(since);
    }
    // Every producer thread's loads of the item come after the gate.
    device::named_barrier_sync(barrier_id, 128);
    load(tile, gemm);
  }
  if (ptid == 0) clock.write();
}

// A tile's K stages through `loader` into the ring. kPlainArrivals: the loader fills a stage from one TMA
// thread (with its byte count) while the ring counts the gathering loader's arrivals, so every producer thread
// adds a plain one. refill: the wait for the readers of a stage that held an epilogue input
// (device::EpilogueStageRefill).
template <bool kPlainArrivals, class Loader, class Pipe, class State, class Stages, class Refill>
__device__ __forceinline__ void load_k_stages(Loader& loader, const Pipe& pipe, State& st, Stages& stages,
                                              Refill& refill, const device::TileCoord& tile, int ptid) {
  for (int kt = 0; kt < tile.k_tiles; ++kt) {
    pipe.producer_acquire(st);
    refill.before_refill(st);
    loader.load(pipe, st, stages[st.index], tile, kt, ptid, 0);
    if constexpr (kPlainArrivals) device::mbarrier_arrive(pipe.full_barrier(st));
    st.advance();
  }
}

}  // namespace megamoe::kernels
