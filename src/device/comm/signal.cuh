// Signals between CTAs, kernels and ranks: a counter that producers add to with release semantics and a
// consumer waits on with acquire semantics, every wait bounded by a timeout that records which wait failed
// in the device error record instead of hanging. Scope: gpu for CTAs and kernels of one GPU (virtual ranks
// included), sys for counters that NVLink peers write.
#pragma once

#include <cstdint>

#include "comm/device_error.hpp"
#include "megamoe/status.hpp"

namespace megamoe::device {

enum class Scope { kGpu, kSystem };

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <Scope kScope>
__device__ __forceinline__ void signal_add(uint32_t* counter, uint32_t value) {
  if constexpr (kScope == Scope::kGpu) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
  } else {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
  }
}
template <Scope kScope>
__device__ __forceinline__ void signal_add(uint64_t* counter, uint64_t value) {
  if constexpr (kScope == Scope::kGpu) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(counter), "l"(value) : "memory");
  } else {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(counter), "l"(value) : "memory");
  }
}

template <Scope kScope>
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* counter) {
  uint32_t v;
  if constexpr (kScope == Scope::kGpu) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  }
  return v;
}
template <Scope kScope>
__device__ __forceinline__ uint64_t load_acquire(const uint64_t* counter) {
  uint64_t v;
  if constexpr (kScope == Scope::kGpu) {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
  } else {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
  }
  return v;
}

// First error wins; the fields of a later one are dropped.
__device__ __forceinline__ void record_error(ep::DeviceError* record, StatusCode code, ep::ErrorWhat what, int rank,
                                             int64_t a, int64_t b, int64_t c = 0) {
  if (atomicCAS(&record->code, 0, static_cast<int32_t>(code)) == 0) {
    record->what = what;
    record->rank = rank;
    record->a = a;
    record->b = b;
    record->c = c;
    __threadfence_system();
  }
}

__device__ __forceinline__ bool error_recorded(const ep::DeviceError* record) {
  return *reinterpret_cast<const volatile int32_t*>(&record->code) != 0;
}

// Where a bounded wait reports its failure, and how.
struct WaitReport {
  ep::DeviceError* record;  // the rank's error record
  int rank;
  uint64_t timeout_ns;
  ep::ErrorWhat what = ep::kErrorWaitTimeout;
  // Give up at once when any error is already recorded, so that a kernel with many waits behind a failed
  // one ends after one timeout, not one per wait. Off for the rank barriers, whose counters must see every
  // arrival of a call even when its outputs are already known to be NaN.
  bool stop_on_error = true;
  // Optional: give up at once when this flag is set (a group broken for good), also with stop_on_error
  // off: waits whose producers always finish unless the group is broken.
  const int32_t* stop_flag = nullptr;
};

// Waits until *counter >= target (acquire). On timeout records kTimeout / report.what with the wait's id,
// the value seen and the target, and returns false; also false, without a record, when it gave up early
// (stop_on_error, stop_flag).
// timed_out, optional: whether a false came from the timeout (else it gave up early).
template <Scope kScope, typename T>
__device__ bool wait_at_least(const T* counter, T target, const WaitReport& report, int64_t wait_id,
                              bool* timed_out = nullptr) {
  if (timed_out != nullptr) *timed_out = false;
  T seen = load_acquire<kScope>(counter);
  if (seen >= target) return true;
  const uint64_t start = global_timer_ns();
  while ((seen = load_acquire<kScope>(counter)) < target) {
    if (report.stop_on_error && error_recorded(report.record)) return false;
    if (report.stop_flag != nullptr && *reinterpret_cast<const volatile int32_t*>(report.stop_flag) != 0) return false;
    if (global_timer_ns() - start > report.timeout_ns) {
      record_error(report.record, StatusCode::kTimeout, report.what, report.rank, wait_id,
                   static_cast<int64_t>(seen), static_cast<int64_t>(target));
      if (timed_out != nullptr) *timed_out = true;
      return false;
    }
    __nanosleep(64);
  }
  return true;
}

}  // namespace megamoe::device
