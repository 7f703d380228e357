// The epilogues of the grouped GEMM: what a consumer warpgroup does with its 64 x BN accumulator slice of a
// tile. Each composes transforms (transforms.cuh) with the box stores (box_store.cuh):
//   epilogue_plain          C = row_scale * acc                                   (bf16)
//   epilogue_swiglu         acc = h: gate columns [0, BN/2), up columns [BN/2, BN) of the tile;
//                           C = a = row_scale * silu(g) * u, aux = h (unscaled)   (bf16)
//   epilogue_swiglu_grad    acc = da (unweighted), reads h (streamed through the pipeline): C = dh = SwiGLU'(row_scale * da) (gate part at
//                           column c, up part at c + N), aux = row_scale * a, and per row the partial
//                           <da, a> over the tile's columns, for the routing-weight gradient;
//                           epilogue_swiglu_grad_in_place: the same, its outputs written over h's stage
//   epilogue_fp32           C (+)= acc, stored in fp32, or rounded once to bf16 (the weight gradients);
//                           epilogue_fp32_transposed_direct: the same into C transposed
// Column groups of the fragment are walked through Fragment (fragment.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/transforms.cuh"
#include "device/gemm/fragment.cuh"

namespace megamoe::device {

// What the epilogues read and write, besides the accumulators.
struct EpilogueArgs {
  OutputRows c;                 // C (SwiGLU backward: dh, 2N wide)
  OutputRows aux;               // SwiGLU: h; SwiGLU backward: row_scale * a
  int c_cols;                   // width of C
  int aux_cols;                 // width of aux
  const float* row_scale;       // optional, per source row
  int up_offset;                // SwiGLU: column of up row 0 in h and dh (= I); h itself arrives through the
                                // pipeline (epilogue_swiglu_grad)
  float* const* dot_rows;       // SwiGLU backward, optional: per source row, where the tile partials go
                                // (partial of n-tile n at dot_rows[row][n])
};

// The part of a tile a consumer warpgroup owns.
struct SliceCoord {
  int slice0;  // source row of the slice's first row
  int valid;   // rows of the slice inside the expert (may be <= 0)
  int n0;      // first column of the tile (in accumulator columns)
  int n_idx;
  int lt, warp, lane;
};

__device__ __forceinline__ float row_scale_of(const EpilogueArgs& e, const SliceCoord& s, int h) {
  const int r = Fragment::row(s.warp, s.lane, h);
  return (e.row_scale != nullptr && r < s.valid) ? e.row_scale[s.slice0 + r] : 1.0f;
}

template <int kBN, class Store>
__device__ __forceinline__ void epilogue_plain(const float (&acc)[kBN / 2], const EpilogueArgs& e,
                                               const SliceCoord& s, const CUtensorMap* map_c, Store& store) {
  const float sc[2] = {row_scale_of(e, s, 0), row_scale_of(e, s, 1)};
#pragma unroll
  for (int box = 0; box < kBN / 64; ++box) {
    if (s.n0 + box * 64 >= e.c_cols) break;  // uniform over the warpgroup
    uint32_t v[8][2];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = box * 8 + jj;
        v[jj][h] = pack_bf16x2(acc[Fragment::reg(j, h, 0)] * sc[h], acc[Fragment::reg(j, h, 1)] * sc[h]);
      }
    store.emit(v, map_c, kOutputC, s.slice0, s.n0 + box * 64, e.c_cols);
  }
}

template <int kBN, class Store>
__device__ __forceinline__ void epilogue_swiglu(const float (&acc)[kBN / 2], const EpilogueArgs& e,
                                                const SliceCoord& s, const CUtensorMap* map_c,
                                                const CUtensorMap* map_aux, Store& store) {
  constexpr int kHalf = kBN / 2;       // activation columns of the tile
  constexpr int kUpGroup = kHalf / 8;  // first column group of the up half
  const int a0 = s.n_idx * kHalf;      // first activation column
  const float sc[2] = {row_scale_of(e, s, 0), row_scale_of(e, s, 1)};
#pragma unroll
  for (int box = 0; box < kHalf / 64; ++box) {
    uint32_t v[8][2];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int jg = box * 8 + jj, ju = jg + kUpGroup;
        v[jj][h] = pack_bf16x2(swiglu(acc[Fragment::reg(jg, h, 0)], acc[Fragment::reg(ju, h, 0)]) * sc[h],
                               swiglu(acc[Fragment::reg(jg, h, 1)], acc[Fragment::reg(ju, h, 1)]) * sc[h]);
      }
    store.emit(v, map_c, kOutputC, s.slice0, a0 + box * 64, e.c_cols);
  }
  if (e.aux.base == nullptr && e.aux.pointers == nullptr) return;
