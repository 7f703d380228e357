// The FP8 backward's SwiGLU step as the epilogue of its first dgrad GEMM (g = dOut W2, N = I): the outputs of
// kernels/fp8_swiglu_backward.hpp computed from the accumulators, so that g never goes to memory.
//
// A tile is 128 routed rows of one expert (both consumer warpgroups, 64 rows each) times 128 channels q of I,
// which is exactly one group of each output:
//   - dh = SwiGLU'(w g), row-major, quantized 1 x 128 along 2I: the tile's dg and du are one group each of every
//     row (a row's amax is its quad's: quantize_gate_up_pair, the forward's rule, bit for bit the row
//     quantizer's); the codes leave from a staging box as whole rows;
//   - the token-major copies of a, dg and du (kernels/fp8_layout.hpp): the tile's rows are one group of 128
//     routed rows of the expert (M-tiles start at the expert's first row, as token-major groups do), so every
//     channel's amax is the maximum over the tile's 128 rows: each warp reduces its 16 rows, the eight warps of
//     the two warpgroups meet in shared memory (atomicMax on the magnitudes' bits, which orders as the values
//     do, NaN as 0: the quantizers' amax); the codes are transposed across lanes into words of four rows of a
//     channel and leave from a staging box as 64-byte runs of a channel's row of the copy;
//   - the routing-weight gradient's partial <g, a> over the tile's channels, into part q of the row's partials
//     (dot_rows[r][q]; the combine adds the I / 128 parts in order). This is the one output whose arithmetic
//     order differs from the separate kernel's (which adds a row's channels in another order into part 0).
// Rows of the tile past the expert's (valid) are zeros in the token-major copy, as the separate kernel pads
// them, and have no row-major outputs.
#pragma once

#include <cstdint>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/swiglu_fp8.cuh"
#include "device/epilogue/transforms.cuh"
#include "device/fp8_codes.cuh"
#include "device/gemm/fragment.cuh"
#include "device/ptx/sync.cuh"

namespace megamoe::device {

// Where the step's inputs and outputs are (the layouts of kernels/fp8_swiglu_backward.hpp).
struct SwigluBackwardFp8Epi {
  const float* h;           // [rows, 2I] fp32, GEMM1's output: gate channels, then up
  const float* row_weight;  // [rows]
  int I;
  uint8_t* dh_q;            // [rows, 2I] e4m3
  float* dh_s;              // K-block-major, pitch dh_s_pitch
  int64_t dh_s_pitch;
  float* const* dot_rows;   // optional; a null row pointer drops the row
  uint8_t* at_q;            // [I, columns] e4m3
  float* at_s;              // [columns / 128, I]
  uint8_t* dht_q;           // [2I, columns] e4m3
  float* dht_s;             // [columns / 128, 2I]
  int64_t columns;          // of the token-major copies
};

// The three token-major outputs' channel maxima of one tile (magnitude bits), three tiles' worth in turn: the
// buffer of tile j + 1 is cleared during tile j, before the barrier after which tile j's is read (tile j - 2
// read it last, before the barrier of tile j - 1).
inline constexpr int kSwigluBwdOutputs = 3;  // dg, du, a
inline constexpr int kSwigluBwdMaxBuffers = 3;
struct SwigluBwdColumnMax {
  uint32_t bits[kSwigluBwdMaxBuffers][kSwigluBwdOutputs][128];
};
inline constexpr int kSwigluBwdBarrier = 4;  // named barrier of the two consumer warpgroups (ids 2, 3: each one's)

// A warpgroup's values of one output: v[j / 8][Fragment::reg(j % 8, h, e)] for column group j (0..15): the two
// halves quantize_gate_up_pair takes.
using TileValues = float[2][32];

__device__ __forceinline__ float& value_at(TileValues& v, int j, int h, int e) {
  return v[j >> 3][Fragment::reg(j & 7, h, e)];
}
__device__ __forceinline__ float value_at(const TileValues& v, int j, int h, int e) {
  return v[j >> 3][Fragment::reg(j & 7, h, e)];
}

// A thread's 32 column maxima (index 2 j + e: column 8 j + 2 (lane % 4) + e) reduced over the eight lanes that
// share its columns, each lane ending with four: index 4 (lane / 4) + i of the list (a reduce-scatter, 28
// shuffles where a butterfly per column takes 96).
__device__ __forceinline__ void reduce_scatter_column_max(const uint32_t (&m)[32], int lane, uint32_t (&out)[4]) {
  uint32_t s16[16], s8[8];
  const bool b4 = (lane & 16) != 0, b3 = (lane & 8) != 0, b2 = (lane & 4) != 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, b4 ? m[i] : m[16 + i], 16);
    s16[i] = max(b4 ? m[16 + i] : m[i], other);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, b3 ? s16[i] : s16[8 + i], 8);
    s8[i] = max(b3 ? s16[8 + i] : s16[i], other);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, b2 ? s8[i] : s8[4 + i], 4);
    out[i] = max(b2 ? s8[4 + i] : s8[i], other);
  }
}

