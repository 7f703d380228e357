// Turns at issuing wgmma for the two consumer warpgroups of a blockwise-scaled FP8 main loop.
//
// Both warpgroups read the same stage (rows 0-63 and 64-127 of the tile) and leave the same full barrier at
// the same moment. Left alone they issue their K block's wgmma together, the tensor cores work on both at
// once, both finish together and then both promote their partial sums with the tensor cores idle: every
// scheduler then issues two warps' promotions (about 140 instructions each) one after the other. Nsight
// Compute measured the tensor pipe active 60% of the time in that form (docs/PERF.md run 47, run 48).
// With turns, warpgroup 1 issues block b only after warpgroup 0 issued it, and warpgroup 0 issues block
// b + 1 only after warpgroup 1 issued block b. Each warpgroup then promotes while the other one's wgmma run,
// the hand-over costs one named-barrier arrival and one wait per block, and the arithmetic is unchanged
// (each warpgroup's own sums, in the same order).
//
// The turns run over the whole kernel, not per tile: both warpgroups walk the same work items, so the
// hand-overs strictly alternate (neither can arrive twice on a barrier the other has not yet passed), and
// finish() takes warpgroup 1's last hand-over so that no barrier is left with arrivals when the kernel ends.
#pragma once

#include "device/ptx/sync.cuh"

namespace megamoe::device {

class IssueTurns {
 public:
  // Named barriers 4 and 5 (0 is __syncthreads, 1 the engine's zero fill, 2 and 3 the epilogues').
  static constexpr int kFirstBarrier = 4;
  static constexpr int kThreads = 256;  // both consumer warpgroups

  __device__ __forceinline__ explicit IssueTurns(int cwg) : cwg_(cwg) {}

  // Before issuing a K block: wait for the other warpgroup's hand-over (warpgroup 0's very first block has
  // none to wait for).
  __device__ __forceinline__ void take() {
    if (cwg_ == 1 || issued_) named_barrier_sync(kFirstBarrier + cwg_, kThreads);
    issued_ = true;
  }
  // After issuing it: the other warpgroup's turn.
  __device__ __forceinline__ void pass() const { named_barrier_arrive(kFirstBarrier + (cwg_ ^ 1), kThreads); }
  // After the last work item: warpgroup 0 takes warpgroup 1's last hand-over.
  __device__ __forceinline__ void finish() const {
    if (cwg_ == 0 && issued_) named_barrier_sync(kFirstBarrier, kThreads);
  }

 private:
  int cwg_;
  bool issued_ = false;
};

}  // namespace megamoe::device
