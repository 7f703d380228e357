// An epilogue input streamed through the main loop's ring: the producer loads it into the stages that follow
// a tile's K stages (TileLoader::load_epilogue_boxes), so its loads overlap the last K stages. The consumer
// warpgroup takes one stage at a time (acquire) and hands it back once all its threads have read it
// (release). Used by the SwiGLU backward epilogue for h (epilogue_swiglu_grad).
#pragma once

#include <cstdint>

#include "device/pipeline.cuh"
#include "device/ptx/sync.cuh"

namespace megamoe::device {

template <class Shape>
struct EpilogueStages {
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
    named_barrier_sync(bar_id, 128);  // every thread of the warpgroup has read the stage
    pipe.template consumer_release<Shape::kCluster>(st, lt, rank);
    st.advance();
  }
};

}  // namespace megamoe::device