// The warp's maxima of its 16 rows for each of the tile's 128 channels, into the tile's buffer (from
// reduce_scatter_column_max: lane l holds list entries 4 (l / 4) + i, so the warp covers every channel once).
__device__ __forceinline__ void add_column_max(uint32_t* channel_max, const uint32_t (&m)[32], int lane) {
  uint32_t mine[4];
  reduce_scatter_column_max(m, lane, mine);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = 4 * (lane >> 2) + i;  // list index 2 j + e
    atomicMax(channel_max + 8 * (k >> 1) + 2 * (lane & 3) + (k & 1), mine[i]);
  }
}

// The column maxima list of an output's values (both of the thread's rows).
__device__ __forceinline__ void thread_column_max(const TileValues& v, uint32_t (&m)[32]) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) m[2 * j + e] = max(amax_bits(value_at(v, j, 0, e)), amax_bits(value_at(v, j, 1, e)));
}

// Byte offset in a warpgroup's token-major staging box (128 channels x 64 rows) of the 16-byte chunk of
// channel c holding rows 16 chunk .. 16 chunk + 15, swizzled so that a warp's word stores spread over the banks.
__device__ __forceinline__ int channel_chunk_offset(int c, int chunk) {
  return c * 64 + ((chunk ^ ((c >> 1) & 3)) << 4);
}

// One output's token-major codes of the warpgroup's 64 rows, by each channel's scale (from its amax bits in
// channel_max), into `box`. Per block of four list entries and row half, a quad's four lanes hold one row each
// of four channels; two shuffles and byte permutes turn that into four words, each lane one channel's four rows
// (lane s of the four: list entry 4 jj + s). values(jj, h, x) gives the thread's four values of block jj, row
// half h (list entries 4 jj + i).
template <class Values>
__device__ __forceinline__ void stage_token_major_codes(Values&& values, const uint32_t* channel_max, uint8_t* box,
                                                        int warp, int lane) {
  const int s = (lane >> 2) & 3, m = lane >> 4, l3 = lane & 3;
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    // The four channels of the block: list entries 4 jj + i = (j = 2 jj + i / 2, e = i % 2).
    QuotientDivisor divisor[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = 8 * (2 * jj + (i >> 1)) + 2 * l3 + (i & 1);
      divisor[i] = divisor_of(scale_from_amax(__uint_as_float(channel_max[c])));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x[4], q[4];
      values(jj, h, x);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        q[i] = quotient_of(x[i], divisor[i]);
      const uint32_t word = e4m3x4_of(q[0], q[1], q[2], q[3]);  // this lane's row, the four channels
      const uint32_t pair_word = __shfl_xor_sync(0xffffffffu, word, 4);
      // Rows 2 (s / 2) .. + 1 of channels s % 2 and s % 2 + 2.
      const uint32_t pairs = (s & 1) == 0 ? __byte_perm(word, pair_word, 0x6240) : __byte_perm(word, pair_word, 0x3715);
      const uint32_t other = __shfl_xor_sync(0xffffffffu, pairs, 8);
      // The four rows of channel s.
      const uint32_t rows4 = (s & 2) == 0 ? __byte_perm(pairs, other, 0x5410) : __byte_perm(pairs, other, 0x3276);
      const int c = 8 * (2 * jj + (s >> 1)) + 2 * l3 + (s & 1);
      *reinterpret_cast<uint32_t*>(box + channel_chunk_offset(c, warp) + 4 * (2 * h + m)) = rows4;
    }
  }
}

