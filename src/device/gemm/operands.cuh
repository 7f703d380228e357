// The producer side of the main loop: filling one pipeline stage with the A and B operand tiles of a work
// item, through TMA boxes or, for operands whose rows are gathered by index (rows of a receive buffer in
// expert order, for instance), through the producer warpgroup's 128 threads with cp.async, written in the
// same 128-byte-swizzled layout TMA produces.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/cp_async.cuh"
#include "device/ptx/tma.cuh"
#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

inline constexpr int kProducerThreads = 128;
inline constexpr uint16_t kClusterPairMask = 0x3;

// An operand whose row r is row index[r] of `base` (index values are clamped into [0, source_rows)).
struct GatherOperand {
  const __nv_bfloat16* base;
  int64_t ld;              // elements between source rows
  const int32_t* index;    // nullptr: the operand goes through TMA instead
  int source_rows;
  int cols;                // the source's width: columns at or past it load as zeros
};

// Rows of a [source_rows, cols] bf16 matrix gathered through `rows`; no rows: a TMA operand (all zero).
inline GatherOperand gathered_rows(const __nv_bfloat16* base, int64_t cols, const int32_t* rows, int64_t source_rows) {
  if (rows == nullptr) return GatherOperand{};
  return GatherOperand{base, cols, rows, static_cast<int>(source_rows), static_cast<int>(cols)};
}

__device__ __forceinline__ int gather_row(const GatherOperand& g, int r) {
  return min(max(g.index[r], 0), max(g.source_rows - 1, 0));
}

// K-major tile of 128 rows x 64 columns gathered by index: thread t copies 16-byte piece t % 8 of rows
// t / 8 + 16 i (a warp covers four whole 128-byte row segments per instruction). The source rows are
// looked up once per tile.
struct GatheredKMajorTile {
  static constexpr int kRowsPerThread = 128 / 16;
  int src[kRowsPerThread];  // source row, or -1: zero-fill (past the tile's valid rows)

  __device__ __forceinline__ void prepare(const GatherOperand& g, int row0, int valid, int ptid) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = (ptid >> 3) + 16 * i;
      src[i] = r < valid ? gather_row(g, row0 + r) : -1;
    }
  }
  __device__ __forceinline__ void load(uint32_t dst, const GatherOperand& g, int k0, int ptid) const {
    const int piece = ptid & 7;
    const int col = k0 + 8 * piece;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = (ptid >> 3) + 16 * i;
      const bool valid = src[i] >= 0 && col < g.cols;
      const __nv_bfloat16* from = valid ? g.base + static_cast<int64_t>(src[i]) * g.ld + col : g.base;
      cp_async_16(dst + r * 128 + ((piece ^ (r & 7)) << 4), from, valid);
    }
  }
};

// MN-major stages gathered by index: a stage holds 64 reduction rows x kWidth columns (kWidth / 64 boxes of
// 64 x 64). Thread t copies piece t % 8 of rows t / 8 + 16 i, i = 0..3, in every box. The source rows of a
// stage are looked up two stages ahead, so that the index loads' latency is not paid stage after stage.
struct GatheredMnRows {
  static constexpr int kLookahead = 2;
  int now[4], next[4], after[4];  // raw indices of this thread's rows of the next three stages; -1 = none

