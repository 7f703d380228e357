// The FP8 backward's SwiGLU step on one routed row, a warp a row and a lane four channels of each 128-channel
// block: the arithmetic, the row-major quantization of dh and the summation order of <g, a> that
// swiglu_backward_quantize_rows_1x128 (fp8_quantize.cu) and swiglu_backward_quantize_fp8 (fp8_swiglu_backward.cu)
// must share bit for bit.
#pragma once

#include <cstdint>

#include "device/epilogue/transforms.cuh"
#include "device/fp8_codes.cuh"

namespace megamoe::kernels {

// The lane's values of one 128-channel block of the row.
struct SwigluRowValues {
  float a[4], dg[4], du[4];
};

// Block kb of routed row `row` (w its routing weight; g, gate and up the lane's channels kb 128 + 4 lane .. + 3):
// a = silu(gate) up, dh = SwiGLU'(w g); dh's two 1 x 128 groups (gate, up) quantized across the warp into
// dh_q [rows, 2I] and the K-block-major scales dh_s (gate group kb at row kb, up group at row I / 128 + kb of
// pitch `pitch`); g a added into the lane's `dot` value by value. Every lane of the warp calls it. With
// store false (uniform over the warp: a padding row past its group, whose inputs are zeros) nothing is
// stored and the values are +0, so callers need not branch around the arithmetic.
__device__ __forceinline__ SwigluRowValues swiglu_backward_row_block(float w, const float4& g, const float4& gate,
                                                                     const float4& up, int64_t row, int64_t kb,
                                                                     int64_t I, uint8_t* dh_q, float* dh_s,
                                                                     int64_t pitch, int lane, float& dot,
                                                                     bool store = true) {
  const float gs[4] = {g.x, g.y, g.z, g.w}, gates[4] = {gate.x, gate.y, gate.z, gate.w},
              ups[4] = {up.x, up.y, up.z, up.w};
  SwigluRowValues v;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const device::SwiGLUGrad d = device::swiglu_backward(w * gs[i], gates[i], ups[i]);
    v.dg[i] = d.dg;
    v.du[i] = d.du;
    v.a[i] = d.a;
    dot += gs[i] * d.a;
  }
  const device::WarpGroupQuantized qg = device::quantize_warp_group(v.dg), qu = device::quantize_warp_group(v.du);
  if (!store) return v;
  uint8_t* const codes = dh_q + row * 2 * I + kb * 128 + 4 * lane;
  *reinterpret_cast<uint32_t*>(codes) = qg.bytes;
  *reinterpret_cast<uint32_t*>(codes + I) = qu.bytes;
  if (lane == 0) {
    dh_s[kb * pitch + row] = qg.scale;
    dh_s[(I / 128 + kb) * pitch + row] = qu.scale;
  }
  return v;
}

// The row's <g, a> from the lanes' sums (a fixed butterfly: the same bits every run) into dot_rows[row][0], the
// row's other parts - 1 partials set to 0; a null dot_rows or row pointer skips it. Every lane of the warp calls it.
__device__ __forceinline__ void store_row_dot(float dot, float* const* dot_rows, int64_t row, int parts, int lane) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (dot_rows == nullptr) return;
  float* const dst = dot_rows[row];
  if (dst == nullptr) return;
  for (int part = lane; part < parts; part += 32) dst[part] = part == 0 ? dot : 0.0f;
}

}  // namespace megamoe::kernels
