// A position in a ring of pipeline stages (PipeState: index and phase bit) and the walk over consecutive
// stages with each stage's index a compile-time constant (for_each_ring_stage). Host and device code: the
// walk is checked on the CPU (tests/cpu/ring_walk_test.cpp) against stepping a PipeState.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define MEGAMOE_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define MEGAMOE_HOST_DEVICE_INLINE inline
#endif

namespace megamoe::device {

template <int kStages>
struct PipeState {
  int index = 0;
  uint32_t phase = 0;

  MEGAMOE_HOST_DEVICE_INLINE void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
  // Skips n stages (the stages another warpgroup of the same ring consumes).
  MEGAMOE_HOST_DEVICE_INLINE void advance(int n) {
    const int to = index + n;
    phase ^= static_cast<uint32_t>((to / kStages) & 1);
    index = to % kStages;
  }
};

// One stage of for_each_ring_stage: body(stage s as a type, its phase, whether it is the last), then the
// phase flips after the ring's last stage. Stages s >= kStages do not exist (the switch's spare cases).
template <int s, int kStages, class Body>
MEGAMOE_HOST_DEVICE_INLINE bool ring_step(Body& body, uint32_t& phase, int& left) {
  if constexpr (s < kStages) {
    --left;
    body(std::integral_constant<int, s>{}, phase, left == 0);
    if constexpr (s + 1 == kStages) phase ^= 1;
    return left == 0;
  } else {
    return false;
  }
}

// Runs body(std::integral_constant<int, s>{}, phase, last) for `count` consecutive stages of the ring
// from st on, each stage's index a compile-time constant: a switch enters the ring, unrolled once, at
// st.index, and the stages fall through round after round. Code that addresses a stage's memory then has
// constant offsets from the ring's base (for wgmma descriptors: uniform registers, no per-stage arithmetic
// or register moves). st ends at the stage after the last one.
template <int kStages, class Body>
MEGAMOE_HOST_DEVICE_INLINE void for_each_ring_stage(PipeState<kStages>& st, int count, Body&& body) {
  static_assert(kStages >= 1 && kStages <= 6, "the switch below has six cases");
  if (count <= 0) return;  // (the walk below would never end)
  int left = count;
  uint32_t phase = st.phase;
  int index = st.index;
  for (;;) {
    switch (index) {
      case 0:
        if (ring_step<0, kStages>(body, phase, left)) { index = 1; goto done; }
        [[fallthrough]];
      case 1:
        if (ring_step<1, kStages>(body, phase, left)) { index = 2; goto done; }
        [[fallthrough]];
      case 2:
        if (ring_step<2, kStages>(body, phase, left)) { index = 3; goto done; }
        [[fallthrough]];
      case 3:
        if (ring_step<3, kStages>(body, phase, left)) { index = 4; goto done; }
        [[fallthrough]];
      case 4:
        if (ring_step<4, kStages>(body, phase, left)) { index = 5; goto done; }
        [[fallthrough]];
      case 5:
        if (ring_step<5, kStages>(body, phase, left)) { index = 6; goto done; }
        [[fallthrough]];
      default:
        break;
    }
    index = 0;
  }
done:
  st.index = index == kStages ? 0 : index;
  st.phase = phase;
}

}  // namespace megamoe::device
