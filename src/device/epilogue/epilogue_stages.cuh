// An epilogue input streamed through the main loop's ring: the producer loads it into the stages that follow
// a tile's K stages (TileLoader::load_epilogue_boxes), so its loads overlap the last K stages. The consumer
// warpgroup takes one stage at a time (acquire) and hands it back once all its threads have read it
// (release). Used by the SwiGLU backward epilogue for h (epilogue_swiglu_grad).
//
// Handing such a stage back. The consumers read it with plain loads, and with a gathering loader the next
// fill of the stage is the producer threads' cp.async copies, plain shared-memory writes too. The stage's
// empty mbarrier alone orders them (every reader, the warpgroup's named barrier, one thread's release
// arrival, the producer's acquire), but the race checker does not follow a hand-over through one thread's
// mbarrier arrival and reports every such refill. So with a gathering loader the readers also arrive at a
// named barrier of the stage, and the producer warpgroup meets them there before it refills a stage that
// held an epilogue input (EpilogueStageRefill): an ordering the checker sees, and one that lets the readers
// go on without waiting for each other. With a TMA-only loader the refill is TMA's (the async proxy, which
// the checker does not track) and the producer is one thread, so the stage is handed back as before.
#pragma once

#include <cstdint>

#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"

namespace megamoe::device {

// Named barriers kEpilogueStageBarrier0 + stage index (ids 0..4 serve __syncthreads, the consumers and the
// producer warpgroup).
inline constexpr int kEpilogueStageBarrier0 = 8;

template <class Shape>
inline constexpr int kEpilogueStageMeetThreads = 128 * Shape::kConsumerGroups + 128;  // readers + producers

// kProducerMeets: the producer is the whole gathering warpgroup and meets the readers (see above).
template <class Shape, bool kProducerMeets>
struct EpilogueStages {
  static_assert(!kProducerMeets || kEpilogueStageBarrier0 + Shape::kStages <= 16, "one named barrier per stage");
  const StagePipeline<Shape::kStages>& pipe;
  PipeState<Shape::kStages>& st;
  uint8_t* stages;
  int bar_id, lt;   // the warpgroup's named barrier; thread in the warpgroup
  uint32_t rank;    // CTA in the cluster (a 2-CTA cluster's peer also releases the stage)

  __device__ __forceinline__ const uint8_t* acquire() const {
    pipe.consumer_wait(st);
    return stages + st.index * Shape::kStageBytes;
  }
  __device__ __forceinline__ void release() const {
    if constexpr (kProducerMeets) {
      named_barrier_arrive(kEpilogueStageBarrier0 + st.index, kEpilogueStageMeetThreads<Shape>);
    } else {
      named_barrier_sync(bar_id, 128);  // every thread of the warpgroup has read the stage
    }
    pipe.template consumer_release<Shape::kCluster>(st, lt, rank);
    st.advance();
  }
};

// The producer's side of EpilogueStages<Shape, true>: which stages last held an epilogue input (filled()),
// and the meeting with their readers before such a stage is filled again (before_refill(), after the
// stage's acquire) or before the producer leaves (drain(): every reader arrives once per such stage, and the
// arrivals of a barrier must all be met before it is used again or the CTA ends). kActive = false: no
// epilogue input, or a TMA-only loader; every call is empty.
template <class Shape, bool kActive>
struct EpilogueStageRefill {
  uint32_t held = 0;  // bit s: stage s holds an epilogue input not yet met

  __device__ __forceinline__ void filled(const PipeState<Shape::kStages>& st) {
    if constexpr (kActive) held |= 1u << st.index;
  }
  __device__ __forceinline__ void before_refill(const PipeState<Shape::kStages>& st) {
    if constexpr (kActive) {
      if (held & (1u << st.index)) meet(st.index);
    }
  }
  __device__ __forceinline__ void drain() {
    if constexpr (kActive) {
#pragma unroll
      for (int s = 0; s < Shape::kStages; ++s) {
        if (held & (1u << s)) meet(s);
      }
    }
  }

 private:
  __device__ __forceinline__ void meet(int stage) {
    named_barrier_sync(kEpilogueStageBarrier0 + stage, kEpilogueStageMeetThreads<Shape>);
    held &= ~(1u << stage);
  }
};

}  // namespace megamoe::device
