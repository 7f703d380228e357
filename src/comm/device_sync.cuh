// Device-side helpers of the expert-parallel layer over its symmetric workspace: addressing a buffer of a
// rank's workspace, and the rank's device error record.
#pragma once

#include <cstdint>

#include "comm/ep_workspace.hpp"
#include "device/comm/signal.cuh"
#include "megamoe/status.hpp"

namespace megamoe::ep {

using device::record_error;

template <typename T>
__device__ __forceinline__ T* at(char* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

__device__ __forceinline__ DeviceError* error_record(char* base, const WorkspaceLayout& layout) {
  return at<DeviceError>(base, layout.error);
}

__device__ __forceinline__ bool is_broken(const Params& p) {
  return *reinterpret_cast<const volatile int32_t*>(p.local + p.layout.broken) != 0;
}

// The current call cannot give valid results: an error was recorded, or the layer is broken.
__device__ __forceinline__ bool has_error(const Params& p) {
  return device::error_recorded(error_record(p.local, p.layout)) || is_broken(p);
}

// Records the error on every rank of the group: each of them must report it and NaN its outputs.
__device__ __forceinline__ void record_error_everywhere(const Params& p, StatusCode code, ErrorWhat what, int64_t a,
                                                        int64_t b, int64_t c = 0) {
  for (int peer = 0; peer < p.shape.num_ranks; ++peer)
    record_error(error_record(p.peers[peer], p.layout), code, what, p.shape.rank, a, b, c);
}

// After a wait that timed out: its counters can no longer be trusted (a late arrival may still come), so
// every rank records the timeout and is marked broken for good (later calls neither send nor wait; the
// layer must be recreated).
__device__ inline void break_group(const Params& p, ErrorWhat what, int64_t a, int64_t b, int64_t c = 0) {
  for (int peer = 0; peer < p.shape.num_ranks; ++peer) {
    record_error(error_record(p.peers[peer], p.layout), StatusCode::kTimeout, what, p.shape.rank, a, b, c);
    *reinterpret_cast<volatile int32_t*>(p.peers[peer] + p.layout.broken) = 1;
  }
  __threadfence_system();
}

}  // namespace megamoe::ep
