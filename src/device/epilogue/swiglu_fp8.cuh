// GEMM1's SwiGLU epilogue in the FP8 layer: a = silu(gate) * up, quantized 1 x 128 along I (E4M3 codes and one
// scale per row and group), from the accumulators of gate-up tiles.
//
// A gate-up tile of 128 accumulator columns holds 64 channels: columns [0, 64) are their gate values, columns
// [64, 128) their up values (the weight panel is 64 gate rows and the same channels' 64 up rows). So a thread's
// register of column group j < 8 and the one of group j + 8 are the gate and up values of one channel, and a
// 1 x 128 group of a spans a pair of tiles: channels 128 q + [0, 64) and 128 q + [64, 128), taken one after
// the other by the same warpgroup. A row of a tile lives in the four lanes of a quad (Fragment), so the group's
// amax is the quad's, and each lane quantizes its own values. The rule is the row quantizer's
// (swiglu_quantize_rows_1x128, quantize_warp_group): the same amax, scale and quotients, bit for bit.
#pragma once

#include <cstdint>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/transforms.cuh"
#include "device/fp8_codes.cuh"
#include "device/gemm/fragment.cuh"

namespace megamoe::device {

// Where a's codes and scales go.
struct SwigluFp8Out {
  uint8_t* a_q;       // [rows, I] e4m3, row-major (the A operand of GEMM2)
  float* a_s;         // K-block-major: the scale of row r, group q at a_s[q * a_s_pitch + r]
  int64_t a_s_pitch;
  int I;
};

// a of a warpgroup's gate-up tile: kN / 2 values per thread, a[Fragment::reg(j, h, e)] for column groups
// j < kN / 8 (the channel's up value is in group j + kN / 8).
template <int kN>
__device__ __forceinline__ void gate_up_activation(const float (&acc)[kN], float (&a)[kN / 2]) {
  constexpr int kGateGroups = kN / 8;
#pragma unroll
  for (int j = 0; j < kGateGroups; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        a[Fragment::reg(j, h, e)] = swiglu(acc[Fragment::reg(j, h, e)], acc[Fragment::reg(j + kGateGroups, h, e)]);
}

// Group q of the warpgroup's rows from the pair's two halves of a (gate_up_activation of tiles 2 q and 2 q + 1):
// per row the quad's amax, the scale and the codes. The codes go to `box`, an 8 KB staging box of the
// warpgroup (64 rows of 128 codes, 16-byte chunks swizzled as box_chunk_offset), for store_gate_up_codes to
// write out as whole rows; the scales go straight to a_s (a warp's stores cover 16 consecutive rows). A lane
// holds two codes a row, column group and half; it swaps one pair with its neighbour (lanes 2 k and 2 k + 1
// hold channels 4 i .. 4 i + 1 and 4 i + 2 .. 4 i + 3 of both rows), the even lane then writes the first row's
// four and the odd lane the second row's. Rows at or past `valid` of the slice (whose first row is slice0)
// belong to no expert or to the next one: their scales are not written.
template <int kA>
__device__ __forceinline__ void quantize_gate_up_pair(const float (&first)[kA], const float (&second)[kA],
                                                      const SwigluFp8Out& out, uint8_t* box, int q, int slice0,
                                                      int valid, int warp, int lane) {
  constexpr int kGroups = kA / 4;  // column groups of a half: 2 rows x 2 values each
  constexpr int kRowValues = 2 * 2 * kGroups;
  static_assert(4 * kRowValues == 128, "a quad holds one whole 1 x 128 group of each of its rows");
  uint32_t codes[2][2][kGroups];  // [row half h][tile half][group]: two codes, the even column's in the low byte
  float scale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v[kRowValues];
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        v[2 * j + e] = first[Fragment::reg(j, h, e)];
        v[2 * kGroups + 2 * j + e] = second[Fragment::reg(j, h, e)];
      }
    // fmaxf drops a NaN operand and the running amax starts at 0: the NaN-ignoring amax of fp8::amax_step
    // (the bits' maximum of amax_bits), one instruction a value.
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    scale[h] = scale_from_amax(amax);
    float quotient[kRowValues];
    group_quotients(v, scale[h], quotient);
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
        codes[h][t][j] = e4m3x2_of(quotient[2 * kGroups * t + 2 * j], quotient[2 * kGroups * t + 2 * j + 1]);
  }
  const bool odd = (lane & 1) != 0;
  const int row = Fragment::row(warp, lane, odd ? 1 : 0);
  const int word = (lane & 3) >> 1;  // which 4 bytes of the group's 8 columns
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const uint32_t theirs = __shfl_xor_sync(0xffffffffu, odd ? codes[0][t][j] : codes[1][t][j], 1);
      const uint32_t four = odd ? (theirs | (codes[1][t][j] << 16)) : (codes[0][t][j] | (theirs << 16));
      const int byte = 64 * t + 8 * j + 4 * word;  // of the row's 128
      *reinterpret_cast<uint32_t*>(box + box_chunk_offset(row, byte >> 4) + (byte & 15)) = four;
    }
  // Lanes 4 k and 4 k + 1 of a quad store the scales of its two rows.
  if ((lane & 3) < 2 && row < valid) out.a_s[q * out.a_s_pitch + slice0 + row] = odd ? scale[1] : scale[0];
}

// The codes quantize_gate_up_pair left in `box`, once the warpgroup's writes are done: row r of the slice to
// a_q row slice0 + r, channels 128 q + [0, 128), rows at or past `valid` left alone (for_each_box_chunk: whole
// 128-byte lines).
__device__ __forceinline__ void store_gate_up_codes(const uint8_t* box, const SwigluFp8Out& out, int q, int slice0,
                                                    int valid, int lt) {
  for_each_box_chunk(lt, [&](int row, int chunk, int offset) {
    if (row < valid) {
      const uint4 v = *reinterpret_cast<const uint4*>(box + offset);
      *reinterpret_cast<uint4*>(out.a_q + static_cast<int64_t>(slice0 + row) * out.I + 128 * q + 16 * chunk) = v;
    }
  });
}

}  // namespace megamoe::device
