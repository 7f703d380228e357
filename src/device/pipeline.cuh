// A ring of shared-memory stages between producers (TMA, gathering threads) and consumers (wgmma warpgroups),
// each stage guarded by a "full" and an "empty" mbarrier. The position in the ring and the phase bit live
// in PipeState (ring_state.hpp), which every role advances through the same sequence of stages; the barrier
// arrival counts are chosen by the code that uses the pipeline (see StagePipeline::init).
#pragma once

#include <cstdint>

#include "device/ptx/mbarrier.cuh"
#include "device/ring_state.hpp"

namespace megamoe::device {

template <int kStages>
struct StagePipeline {
  uint64_t* full;   // [kStages]: the stage's data has landed
  uint64_t* empty;  // [kStages]: every consumer is done reading the stage

  // One thread, before any use. full_arrivals: producer arrivals per stage (1 for the thread that posts
  // the TMA transaction count, plus one per gathering thread); empty_arrivals: consumer releases per stage
  // (per consumer warpgroup, times the CTAs of a cluster whose TMA multicasts into this stage).
  __device__ void init(int full_arrivals, int empty_arrivals) const {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], full_arrivals);
      mbarrier_init(&empty[s], empty_arrivals);
    }
  }

  // Producer: waits until the consumers have released the stage (the first lap passes at once).
  __device__ __forceinline__ void producer_acquire(const PipeState<kStages>& s) const {
    mbarrier_wait(&empty[s.index], s.phase ^ 1);
  }
  // Producer: announces the bytes TMA will deliver into the stage (one of the full arrivals).
  __device__ __forceinline__ void producer_expect_tx(const PipeState<kStages>& s, uint32_t bytes) const {
    mbarrier_arrive_expect_tx(&full[s.index], bytes);
  }
  // Producer: a gathering thread's arrival, once its cp.async copies into the stage have landed.
  __device__ __forceinline__ void producer_commit_copies(const PipeState<kStages>& s) const {
    mbarrier_arrive_on_copies(&full[s.index]);
  }
  __device__ __forceinline__ uint64_t* full_barrier(const PipeState<kStages>& s) const { return &full[s.index]; }

  // Consumer: waits until the stage's data has landed.
  __device__ __forceinline__ void consumer_wait(const PipeState<kStages>& s) const {
    mbarrier_wait(&full[s.index], s.phase);
  }
  // Consumer: whether the stage's data has landed, without waiting.
  __device__ __forceinline__ bool consumer_ready(const PipeState<kStages>& s) const {
    return mbarrier_test(&full[s.index], s.phase);
  }
  // Consumer thread, for its own reads of the stage (the barrier then counts every consumer thread): the
  // form of release compute-sanitizer's racecheck follows when plain reads of the stage are followed by
  // plain writes of the producer (cp.async), docs/PERF.md run 33.
  __device__ __forceinline__ void consumer_release_own(const PipeState<kStages>& s) const {
    mbarrier_arrive(&empty[s.index]);
  }
  // Consumer warp, for its lanes' plain reads of a stage the producer refills through TMA: __syncwarp orders
  // every lane's reads before lane 0's arrival (the barrier counts consumer warps). Racecheck does not follow
  // this hand-over when the producer's refill is a plain write (docs/PERF.md run 33); with TMA it has nothing
  // to report.
  __device__ __forceinline__ void consumer_release_warp(const PipeState<kStages>& s, int lane) const {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&empty[s.index]);
  }
  // One thread for its consumer warpgroup, after it has waited for whatever else still reads the stage (TMA
  // stores sent from it): both arrivals of consumer_release, this CTA's and a 2-CTA cluster peer's.
  template <int kCluster>
  __device__ __forceinline__ void consumer_release_by_one(const PipeState<kStages>& s, uint32_t cta_rank) const {
    mbarrier_arrive(&empty[s.index]);
    if constexpr (kCluster > 1) mbarrier_arrive_cluster_peer(&empty[s.index], cta_rank ^ 1);
  }
  // Consumer warpgroup (lane_in_group = thread index in the warpgroup): releases the stage to this CTA's
  // producer and, in a 2-CTA cluster, to the peer's, whose TMA multicasts into it too.
  template <int kCluster>
  __device__ __forceinline__ void consumer_release(const PipeState<kStages>& s, int lane_in_group,
                                                   uint32_t cta_rank) const {
    if (lane_in_group == 0) mbarrier_arrive(&empty[s.index]);
    if constexpr (kCluster > 1) {
      if (lane_in_group == 1) mbarrier_arrive_cluster_peer(&empty[s.index], cta_rank ^ 1);
    }
  }
};

}  // namespace megamoe::device