  __device__ __forceinline__ void lookup(const GatherOperand& g, int first, int valid, int ptid, int (&out)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = (ptid >> 3) + 16 * i;
      out[i] = r < valid ? g.index[first + r] : -1;
    }
  }
  // Stage kt of the tile covers operand rows [row0 + 64 kt, ...) of which rows - 64 kt are the expert's.
  __device__ __forceinline__ void begin(const GatherOperand& g, int row0, int rows, int ptid) {
    lookup(g, row0, rows, ptid, now);
    lookup(g, row0 + 64, rows - 64, ptid, next);
  }
  // Issues stage kt's copies (the stage begin() or the previous advance() looked up) and the lookup of
  // stage kt + 2.
  template <int kWidth>
  __device__ __forceinline__ void load(uint32_t dst, const GatherOperand& g, int row0, int rows, int kt, int col0,
                                       int ptid) {
    lookup(g, row0 + (kt + kLookahead) * 64, rows - (kt + kLookahead) * 64, ptid, after);
    const int piece = ptid & 7;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = (ptid >> 3) + 16 * i;
      const int src = now[i] >= 0 ? min(now[i], max(g.source_rows - 1, 0)) : -1;
#pragma unroll
      for (int box = 0; box < kWidth / 64; ++box) {
        const int col = col0 + box * 64 + 8 * piece;
        const bool ok = src >= 0 && col < g.cols;
        const __nv_bfloat16* from = ok ? g.base + static_cast<int64_t>(src) * g.ld + col : g.base;
        cp_async_16(dst + box * kBoxBytes + r * 128 + ((piece ^ (r & 7)) << 4), from, ok);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      now[i] = next[i];
      next[i] = after[i];
    }
  }
};

// Everything the producer needs to fill stages; one per kernel, by value.
struct OperandSources {
  GatherOperand a;     // a.index == nullptr: A through TMA
  GatherOperand b;     // K-grouped form only: b.index == nullptr: B through TMA
  int b_row_step;      // kNT: B panel of n-tile n starts at row n * b_row_step ...
  int b_half_offset;   // ... and its second half at that + b_half_offset (SwiGLU: gate rows, then up rows)
};

// Fills stages for one work item. `thread` 0 of the producer warpgroup posts the TMA transaction count and
// issues the TMA boxes; with gathered operands every producer thread copies its pieces and arrives when
// they have landed (the full barrier counts 1 + 128 arrivals then).
template <class Shape, bool kGatherA, bool kGatherB>
struct TileLoader {
  static_assert(!kGatherB || Shape::kKGrouped, "B is gathered in the K-grouped form only");
  static_assert(!(kGatherA || kGatherB) || Shape::kCluster == 1, "gathered operands are not multicast");
  static constexpr bool kGathers = kGatherA || kGatherB;
  static constexpr int kFullArrivals = 1 + (kGathers ? kProducerThreads : 0);
  static constexpr uint32_t kTmaBytes =
      (kGatherA ? 0u : static_cast<uint32_t>(Shape::kABytes)) + (kGatherB ? 0u : static_cast<uint32_t>(Shape::kBBytes));

  const CUtensorMap* map_a;
  const CUtensorMap* map_b;
  OperandSources src;
  GatheredKMajorTile rows_a;  // kGatherA, M-grouped forms
  GatheredMnRows mn_a, mn_b;  // K-grouped form

  __device__ __forceinline__ void begin_tile(const TileCoord& tile, int ptid) {
    if constexpr (kGatherA && !Shape::kKGrouped) rows_a.prepare(src.a, tile.row0, tile.rows, ptid);
    if constexpr (kGatherA && Shape::kKGrouped) mn_a.begin(src.a, tile.row0, tile.rows, ptid);
    if constexpr (kGatherB) mn_b.begin(src.b, tile.row0, tile.rows, ptid);
  }