#pragma unroll
  for (int box = 0; box < kBN / 64; ++box) {
    uint32_t v[8][2];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = box * 8 + jj;
        v[jj][h] = pack_bf16x2(acc[Fragment::reg(j, h, 0)], acc[Fragment::reg(j, h, 1)]);
      }
    // Gate boxes land at the tile's activation columns, up boxes at the same columns of the up half.
    const int col = box < kHalf / 64 ? a0 + box * 64 : e.up_offset + a0 + (box - kHalf / 64) * 64;
    store.emit(v, map_aux, kOutputAux, s.slice0, col, e.aux_cols);
  }
}

// An h stage of the SwiGLU backward: the tile's gate columns as one 128-row box of 64 bf16 columns, its up
// columns in the next (as TileLoader::load_epilogue_boxes loads them); in place, w * a in a third.
inline constexpr int kHBoxBytes = 128 * 128;

// g and u of a fragment pair from an h stage: row r of the warpgroup's 64 rows, column group jj, the lane's pair,
// from the warpgroup's part of the gate box at `gate` (the up box kHBoxBytes further on). Returns the pair's byte
// offset within the box (where the in-place epilogue writes its outputs).
__device__ __forceinline__ int load_h_pair(const uint8_t* gate, int r, int jj, int lane, float (&g)[2],
                                           float (&u)[2]) {
  const int offset = box_chunk_offset(r, jj) + 4 * (lane & 3);
  const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(gate + offset);
  const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(gate + kHBoxBytes + offset);
  g[0] = __low2float(g2), g[1] = __high2float(g2);
  u[0] = __low2float(u2), u[1] = __high2float(u2);
  return offset;
}

// A fragment pair of the SwiGLU backward (columns c and c + 1 of one row; da unweighted, sc the row's weight):
// dh's gate and up parts and sc * a, each pair rounded to bf16x2. With kDot, `dot` gets da * a, column by column,
// so that the row's partial sums the same way every run.
struct SwiGLUGradPair {
  uint32_t dg, du, aw;
};
template <bool kDot>
__device__ __forceinline__ SwiGLUGradPair swiglu_grad_pair(const float (&da)[2], const float (&g)[2],
                                                           const float (&u)[2], float sc, float& dot) {
  float dg[2], du[2], aw[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const SwiGLUGrad grad = swiglu_backward(da[k] * sc, g[k], u[k]);
    dg[k] = grad.dg;
    du[k] = grad.du;
    aw[k] = grad.a * sc;
    if constexpr (kDot) dot += da[k] * grad.a;
  }
  return {pack_bf16x2(dg[0], dg[1]), pack_bf16x2(du[0], du[1]), pack_bf16x2(aw[0], aw[1])};
}

// The row partials of <da, a> over a tile's columns (the routing-weight gradient), from a consumer thread's two
// rows: the four lanes of a quad hold a row's columns, and a fixed butterfly sums them.
__device__ __forceinline__ void store_row_dots(float (&dot)[2], const EpilogueArgs& e, const SliceCoord& s) {
  if (e.dot_rows == nullptr) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 1);
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 2);
    const int r = Fragment::row(s.warp, s.lane, h);
    if ((s.lane & 3) == 0 && r < s.valid) {
      float* dst = e.dot_rows[s.slice0 + r];
      if (dst != nullptr) dst[s.n_idx] = dot[h];
    }
  }
}

