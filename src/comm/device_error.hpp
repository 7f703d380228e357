// The device error record: where a kernel notes what went wrong (bad input, capacity, a wait that timed
// out) so that the host can turn it into a Status after the fact, without synchronising on the hot path.
// Host and device code share this header.
#pragma once

#include <cstdint>

namespace megamoe::ep {

// What went wrong on the device; DeviceError::code holds a megamoe::StatusCode value.
enum ErrorWhat : int32_t {
  kErrorNone = 0,
  kErrorExpertId = 1,        // a: token index, b: the id
  kErrorCapacity = 2,        // a: rows needed, b: capacity
  kErrorBarrierTimeout = 3,  // a: barrier id, b: arrivals seen
  kErrorWaitTimeout = 4,     // a: wait id (the counter's index), b: value seen; c: value waited for
};

struct DeviceError {
  int32_t code;  // 0 = no error
  int32_t what;  // ErrorWhat
  int32_t rank;  // rank that detected it
  int32_t pad;
  int64_t a;
  int64_t b;
  int64_t c;
  int64_t reserved;
};

}  // namespace megamoe::ep
