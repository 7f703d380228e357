// The rank barrier as device code (one thread): every rank adds 1 to counter[id] on every peer (release,
// system scope, so NVLink peers see the data written before), then waits until its own counter[id] == R
// (acquire, bounded). Once a rank has seen R arrivals nobody touches its counter[id] again in this call (a
// peer's next arrival needs this rank's arrival at an earlier barrier, or its signals, of the next call), so
// it resets the counter to 0 itself: the workspace is clean after every call, also under CUDA graph replay.
//
// A timeout leaves counters that no later call can trust (a late peer may still arrive). The rank that
// timed out therefore marks the whole group broken, for good: it records the timeout in every rank's error
// record and sets every rank's `broken` flag. A broken rank's later barriers neither arrive nor wait (no
// hang), they record kErrorBroken, and the combines turn the outputs into NaN; the layer must be recreated.
// Used by the modular path's barrier kernel (device_barrier.cu) and at the end of the fused forward.
#pragma once

#include "comm/device_sync.cuh"

namespace megamoe::ep {

__device__ inline void rank_barrier(const Params& p, int id) {
  if (is_broken(p)) {
    record_error(error_record(p.local, p.layout), StatusCode::kTimeout, kErrorBroken, p.shape.rank, id, 0);
    return;
  }
  const int64_t offset = p.layout.barriers + 8 * static_cast<int64_t>(id);
  // Make every store of this rank's earlier work (peer stores included) visible before arriving.
  __threadfence_system();
  for (int peer = 0; peer < p.shape.num_ranks; ++peer)
    device::signal_add<device::Scope::kSystem>(at<uint64_t>(p.peers[peer], offset), uint64_t{1});
  uint64_t* mine = at<uint64_t>(p.local, offset);
  device::WaitReport report{error_record(p.local, p.layout), p.shape.rank, p.timeout_ns, kErrorBarrierTimeout, false};
  if (device::wait_at_least<device::Scope::kSystem>(mine, static_cast<uint64_t>(p.shape.num_ranks), report, id)) {
    *mine = 0;
    return;
  }
  // Timed out: every rank learns of it, and the group is broken for good.
  break_group(p, kErrorBarrierTimeout, id, static_cast<int64_t>(device::load_acquire<device::Scope::kSystem>(mine)));
}

}  // namespace megamoe::ep