// hstages: where the tile's h arrives, one stage per 64-column box, through the main-loop pipeline (the
// producer streams them in right after the tile's K stages, so their loads overlap the last K stages):
// acquire() waits for the next box's stage and returns it (gate columns of the tile's 128 rows in the
// first 16 KB, up columns in the next 16 KB, 128-byte swizzled as TMA writes them); release() hands it
// back once the warpgroup has read it.
template <int kBN, class Store, class HStages>
__device__ __forceinline__ void epilogue_swiglu_grad(const float (&acc)[kBN / 2], const EpilogueArgs& e,
                                                     const SliceCoord& s, int cwg, const CUtensorMap* map_c,
                                                     const CUtensorMap* map_aux, Store& store, HStages& hstages) {
  const int N = e.up_offset;  // activation width I (C = dh is 2N wide)
  const float sc[2] = {row_scale_of(e, s, 0), row_scale_of(e, s, 1)};
  // A row of the fragment is formed where it is used (Fragment::row is a shift and an add): kept through the
  // box loop, it costs a register the loop needs (it spilled in the fused backward).
  const bool has_aux = e.aux.base != nullptr || e.aux.pointers != nullptr;
  float dot[2] = {0.0f, 0.0f};
  // g and u of a fragment pair, from the box's stage: row cwg * 64 + r of the 128-row boxes, column group jj.
  auto load_gu = [&](const uint8_t* stage, int jj, int h, float (&g)[2], float (&u)[2]) {
    load_h_pair(stage + cwg * kBoxBytes, Fragment::row(s.warp, s.lane, h), jj, s.lane, g, u);
  };
  // With three staging slots to spare, dh, w * a and the dot products come out of one pass over the box
  // (one sigmoid per element); with fewer, a second pass recomputes a. Column groups go two at a time
  // straight into their boxes, so no output array of the box is held in registers.
  constexpr bool kOnePass = Store::kSlotCount >= 3;
#pragma unroll
  for (int box = 0; box < kBN / 64; ++box) {
    if (s.n0 + box * 64 >= N) break;  // uniform: N % 64 == 0
    const int col0 = s.n0 + box * 64;
    const uint8_t* stage = hstages.acquire();
    int b;
    if constexpr (kOnePass) {
      b = store.template reserve<3>();
    } else {
      b = store.template reserve<2>();
    }
#pragma unroll
    for (int jj = 0; jj < 8; jj += 2) {
      uint32_t vg[2][2], vu[2][2], va[2][2];
#pragma unroll
      for (int d = 0; d < 2; ++d)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float g[2], u[2];
          load_gu(stage, jj + d, h, g, u);
          const int j = box * 8 + jj + d;
          const SwiGLUGradPair out = swiglu_grad_pair<kOnePass>(
              {acc[Fragment::reg(j, h, 0)], acc[Fragment::reg(j, h, 1)]}, g, u, sc[h], dot[h]);
          vg[d][h] = out.dg;
          vu[d][h] = out.du;
          va[d][h] = out.aw;
        }
      store.stage_pair(b, jj, vg);
      store.stage_pair(b + 1, jj, vu);
      if constexpr (kOnePass) store.stage_pair(b + 2, jj, va);
    }
    store.commit(b, map_c, kOutputC, s.slice0, col0, 2 * N);
    store.commit(b + 1, map_c, kOutputC, s.slice0, N + col0, 2 * N);
    if constexpr (kOnePass) {
      if (has_aux) store.commit(b + 2, map_aux, kOutputAux, s.slice0, col0, e.aux_cols);
    } else if (has_aux || e.dot_rows != nullptr) {
      const int ba = store.template reserve<1>();
#pragma unroll
      for (int jj = 0; jj < 8; jj += 2) {
        uint32_t va[2][2];
#pragma unroll
        for (int d = 0; d < 2; ++d)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float g[2], u[2], aw[2];
            load_gu(stage, jj + d, h, g, u);
#pragma unroll
            for (int k = 0; k < 2; ++k) {
              const float a = swiglu(g[k], u[k]);
              aw[k] = a * sc[h];
              dot[h] += acc[Fragment::reg(box * 8 + jj + d, h, k)] * a;
            }
            va[d][h] = pack_bf16x2(aw[0], aw[1]);
          }
        if (has_aux) store.stage_pair(ba, jj, va);
      }
      if (has_aux) store.commit(ba, map_aux, kOutputAux, s.slice0, col0, e.aux_cols);
    }
    hstages.release();
  }
  store_row_dots(dot, e, s);
}

