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
  kErrorBroken = 5,          // a call on a layer that an earlier timeout left unusable
  kErrorPeerIndex = 6,       // a: source rank, b: the value a peer wrote, c: which field (PeerField)
  kErrorForwardFailed = 7,   // a backward whose forward had failed
};

// What a kErrorWaitTimeout of the fused forward waited for: its wait id is kind * 2^32 + index.
enum FusedWait : int64_t {
  kWaitGridBarrier = 1,  // index: the barrier's number in the launch
  kWaitCounts = 2,       // index: this rank (the counts of every source)
  kWaitRows = 3,         // index: the source rank whose token rows had not all landed
  kWaitRowBlock = 4,     // index: the 128-row block whose rows were not all routed (GEMM1)
  kWaitActBlock = 5,     // index: the 128-row block whose a was not all stored (GEMM2)
  kWaitToken = 6,        // index: the token whose rows had not all come home (combine)
};
inline constexpr int64_t fused_wait_id(FusedWait kind, int64_t index) { return (int64_t{kind} << 32) + index; }

// Fields of the receive buffers that peers write and the receiver checks (kErrorPeerIndex, c).
enum PeerField : int32_t { kPeerCount = 0, kPeerTokens = 1, kPeerLocalExpert = 2, kPeerRowIndex = 3, kPeerToken = 4 };

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
