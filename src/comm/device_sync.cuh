// Device-side meeting points between ranks over the symmetric workspace, and the device error record.
//
// Barrier: every rank adds 1 to counter[id] on every peer (release, system scope, so NVLink peers see
// the data written before), then waits until its own counter[id] == R (acquire). Once a rank has seen
// R arrivals nobody touches its counter[id] again in this call (peers' next arrival needs this rank's
// arrival at an earlier barrier of the next call), so it resets the counter to 0 itself: the workspace
// is clean after every call, also under CUDA graph replay.
#pragma once

#include <cstdint>

#include "comm/ep_workspace.hpp"
#include "megamoe/status.hpp"

namespace megamoe::ep {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* address, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* address) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(address) : "memory");
  return v;
}

template <typename T>
__device__ __forceinline__ T* at(char* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

__device__ __forceinline__ DeviceError* error_record(char* base, const WorkspaceLayout& layout) {
  return at<DeviceError>(base, layout.error);
}

// First error wins; the fields of a later one are dropped.
__device__ __forceinline__ void record_error(DeviceError* record, StatusCode code, ErrorWhat what, int rank,
                                             int64_t a, int64_t b) {
  if (atomicCAS(&record->code, 0, static_cast<int32_t>(code)) == 0) {
    record->what = what;
    record->rank = rank;
    record->a = a;
    record->b = b;
    __threadfence_system();
  }
}

__device__ __forceinline__ bool has_error(const Params& p) {
  return *reinterpret_cast<volatile int32_t*>(p.local + p.layout.error) != 0;
}

}  // namespace megamoe::ep