// The SwiGLU backward with its outputs written over the h stage they come from (the 256-wide configurations,
// which give their staging slots up for a fourth stage: grouped_gemm_kernel.cuh, fused_items.cuh). Each thread
// reads g and u of its fragment pairs and writes dh's gate and up parts in their place and w * a into the
// stage's free last third (the same 128-byte-swizzled 64 x 64 boxes per warpgroup that stmatrix would stage),
// so that a box's three outputs leave at once (one bulk group) and the next box's arithmetic runs while TMA
// reads them; hstages.release_sent() hands the stage back once they have left (EpilogueStagesInPlace). The same
// values as epilogue_swiglu_grad, in the same order.
template <int kBN, class Store, class HStages>
__device__ __forceinline__ void epilogue_swiglu_grad_in_place(const float (&acc)[kBN / 2], const EpilogueArgs& e,
                                                              const SliceCoord& s, int cwg, const CUtensorMap* map_c,
                                                              const CUtensorMap* map_aux, Store& store,
                                                              HStages& hstages) {
  const int N = e.up_offset;
  const float sc[2] = {row_scale_of(e, s, 0), row_scale_of(e, s, 1)};
  const bool has_aux = e.aux.base != nullptr || e.aux.pointers != nullptr;
  float dot[2] = {0.0f, 0.0f};
#pragma unroll
  for (int box = 0; box < kBN / 64; ++box) {
    if (s.n0 + box * 64 >= N) break;  // uniform: N % 64 == 0
    const int col0 = s.n0 + box * 64;
    uint8_t* const gate = hstages.acquire() + cwg * kBoxBytes;  // this warpgroup's 64 rows of the gate box
    uint8_t* const up = gate + kHBoxBytes;
    uint8_t* const aw = gate + 2 * kHBoxBytes;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float g[2], u[2];
        const int offset = load_h_pair(gate, Fragment::row(s.warp, s.lane, h), jj, s.lane, g, u);
        const int j = box * 8 + jj;
        const SwiGLUGradPair out = swiglu_grad_pair<true>({acc[Fragment::reg(j, h, 0)], acc[Fragment::reg(j, h, 1)]},
                                                          g, u, sc[h], dot[h]);
        *reinterpret_cast<uint32_t*>(gate + offset) = out.dg;
        *reinterpret_cast<uint32_t*>(up + offset) = out.du;
        *reinterpret_cast<uint32_t*>(aw + offset) = out.aw;
      }
    store.publish();
    store.send(gate, map_c, kOutputC, s.slice0, col0, 2 * N);
    store.send(up, map_c, kOutputC, s.slice0, N + col0, 2 * N);
    if (has_aux) store.send(aw, map_aux, kOutputAux, s.slice0, col0, e.aux_cols);
    store.sent();
    hstages.release_sent(store.tma_slice);
  }
  hstages.finish();
  store_row_dots(dot, e, s);
}

// One pass of the fp32 epilogues: the warpgroup's 64 rows x 32 columns (columns 32 pass ..) of the
// accumulators into a 128-byte-swizzled staging box of 64 rows x 128 bytes (16-byte chunk col / 4 of the row,
// box_chunk_offset).
template <int kBN>
__device__ __forceinline__ void stage_fp32_pass(const float (&acc)[kBN / 2], int pass, uint8_t* staging, int lt) {
  const int warp = lt >> 5, lane = lt & 31, q = lane & 3;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int j = pass * 4 + jj;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = Fragment::row(warp, lane, h);
      *reinterpret_cast<float2*>(staging + box_chunk_offset(row, 2 * jj + (q >> 1)) + 8 * (q & 1)) =
          make_float2(acc[Fragment::reg(j, h, 0)], acc[Fragment::reg(j, h, 1)]);
    }
  }
}

// Where pass `pass` (32 accumulator columns) of a tile goes in C: column n0 + 32 pass (TileColumns), or for a
// gate-up tile of the FP8 GEMM1 (its first half gate channels, its second half the same channels' up values:
// epilogues/swiglu_fp8.cuh) the gate half from column gate0 and the up half from column up0 (GateUpColumns).
struct TileColumns {
  int n0;
  __device__ __forceinline__ int of(int pass) const { return n0 + 32 * pass; }
};
template <int kBN>
struct GateUpColumns {
  int gate0, up0;
  __device__ __forceinline__ int of(int pass) const {
    constexpr int kHalfPasses = kBN / 64;
    return pass < kHalfPasses ? gate0 + 32 * pass : up0 + 32 * (pass - kHalfPasses);
  }
};