  __device__ __forceinline__ void load(const StagePipeline<Shape::kStages>& pipe, const PipeState<Shape::kStages>& st,
                                       uint8_t* stage, const TileCoord& tile, int kt, int ptid, int rank) {
    uint8_t* sa = stage;
    uint8_t* sb = stage + Shape::kABytes;
    uint64_t* bar = pipe.full_barrier(st);
    const int k0 = kt * Shape::kBK;
    const int n0 = tile.n_idx * Shape::kBN;
    if (ptid == 0) {
      pipe.producer_expect_tx(st, kTmaBytes);
      if constexpr (Shape::kForm == GemmForm::kTN) {
        const int m0 = tile.m_idx * Shape::kBM;
        const int r = tile.row0 + k0;
        if constexpr (!kGatherA) {
#pragma unroll
          for (int c = 0; c < Shape::kBM / 64; ++c) tma_load_2d(sa + c * kBoxBytes, map_a, m0 + c * 64, r, bar);
        }
        if constexpr (!kGatherB) {
#pragma unroll
          for (int c = 0; c < Shape::kBN / 64; ++c) {
            if constexpr (Shape::kCluster == 1) {
              tma_load_2d(sb + c * kBoxBytes, map_b, n0 + c * 64, r, bar);
            } else if (c / (Shape::kBN / 64 / Shape::kCluster) == rank) {
              tma_load_2d_multicast(sb + c * kBoxBytes, map_b, n0 + c * 64, r, bar, kClusterPairMask);
            }
          }
        }
      } else {
        if constexpr (!kGatherA) tma_load_2d(sa, map_a, k0, tile.row0, bar);
        if constexpr (Shape::kForm == GemmForm::kNT) {
          // Two half panels of BN / 2 rows; in a 2-CTA cluster each CTA loads (and multicasts) one.
          const int row = tile.n_idx * src.b_row_step;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            uint8_t* dst = sb + half * (Shape::kBBytes / 2);
            const int brow = row + half * src.b_half_offset;
            if constexpr (Shape::kCluster == 1) {
              tma_load_3d(dst, map_b, k0, brow, tile.e, bar);
            } else if (half == rank) {
              tma_load_3d_multicast(dst, map_b, k0, brow, tile.e, bar, kClusterPairMask);
            }
          }
        } else {
#pragma unroll
          for (int c = 0; c < Shape::kBN / 64; ++c) {
            if constexpr (Shape::kCluster == 1) {
              tma_load_3d(sb + c * kBoxBytes, map_b, n0 + c * 64, k0, tile.e, bar);
            } else if (c / (Shape::kBN / 64 / Shape::kCluster) == rank) {
              tma_load_3d_multicast(sb + c * kBoxBytes, map_b, n0 + c * 64, k0, tile.e, bar, kClusterPairMask);
            }
          }
        }
      }
    }
    if constexpr (kGathers) {
      if constexpr (Shape::kKGrouped) {
        if constexpr (kGatherA)
          mn_a.template load<Shape::kBM>(smem_addr(sa), src.a, tile.row0, tile.rows, kt, tile.m_idx * Shape::kBM, ptid);
        if constexpr (kGatherB) mn_b.template load<Shape::kBN>(smem_addr(sb), src.b, tile.row0, tile.rows, kt, n0, ptid);
      } else {
        rows_a.load(smem_addr(sa), src.a, k0, ptid);
      }
      pipe.producer_commit_copies(st);
    }
  }

  // An epilogue input streamed through the ring after the tile's K stages: the boxes of 64 columns x 128
  // rows at (col_lo, row0) and (col_hi, row0) of `map` into the first two box areas of the stage (every
  // stage holds at least 32 KB). Every producer thread arrives, so the stage counts its usual arrivals.
  __device__ __forceinline__ void load_epilogue_boxes(const StagePipeline<Shape::kStages>& pipe,
                                                      const PipeState<Shape::kStages>& st, uint8_t* stage,
                                                      const CUtensorMap* map, int col_lo, int col_hi, int row0,
                                                      int ptid) const {
    static_assert(Shape::kStageBytes >= 2 * Shape::kABytes, "two 128-row boxes per stage");
    if (ptid == 0) {
      uint64_t* bar = pipe.full_barrier(st);
      pipe.producer_expect_tx(st, 2 * Shape::kABytes);
      tma_load_2d(stage, map, col_lo, row0, bar);
      tma_load_2d(stage + Shape::kABytes, map, col_hi, row0, bar);
    }
    if constexpr (kGathers) mbarrier_arrive(pipe.full_barrier(st));
  }
};

}  // namespace megamoe::device
