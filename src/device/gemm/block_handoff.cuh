// The order in which the two consumer warpgroups of a blockwise-scaled FP8 main loop issue their K blocks.
//
// Both warpgroups read the same stage (rows 0-63 and 64-127 of the tile). A warpgroup's wgmma run on all four
// schedulers' tensor cores (one warp on each), so one warpgroup alone can keep the tensor cores busy, and
// wgmma of the two warpgroups that are in flight together share them. Left alone, the two issue a block at
// the same moment, finish it together, and then both promote their partial sums (fp8_promotion.cuh) with the
// tensor cores idle: about a third of every block (docs/PERF.md runs 47-52: tensor pipe 60-68% active).
// Issuing in turns (one warpgroup after the other has issued) does not change that, because wgmma in flight
// together share the tensor cores and still finish together (run 48: 60 -> 63%).
//
// The handoff orders them by completion instead. A warpgroup commits its block's wgmma as two groups (the
// first kHandoffSlices k slices, then the rest); when the first group has completed it lets the other
// warpgroup issue its block. So the other's wgmma queue behind the rest of this block, and this warpgroup
// promotes while they run: the tensor cores always have one warpgroup's work while the other promotes, as
// long as a promotion is shorter than a block's wgmma.
//
// Hand-overs: warpgroup 1 issues block b after warpgroup 0's first group of block b completed, and warpgroup
// 0 issues block b + 1 after warpgroup 1's first group of block b completed (named barriers 4 and 5: each is
// waited on by one warpgroup and arrived on by the other). Both walk the same work items with the same K
// blocks, so the hand-overs strictly alternate (none can arrive twice on a barrier the other has not passed
// since), and finish() takes warpgroup 1's last hand-over so that no barrier is left with arrivals when the
// kernel ends. The arithmetic is unchanged: each warpgroup's own sums, in the same order.
#pragma once

#include "device/ptx/sync.cuh"

namespace megamoe::device {

// k slices (of the four in a 128-deep FP8 K block) in a block's first commit group.
inline constexpr int kHandoffSlices = 2;

class BlockHandoff {
 public:
  // Named barriers 4 (warpgroup 0 waits on it) and 5 (warpgroup 1): 0 is __syncthreads, 1 the bf16 engine's
  // zero fill, 2 and 3 the epilogues'.
  static constexpr int kFirstBarrier = 4;
  static constexpr int kThreads = 256;  // both consumer warpgroups

  __device__ __forceinline__ explicit BlockHandoff(int cwg) : cwg_(cwg) {}

  // Before issuing a K block: wait until the other warpgroup's previous first group completed (warpgroup 0's
  // very first block waits for nothing).
  __device__ __forceinline__ void before_issue() {
    if (cwg_ == 1 || started_) named_barrier_sync(kFirstBarrier + cwg_, kThreads);
    started_ = true;
  }
  // Once this block's first group has completed: the other warpgroup's turn.
  __device__ __forceinline__ void first_group_done() const {
    named_barrier_arrive(kFirstBarrier + (cwg_ ^ 1), kThreads);
  }
  // After the last work item: warpgroup 0 takes warpgroup 1's last hand-over.
  __device__ __forceinline__ void finish() const {
    if (cwg_ == 0 && started_) named_barrier_sync(kFirstBarrier, kThreads);
  }

 private:
  int cwg_;
  bool started_ = false;
};

}  // namespace megamoe::device