// fp32 C through TMA (the warpgroup's whole 64-row slice inside a contiguous C): per pass of 32 columns one
// staging box of the BoxStore (stage_fp32_pass's layout is the 128-byte swizzle of `map`, an fp32 map with
// boxes of 32 columns x 64 rows), stored asynchronously as epilogue_plain's boxes are. Columns past N are
// clipped by TMA; passes wholly past them are skipped. Bitwise the values epilogue_fp32 stores.
template <int kBN, class Store, class Columns = TileColumns>
__device__ __forceinline__ void epilogue_fp32_tma(const float (&acc)[kBN / 2], const CUtensorMap* map, int N,
                                                  int slice0, Columns columns, Store& store) {
#pragma unroll
  for (int pass = 0; pass < kBN / 32; ++pass) {
    const int col = columns.of(pass);
    if (col >= N) break;  // uniform over the warpgroup
    const int box = store.template reserve<1>();
    stage_fp32_pass<kBN>(acc, pass, store.staging + (box % Store::kSlotCount) * kBoxBytes, store.lt);
    store.commit(box, map, kOutputC, slice0, col, N);
  }
}
template <int kBN, class Store>
__device__ __forceinline__ void epilogue_fp32_tma(const float (&acc)[kBN / 2], const CUtensorMap* map, int N,
                                                  int slice0, int n0, Store& store) {
  epilogue_fp32_tma<kBN>(acc, map, N, slice0, TileColumns{n0}, store);
}

// The output C[m, n] of a K-grouped tile (m0: first row of the warpgroup's slice of C), M x N, fp32 or bf16
// (Out), through one staging box per pass of 32 columns; accumulate adds to the existing value (one rounding,
// no atomics: every element has one owner).
template <int kBN, class Columns = TileColumns, class Out = float>
__device__ __forceinline__ void epilogue_fp32(const float (&acc)[kBN / 2], Out* C, int M, int N, int m0,
                                              Columns columns, bool accumulate, uint8_t* staging, int bar_id,
                                              int lt) {
#pragma unroll
  for (int pass = 0; pass < kBN / 32; ++pass) {
    if (columns.of(pass) >= N) break;  // uniform over the warpgroup
    stage_fp32_pass<kBN>(acc, pass, staging, lt);
    named_barrier_sync(bar_id, 128);
    for_each_box_chunk(lt, [&](int row, int chunk, int offset) {
      const int col = columns.of(pass) + chunk * 4;
      const int m = m0 + row;
      if (m < M && col < N) {
        store_output4(C + static_cast<int64_t>(m) * N + col, *reinterpret_cast<const float4*>(staging + offset),
                      accumulate);
      }
    });
    named_barrier_sync(bar_id, 128);
  }
}
template <int kBN, class Out>
__device__ __forceinline__ void epilogue_fp32(const float (&acc)[kBN / 2], Out* C, int M, int N, int m0, int n0,
                                              bool accumulate, uint8_t* staging, int bar_id, int lt) {
  epilogue_fp32<kBN, TileColumns, Out>(acc, C, M, N, m0, TileColumns{n0}, accumulate, staging, bar_id, lt);
}

// The same tile stored transposed (C is [N, M] and gets C[n, m] = acc(m, n), the values epilogue_fp32 stores),
// straight from the fragment, without staging: a warp's store writes four rows n of C (the tile's columns in
// the lanes' pair slots), eight consecutive m in each, one 32-byte sector apiece (fp32; half of one for bf16,
// Out). Short code and no barriers: the weight gradients' loops lost 7-11% (FP8, docs/PERF.md run 136) and
// 4-6% (bf16, run 160) to a staged form.
template <int kBN, bool kAccumulate, class Out>
__device__ __forceinline__ void store_fp32_transposed_direct(const float (&acc)[kBN / 2], Out* C, int M, int N,
                                                             int m0, int n0, int lt) {
  const int warp = lt >> 5, lane = lt & 31;
  const int64_t column_step = static_cast<int64_t>(M);  // one column of the tile: the next row of C
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + Fragment::row(warp, lane, h);
    if (m >= M) continue;
    Out* const first = C + static_cast<int64_t>(n0 + Fragment::col(lane, 0)) * column_step + m;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      if (n0 + 8 * j >= N) break;  // N is a multiple of 8: a column group is whole or past the end
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        store_output(first + (8 * j + e) * column_step, acc[Fragment::reg(j, h, e)], kAccumulate);
      }
    }
  }
}
template <int kBN, class Out>
__device__ __forceinline__ void epilogue_fp32_transposed_direct(const float (&acc)[kBN / 2], Out* C, int M, int N,
                                                                int m0, int n0, bool accumulate, int lt) {
  if (accumulate) {
    store_fp32_transposed_direct<kBN, true>(acc, C, M, N, m0, n0, lt);
  } else {
    store_fp32_transposed_direct<kBN, false>(acc, C, M, N, m0, n0, lt);
  }
}

}  // namespace megamoe::device
