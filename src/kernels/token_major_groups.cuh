// The groups of 128 routed rows that the token-major copies are made of (kernels/fp8_layout.hpp): numbered
// expert by expert, at most one partial group per expert, so that a kernel can launch a block for every
// possible group (ceil(capacity / 128) + experts) while the offsets are on the device, and each block finds
// its own group.
#pragma once

#include <cstdint>

#include "kernels/fp8_layout.hpp"

namespace megamoe::kernels {

inline constexpr int kTokenMajorGroup = 128;

// One group: how many rows it has (0: its number has none), its first row, its first column of the copy.
struct TokenMajorGroup {
  int first = 0, rows = 0;
  int64_t column = 0;
};

// Groups are numbered expert by expert. Each expert's rows are clamped to start where the previous one's end
// and to stay inside [0, capacity]: then no group reads past the rows or writes into another expert's columns,
// whatever the offsets hold. That walk has a closed form: expert e's rows are [b_e, b_{e+1}) with b_k =
// min(max(0, offsets[0..k]), capacity), so the lanes take 31 experts at a time (lane l boundary base + l) with
// a max-scan for the b's and a sum-scan for the groups before each expert. Group number `slot`, found by the
// calling warp (all 32 lanes).
__device__ inline TokenMajorGroup find_token_major_group(const int32_t* __restrict__ offsets, int experts,
                                                         int64_t capacity, int slot) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  int carried_max = 0, carried_groups = 0;
  for (int base = 0; base < experts; base += 31) {
    const int k = base + lane;
    int bound = max(k <= experts ? __ldg(offsets + k) : 0, carried_max);
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(kAll, bound, d);
      if (lane >= d) bound = max(bound, other);
    }
    const int begin = static_cast<int>(min(static_cast<int64_t>(bound), capacity));
    const int end = __shfl_down_sync(kAll, begin, 1);
    const bool expert = lane < 31 && k < experts;
    const int groups =
        expert ? static_cast<int>((static_cast<int64_t>(end) - begin + kTokenMajorGroup - 1) / kTokenMajorGroup) : 0;
    int through = groups;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(kAll, through, d);
      if (lane >= d) through += other;
    }
    const int before = carried_groups + through - groups;
    const unsigned hit = __ballot_sync(kAll, expert && slot >= before && slot - before < groups);
    if (hit != 0) {
      const int owner = __ffs(hit) - 1;
      const int first = __shfl_sync(kAll, begin, owner), last = __shfl_sync(kAll, end, owner);
      const int local = slot - __shfl_sync(kAll, before, owner);
      TokenMajorGroup group;
      group.first = first + local * kTokenMajorGroup;
      group.rows = min(last - group.first, kTokenMajorGroup);
      group.column = token_major_start(first, base + owner) + static_cast<int64_t>(local) * kTokenMajorGroup;
      return group;
    }
    carried_groups += __shfl_sync(kAll, through, 30);
    carried_max = __shfl_sync(kAll, bound, 30);
  }
  return TokenMajorGroup{};
}

}  // namespace megamoe::kernels
