// A barrier over every CTA of one persistent launch (the CTAs of a rank's fused kernel, all resident at once):
// each CTA adds 1 to a counter in global memory and waits until the counter reaches n * ctas at its n-th
// barrier, so the counter only grows during a launch and no CTA can overtake a barrier another has not
// left. The waits are bounded (WaitReport: a CTA that never arrives is reported, not waited for forever).
//
// Clean-up: the counter must be 0 again for the next launch, but a CTA may still be reading it while
// another has passed the last barrier. So every CTA also adds 1 to an exit counter once it has left its last
// wait, and the CTA that makes the exit count complete (the last one out) resets both.
#pragma once

#include <cstdint>

#include "device/comm/signal.cuh"

namespace megamoe::device {

struct GridBarrier {
  uint32_t* arrivals;  // zero before the launch
  uint32_t* exits;     // zero before the launch
  int ctas;            // CTAs of the launch (gridDim.x)

  // Every thread of every CTA; the n-th call of the launch passes n = 1, 2, ... Writes of any thread of
  // any CTA made before its CTA arrived are visible to every thread after the barrier. It waits even when
  // an error is already recorded (the phases it separates must stay ordered on the error paths too), so
  // report.stop_on_error is ignored (report.stop_flag is not). Returns false (recorded through report,
  // wait id `wait_id`, unless given up through stop_flag) after the wait; the CTA then goes on, so that
  // nothing hangs.
  // timed_out, optional: set in thread 0 when the wait ended by its timeout.
  __device__ bool sync(int n, WaitReport report, int64_t wait_id, bool* timed_out = nullptr) const {
    report.stop_on_error = false;
    __syncthreads();
    bool passed = false;
    if (threadIdx.x == 0) {
      __threadfence();  // release the whole CTA's writes (ordered before by __syncthreads) at gpu scope
      signal_add<Scope::kGpu>(arrivals, 1u);
      passed = wait_at_least<Scope::kGpu>(arrivals, static_cast<uint32_t>(n) * static_cast<uint32_t>(ctas), report,
                                          wait_id, timed_out);
    }
    // Thread 0's outcome reaches the CTA through the barrier itself (no shared flag to reuse between calls).
    return __syncthreads_or(passed ? 1 : 0) != 0;
  }

  // Every thread of every CTA, after the CTA's last sync(): the last CTA out leaves both counters at 0.
  __device__ void leave() const {
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint32_t before = atomicAdd(exits, 1u);
      if (before + 1 == static_cast<uint32_t>(ctas)) {
        *reinterpret_cast<volatile uint32_t*>(arrivals) = 0;
        *reinterpret_cast<volatile uint32_t*>(exits) = 0;
      }
    }
  }
};

}  // namespace megamoe::device
