// L2 prefetches in the engine's producers, chosen when the library is built (CMake MEGAMOE_L2_PREFETCH, a
// bit mask, 0 by default) until they are measured against the build without them (docs/PERF.md run 154):
//   bit 1: each row of a gathered A operand (modular M-grouped GEMMs), ahead of its copies: at K stages 0, 8,
//          16, ... the row's next eight stages (8-15 stages ahead; a tile's first eight are not prefetched).
// Bit 0 asked for the SwiGLU backward's h boxes at the tile's first K stage; it made that GEMM 6-7% slower
// (docs/PERF.md run 156) and is gone. A prefetch moves nothing into shared memory and changes no value.
#pragma once

#ifndef MEGAMOE_L2_PREFETCH
#define MEGAMOE_L2_PREFETCH 0
#endif
#if MEGAMOE_L2_PREFETCH != 0 && MEGAMOE_L2_PREFETCH != 2
#error "MEGAMOE_L2_PREFETCH is 0 or 2 (bit 1, the gathered A rows)"
#endif

namespace megamoe::device {

inline constexpr bool kPrefetchGatheredRows = (MEGAMOE_L2_PREFETCH & 2) != 0;
inline constexpr int kGatheredRowsLead = 8;  // K stages

}  // namespace megamoe::device
