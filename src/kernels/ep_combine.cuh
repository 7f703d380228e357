// Combine on the source rank as device code: the K rows a token's slots sent home are summed in slot order
// (0..K-1), in fp32, so the result is bitwise reproducible; the backward also sums each slot's
// d_topk_weights partials in n-tile order. A failed call writes NaN. Used by the modular combine kernels
// (ep_combine.cu) and by the fused forward's combine phase.
#pragma once

#include <cmath>

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {

// One warp, token t. kWeighted (forward): out[t] = sum_j w_j y_j; else (backward) out[t] = sum_j dx_j and
// d_topk_weights[t, :] from the slots' partials. failed: write NaN instead.
// kChunks: the 8-column pieces a lane loads per pass (kChunks pieces, 256 columns apart, of each of up to
// eight slots, all loaded raw before any is added). Every column is still summed in slot order, so the
// result does not depend on kChunks; what does is the number of loads a warp keeps in flight: the modular
// kernels have many warps per SM (kChunks 1), the fused kernels' combine phases one CTA of 12 warps (kChunks
// 2: 16 loads in flight per lane, half the dependent round trips per token).
template <bool kWeighted, int kChunks = 1>
__device__ __forceinline__ void combine_token(const Params& p, int64_t t, int lane, bool failed,
                                              const float* __restrict__ topk_weights, __nv_bfloat16* __restrict__ out,
                                              float* __restrict__ d_topk_weights) {
  const Shape& s = p.shape;
  const int K = s.top_k;
  const int64_t H = s.hidden;
  const int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  const __nv_bfloat16* combine = at<__nv_bfloat16>(p.local, p.layout.combine);
  constexpr int kBatch = 8;
  constexpr int64_t kPass = 32 * 8;  // columns a warp covers with one piece per lane
  for (int64_t i0 = lane * 8; i0 < H; i0 += kPass * kChunks) {
    Bf16x8 acc[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[c].v[k] = failed ? NAN : 0.0f;
    }
    for (int j0 = 0; j0 < K && !failed; j0 += kBatch) {
      uint4 raw[kChunks][kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b;
        const bool routed = j < K && dest_slot[t * K + j] >= 0;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int64_t i = i0 + c * kPass;
          raw[c][b] = make_uint4(0, 0, 0, 0);
          if (routed && i < H) raw[c][b] = *reinterpret_cast<const uint4*>(combine + (t * K + j) * H + i);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b;
        if (j >= K || dest_slot[t * K + j] < 0) continue;
        const float w = kWeighted ? topk_weights[t * K + j] : 1.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          Bf16x8 y;
          y.unpack(raw[c][b]);
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[c].v[k] += w * y.v[k];
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t i = i0 + c * kPass;
      if (i < H) acc[c].store(out + t * H + i);
    }
  }
  if (!kWeighted) {
    const float* dots = at<float>(p.local, p.layout.slot_dots);
    for (int j = lane; j < K; j += 32) {
      float dw = 0.0f;
      if (failed) {
        dw = NAN;
      } else if (dest_slot[t * K + j] >= 0) {
        for (int part = 0; part < s.dot_parts; ++part) dw += dots[(t * K + j) * s.dot_parts + part];
      }
      d_topk_weights[t * K + j] = dw;
    }
  }
}

// The slots of token t that go to some rank (each comes home as one row).
__device__ __forceinline__ int routed_slots(const Params& p, int64_t t) {
  const int K = p.shape.top_k;
  const int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  int n = 0;
  for (int j = 0; j < K; ++j) n += dest_slot[t * K + j] >= 0 ? 1 : 0;
  return n;
}

}  // namespace megamoe::ep
