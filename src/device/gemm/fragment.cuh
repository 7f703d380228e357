// The one place that knows where a wgmma accumulator register sits in the output tile. For a warpgroup's
// m64nN accumulators (N / 2 fp32 registers per thread), register i of lane `lane` in warp `warp` (0..3 of the
// warpgroup) holds row 16 * warp + lane / 4 + 8 * ((i / 2) % 2) and column 8 * (i / 4) + 2 * (lane % 4) + i % 2
// of the warpgroup's 64 x N block. Code walks it as column groups j (8 columns) x row halves h x pairs e.
#pragma once

namespace megamoe::device {

struct Fragment {
  // Register of column group j (0..N/8-1), row half h (0, 1), element e (0, 1) of the pair.
  static constexpr int reg(int j, int h, int e) { return 4 * j + 2 * h + e; }
  // Row within the warpgroup's 64-row block of row half h.
  static __device__ __forceinline__ int row(int warp, int lane, int h) { return 16 * warp + (lane >> 2) + 8 * h; }
  // Column within the block of the pair of column group j (the pair covers col and col + 1).
  static __device__ __forceinline__ int col(int lane, int j) { return 8 * j + 2 * (lane & 3); }
};

}  // namespace megamoe::device
