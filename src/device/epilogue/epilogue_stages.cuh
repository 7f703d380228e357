// An epilogue input streamed through the main loop's ring: the producer loads it into the stages that follow
// a tile's K stages (TileLoader::load_epilogue_boxes), so its loads overlap the last K stages. The consumer
// warpgroup takes one stage at a time (acquire) and hands it back once all its threads have read it
// (release). Used by the SwiGLU backward epilogue for h (epilogue_swiglu_grad); EpilogueStagesInPlace is the
// form whose stages the epilogue also writes its outputs over, handed back once those have left.
//
// Handing such a stage back. The consumers read it (and, in place, write it) with plain accesses, and with a
// gathering loader the next fill of the stage is the producer threads' cp.async copies, plain shared-memory writes
// too. The stage's empty mbarrier alone orders them (every reader, the warpgroup's named barrier, one thread's
// release arrival, the producer's acquire), but compute-sanitizer's racecheck does not follow an arrival made for
// other threads and reports every such refill as a hazard; it does follow arrivals each thread makes for its own
// accesses (docs/PERF.md, run 33). So with a gathering loader every reader also arrives on the stage's read barrier,
// and each producer thread waits there before it refills a stage that held an epilogue input (EpilogueStageRefill).
// The readers then no longer wait for each other either. With a TMA-only loader the refill is TMA's and the producer
// is one thread, so the stage is handed back as before.
#pragma once

#include <cstdint>

#include "device/pipeline.cuh"
#include "device/ptx/mbarrier.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/tma.cuh"

namespace megamoe::device {

// kEachReaderArrives: the producer is the whole gathering warpgroup and waits on the read barriers.
template <class Shape, bool kEachReaderArrives>
struct EpilogueStages {
  const StagePipeline<Shape::kStages>& pipe;
  PipeState<Shape::kStages>& st;
  uint8_t* stages;
  uint64_t* read;   // [kStages]: every reader of the stage's epilogue input has read it (kEachReaderArrives)
  int bar_id, lt;   // the warpgroup's named barrier; thread in the warpgroup
  uint32_t rank;    // CTA in the cluster (a 2-CTA cluster's peer also releases the stage)

  __device__ __forceinline__ const uint8_t* acquire() const {
    pipe.consumer_wait(st);
    return stages + st.index * Shape::kStageBytes;
  }
  __device__ __forceinline__ void release() const {
    if constexpr (kEachReaderArrives) {
      mbarrier_arrive(&read[st.index]);
    } else {
      named_barrier_sync(bar_id, 128);  // every thread of the warpgroup has read the stage
    }
    pipe.template consumer_release<Shape::kCluster>(st, lt, rank);
    st.advance();
  }
};

// The same stages when the epilogue writes its outputs over them (epilogue_swiglu_grad_in_place): a stage goes
// back only once its outputs have left. On the threads' path that is when the warpgroup's read-out ends; on the
// TMA path thread 0, which issued the stores, keeps the latest stage and hands it back once the next box's
// stores are issued (bulk groups are read in order: all but the newest) or at the end of the tile (all), so
// that TMA reads a box while the next one is computed. The stage state advances at acquire().
template <class Shape, bool kEachReaderArrives>
struct EpilogueStagesInPlace {
  const StagePipeline<Shape::kStages>& pipe;
  PipeState<Shape::kStages>& st;
  uint8_t* stages;
  uint64_t* read;  // [kStages]: as EpilogueStages
  int lt;          // thread in the warpgroup
  uint32_t rank;   // CTA in the cluster
  PipeState<Shape::kStages> current;  // the stage of the box in hand
  PipeState<Shape::kStages> sending;  // thread 0: a stage TMA may still be reading outputs from (if in_flight)
  bool in_flight = false;

  __device__ __forceinline__ uint8_t* acquire() {
    pipe.consumer_wait(st);
    current = st;
    st.advance();
    return stages + current.index * Shape::kStageBytes;
  }
  // After BoxStore::sent() for the box in hand (by_tma: its outputs left through TMA).
  __device__ __forceinline__ void release_sent(bool by_tma) {
    if constexpr (kEachReaderArrives) mbarrier_arrive(&read[current.index]);  // this thread's accesses are done
    if (lt != 0) return;  // thread 0 releases for the warpgroup
    if (!by_tma) {
      pipe.template consumer_release_by_one<Shape::kCluster>(current, rank);
      return;
    }
    if (in_flight) {
      tma_store_wait_read<1>();
      pipe.template consumer_release_by_one<Shape::kCluster>(sending, rank);
    }
    sending = current;
    in_flight = true;
  }
  // At the end of the tile's epilogue.
  __device__ __forceinline__ void finish() {
    if (lt == 0 && in_flight) {
      tma_store_wait_read<0>();
      pipe.template consumer_release_by_one<Shape::kCluster>(sending, rank);
      in_flight = false;
    }
  }
};

// The read barriers' arrival count (thread 0, before any use, with the ring's barriers).
template <class Shape>
__device__ __forceinline__ void init_epilogue_read_barriers(uint64_t* read) {
  for (int s = 0; s < Shape::kStages; ++s) mbarrier_init(&read[s], 128 * Shape::kConsumerGroups);
}

// The producer's side of EpilogueStages<Shape, true>, kept by every producer thread alike: which stages hold
// an epilogue input (filled()) and the wait for its readers before such a stage is filled again
// (before_refill(), after the stage's acquire). kActive = false: no epilogue input, or a TMA-only loader;
// every call is empty.
template <class Shape, bool kActive>
struct EpilogueStageRefill {
  uint64_t* read;
  uint32_t held = 0;    // bit s: stage s holds an epilogue input its readers may still be reading
  uint32_t parity = 0;  // bit s: the parity of stage s's next read-barrier phase

  __device__ __forceinline__ void filled(const PipeState<Shape::kStages>& st) {
    if constexpr (kActive) held |= 1u << st.index;
  }
  __device__ __forceinline__ void before_refill(const PipeState<Shape::kStages>& st) {
    if constexpr (kActive) {
      const uint32_t bit = 1u << st.index;
      if (held & bit) {
        mbarrier_wait(&read[st.index], (parity & bit) ? 1u : 0u);
        parity ^= bit;
        held &= ~bit;
      }
    }
  }
};

}  // namespace megamoe::device
