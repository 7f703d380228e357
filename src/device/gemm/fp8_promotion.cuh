// The promotion step of blockwise-scaled FP8 GEMMs: after the tensor cores have summed one 128-deep K block
// into a temporary accumulator (`partial`, Hopper's limited-precision FP8 accumulation inside wgmma), it is
// scaled and added to the main fp32 accumulator in registers:
//     acc[m, n] = fma(partial[m, n], sa[m, kb] * sb[n / 128, kb], acc[m, n])
// (the product of the two scales is formed once per row and K block, in fp32; one fused multiply-add per
// element). Rows of a warpgroup's fragment are walked through Fragment (fragment.cuh): every register of
// row half h of a thread belongs to the same output row, so a thread needs two row scales per K block.
#pragma once

#include "device/gemm/fragment.cuh"

namespace megamoe::device {

// The combined scale of row half h of this thread: a_scales are the tile's 128 row scales of the K block,
// cwg the consumer warpgroup (rows 64 cwg .. 64 cwg + 63), b_scale the weight block's scale.
__device__ __forceinline__ float promotion_scale(const float* a_scales, float b_scale, int cwg, int warp, int lane,
                                                 int h) {
  return a_scales[64 * cwg + Fragment::row(warp, lane, h)] * b_scale;
}

// acc += partial * scale_of(j, h), register by register (kN = BN / 2 registers per thread): the scale of column
// group j, row half h.
template <int kN, class ScaleOf>
__device__ __forceinline__ void promote_groups(float (&acc)[kN], const float (&partial)[kN], ScaleOf&& scale_of) {
#pragma unroll
  for (int j = 0; j < kN / 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = Fragment::reg(j, h, e);
        acc[i] = __fmaf_rn(partial[i], scale_of(j, h), acc[i]);
      }
}

// One weight block per tile: scale[h] for every column.
template <int kN>
__device__ __forceinline__ void promote_block(float (&acc)[kN], const float (&partial)[kN], const float (&scale)[2]) {
  promote_groups(acc, partial, [&](int, int h) { return scale[h]; });
}

// A gate-up tile of GEMM1 (the weight panel's first BN / 2 rows are gate rows, the rest the same channels' up
// rows, from two different 128 x 128 weight blocks): column groups j < kN / 8 take scale[0][h], the rest
// scale[1][h]. Each element gets the product its own weight block gives it, so the sums are bitwise those of
// tiles that hold one weight block.
template <int kN>
__device__ __forceinline__ void promote_block_gate_up(float (&acc)[kN], const float (&partial)[kN],
                                                      const float (&scale)[2][2]) {
  promote_groups(acc, partial, [&](int j, int h) { return scale[j < kN / 8 ? 0 : 1][h]; });
}

// Both operands scaled per row and K block: acc[m, n] = fma(partial[m, n], sa[m] * sb[n], acc[m, n]).
// row_scale[h]: this thread's two row scales; col_scales: the tile's 128 column scales (shared memory), each
// the upper half of an fp32 (block_scales.cuh's StageChannelScales), read a pair per column group (one 4-byte
// load) and widened by a shift and a mask.
template <int kN>
__device__ __forceinline__ void promote_block_channels(float (&acc)[kN], const float (&partial)[kN],
                                                       const float (&row_scale)[2], const uint16_t* col_scales,
                                                       int lane) {
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {
    const uint32_t pair = *reinterpret_cast<const uint32_t*>(col_scales + Fragment::col(lane, j));
    const float2 cs = make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      acc[Fragment::reg(j, h, 0)] = __fmaf_rn(partial[Fragment::reg(j, h, 0)], row_scale[h] * cs.x,
                                              acc[Fragment::reg(j, h, 0)]);
      acc[Fragment::reg(j, h, 1)] = __fmaf_rn(partial[Fragment::reg(j, h, 1)], row_scale[h] * cs.y,
                                              acc[Fragment::reg(j, h, 1)]);
    }
  }
}

}  // namespace megamoe::device
