// The L2 prefetch in the engine's producers, chosen when the library is built (CMake MEGAMOE_L2_PREFETCH, which
// accepts 0, the default, or 2) until it is measured against the build without it (docs/PERF.md run 154): with 2,
// each row of a gathered A operand (modular M-grouped GEMMs) is asked for ahead of its copies: at K stages 0, 8,
// 16, ... the row's next eight stages (8-15 stages ahead; a tile's first eight are not prefetched). The value is
// the bit it had beside a prefetch of the SwiGLU backward's h boxes (bit 0), which made that GEMM 6-7% slower
// (run 156) and is gone. A prefetch moves nothing into shared memory and changes no value.
#pragma once

#ifndef MEGAMOE_L2_PREFETCH
#define MEGAMOE_L2_PREFETCH 0
#endif

namespace megamoe::device {

inline constexpr bool kPrefetchGatheredRows = MEGAMOE_L2_PREFETCH == 2;
inline constexpr int kGatheredRowsLead = 8;  // K stages

}  // namespace megamoe::device