// The staged codes of one output to its token-major copy: channel c of the box to channel channel0 + c of qt,
// columns column0 .. column0 + 63 (the warpgroup's rows of the group), 16 bytes a store, four threads a channel.
__device__ __forceinline__ void store_token_major_codes(const uint8_t* box, uint8_t* qt, int64_t columns,
                                                       int64_t channel0, int64_t column0, int lt) {
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int idx = 128 * it + lt, c = idx >> 2, chunk = idx & 3;
    const uint4 v = *reinterpret_cast<const uint4*>(box + channel_chunk_offset(c, chunk));
    *reinterpret_cast<uint4*>(qt + (channel0 + c) * columns + column0 + 16 * chunk) = v;
  }
}

// The tile's epilogue, for warpgroup cwg (rows slice0 .. slice0 + 63 of which `valid` are the expert's; valid
// may be <= 0). acc: the warpgroup's g; q: the tile's 128 channels of I; column0: the tile's group in the
// token-major copies; item: the tile's number in this CTA's sequence (picks the channel-maxima buffer); boxes:
// the warpgroup's two 8 KB staging boxes; lt: the thread in the warpgroup.
template <int kCwg>
__device__ __forceinline__ void swiglu_backward_fp8_epilogue(const float (&acc)[64], const SwigluBackwardFp8Epi& p,
                                                             SwigluBwdColumnMax& maxima, uint8_t* boxes, int q,
                                                             int slice0, int valid, int64_t column0, int item,
                                                             int lt) {
  const int warp = lt >> 5, lane = lt & 31;
  const int64_t I = p.I;
  uint32_t(&tile_max)[kSwigluBwdOutputs][128] = maxima.bits[item % kSwigluBwdMaxBuffers];
  {
    // Clear the next tile's buffer (256 consumer threads, 384 words).
    uint32_t* next = &maxima.bits[(item + 1) % kSwigluBwdMaxBuffers][0][0];
    const int t = kCwg * 128 + lt;
    next[t] = 0u;
    if (t < kSwigluBwdOutputs * 128 - 256) next[t + 256] = 0u;
  }

  // dg and du of the thread's values, <g, a> of its two rows, and a's column maxima (a itself is recomputed
  // below: registers would not hold it beside dg and du).
  TileValues dg, du;
  uint32_t a_max[32];
  float dot[2] = {0.0f, 0.0f};
  float w[2];
  bool row_ok[2];
  int64_t row_base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = Fragment::row(warp, lane, h);
    row_ok[h] = r < valid;
    w[h] = row_ok[h] ? __ldg(p.row_weight + slice0 + r) : 0.0f;
    row_base[h] = static_cast<int64_t>(slice0 + r) * 2 * I + 128 * q;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    float2 gate[2], up[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* const at = p.h + row_base[h] + Fragment::col(lane, j);
      gate[h] = row_ok[h] ? __ldg(reinterpret_cast<const float2*>(at)) : make_float2(0.0f, 0.0f);
      up[h] = row_ok[h] ? __ldg(reinterpret_cast<const float2*>(at + I)) : make_float2(0.0f, 0.0f);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      uint32_t amax = 0u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float g = acc[Fragment::reg(j, h, e)];
        const SwiGLUGrad d =
            swiglu_backward(w[h] * g, e == 0 ? gate[h].x : gate[h].y, e == 0 ? up[h].x : up[h].y);
        value_at(dg, j, h, e) = row_ok[h] ? d.dg : 0.0f;
        value_at(du, j, h, e) = row_ok[h] ? d.du : 0.0f;
        if (row_ok[h]) dot[h] += g * d.a;
        amax = max(amax, row_ok[h] ? amax_bits(d.a) : 0u);
      }
      a_max[2 * j + e] = amax;
    }
  }

  // The rows' partials of <g, a>: the quad's lanes in a fixed order.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 1);
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 2);
    const int r = Fragment::row(warp, lane, h);
    if ((lane & 3) == 0 && row_ok[h] && p.dot_rows != nullptr) {
      float* const dst = p.dot_rows[slice0 + r];
      if (dst != nullptr) dst[q] = dot[h];
    }
  }

  // Channel maxima over the tile's 128 rows.
  {
    uint32_t m[32];
    add_column_max(tile_max[2], a_max, lane);
    thread_column_max(dg, m);
    add_column_max(tile_max[0], m, lane);
    thread_column_max(du, m);
    add_column_max(tile_max[1], m, lane);
  }
  // Every warp's maxima are in; and this warpgroup's boxes are free (its last reads were before this barrier).
  named_barrier_sync(kSwigluBwdBarrier, 256);

  // The token-major scales: warpgroup 0, a channel a thread.
  const int64_t k_block = column0 / 128;
  if (kCwg == 0) {
    const float s_dg = scale_from_amax(__uint_as_float(tile_max[0][lt]));
    const float s_du = scale_from_amax(__uint_as_float(tile_max[1][lt]));
    const float s_a = scale_from_amax(__uint_as_float(tile_max[2][lt]));
    p.dht_s[k_block * 2 * I + 128 * q + lt] = s_dg;
    p.dht_s[k_block * 2 * I + I + 128 * q + lt] = s_du;
    p.at_s[k_block * I + 128 * q + lt] = s_a;
  }

  // dh row-major: dg is group q of each row, du group I / 128 + q.
  uint8_t* const box0 = boxes;
  uint8_t* const box1 = boxes + kBoxBytes;
  const SwigluFp8Out dh_rows{p.dh_q, p.dh_s, p.dh_s_pitch, 2 * p.I};
  quantize_gate_up_pair<32, true>(dg[0], dg[1], dh_rows, box0, q, slice0, valid, warp, lane);
  quantize_gate_up_pair<32, true>(du[0], du[1], dh_rows, box1, I / 128 + q, slice0, valid, warp, lane);
  named_barrier_sync(2 + kCwg, 128);
  store_gate_up_codes(box0, dh_rows, q, slice0, valid, lt);
  store_gate_up_codes(box1, dh_rows, static_cast<int>(I / 128) + q, slice0, valid, lt);
  named_barrier_sync(2 + kCwg, 128);

  // The token-major dg and du.
  const int64_t column = column0 + 64 * kCwg;
  const auto from = [](const TileValues& v) {
    return [&v](int jj, int h, float (&x)[4]) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = value_at(v, 2 * jj + (i >> 1), h, i & 1);
    };
  };
  stage_token_major_codes(from(dg), tile_max[0], box0, warp, lane);
  stage_token_major_codes(from(du), tile_max[1], box1, warp, lane);
  named_barrier_sync(2 + kCwg, 128);
  store_token_major_codes(box0, p.dht_q, p.columns, 128 * q, column, lt);
  store_token_major_codes(box1, p.dht_q, p.columns, I + 128 * q, column, lt);
  named_barrier_sync(2 + kCwg, 128);

  // The token-major a, recomputed from h block by block (the same arithmetic as swiglu_backward's a): held
  // whole, a's values and their loads would not fit the registers.
  const auto recomputed_a = [&](int jj, int h, float (&x)[4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float* const at = p.h + row_base[h] + Fragment::col(lane, 2 * jj + half);
      const float2 gate = row_ok[h] ? *reinterpret_cast<const float2*>(at) : make_float2(0.0f, 0.0f);
      const float2 up = row_ok[h] ? *reinterpret_cast<const float2*>(at + I) : make_float2(0.0f, 0.0f);
      x[2 * half] = row_ok[h] ? swiglu_backward(0.0f, gate.x, up.x).a : 0.0f;
      x[2 * half + 1] = row_ok[h] ? swiglu_backward(0.0f, gate.y, up.y).a : 0.0f;
    }
  };
  stage_token_major_codes(recomputed_a, tile_max[2], box0, warp, lane);
  named_barrier_sync(2 + kCwg, 128);
  store_token_major_codes(box0, p.at_q, p.columns, 128 * q, column, lt);
  // The next tile's first barrier orders these reads before the box is written again.
}

}  // namespace megamoe::device
