// The work items of two chained M-grouped GEMMs over the same expert-major rows (the fused forward: GEMM1
// h = x W13^T with SwiGLU, then GEMM2 y = a W2^T on GEMM1's output), numbered in waves of experts: GEMM1 of
// expert e, then GEMM2 of expert e - lag, then GEMM1 of e + 1, ... So the tensor cores never wait for a
// whole phase to end: while the GEMM1 tiles of later experts run, the GEMM2 tiles of earlier ones (whose
// rows GEMM1 has finished) become ready. Every item depends only on items numbered before it (GEMM2 of an
// expert follows all its GEMM1 items), so CTAs that take items in increasing order never wait on an item
// nobody has taken.
//
// Both GEMMs share the row numbering: 128-row blocks numbered over the experts in order (block_start), the
// block of a tile being the counter index of its readiness gate. Within an expert's segment the tiles go
// in bands (band_position), as in GroupedTiles.
#pragma once

#include <cstdint>

#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

template <int kMaxExperts>
struct ExpertWaves {
  static constexpr int kBM = 128;
  static constexpr int kBandM = 16;

  // The numbering's parameters live in shared memory with its tables, so that a role walking the items holds
  // one pointer, not a register per parameter, through its main loops.
  struct Storage {
    int offsets[kMaxExperts + 1];       // expert-major row offsets
    int block_start[kMaxExperts + 1];   // first 128-row block of each expert
    int seg_start[2 * kMaxExperts + 1]; // first item of each segment
    int seg_owner[2 * kMaxExperts];     // segment -> 2 * expert + gemm
    int experts;
    int n_tiles[2];  // n-tiles of GEMM1 (SwiGLU: one tile covers BN/2 gate and BN/2 up columns) and GEMM2
    int k_tiles[2];  // 64-deep K stages of each GEMM
  };

  Storage* s;

  __device__ int n_tiles_of(int g) const { return s->n_tiles[g]; }
  __device__ int k_tiles_of(int g) const { return s->k_tiles[g]; }

  // All threads of the block. offsets: E + 1 nondecreasing row offsets (shared or global memory); GEMM2 of
  // expert e comes after GEMM1 of expert e + lag. Contains __syncthreads().
  __device__ void build(const int32_t* offsets, int experts, int n_tiles0, int n_tiles1, int k_tiles0, int k_tiles1,
                        int lag, int tid, int threads) const {
    for (int i = tid; i <= experts; i += threads) s->offsets[i] = offsets[i];
    if (tid == 0) {
      s->experts = experts;
      s->n_tiles[0] = n_tiles0;
      s->n_tiles[1] = n_tiles1;
      s->k_tiles[0] = k_tiles0;
      s->k_tiles[1] = k_tiles1;
    }
    __syncthreads();
    if (tid == 0) {
      int blocks = 0;
      for (int e = 0; e < experts; ++e) {
        s->block_start[e] = blocks;
        blocks += m_tiles(e);
      }
      s->block_start[experts] = blocks;
      int seg = 0, items = 0;
      auto add = [&](int e, int g) {
        s->seg_start[seg] = items;
        s->seg_owner[seg] = 2 * e + g;
        items += m_tiles(e) * n_tiles_of(g);
        ++seg;
      };
      for (int step = 0; step < experts + lag; ++step) {
        if (step < experts) add(step, 0);
        if (step - lag >= 0) add(step - lag, 1);
      }
      s->seg_start[seg] = items;
    }
    __syncthreads();
  }

  __device__ int m_tiles(int e) const { return (max(s->offsets[e + 1] - s->offsets[e], 0) + kBM - 1) / kBM; }
  __device__ int total() const { return s->seg_start[2 * s->experts]; }
  // The same, read from shared memory at this point of the program (never kept in a register).
  __device__ int total_now() const {
    const int experts = *reinterpret_cast<const volatile int*>(&s->experts);
    return *reinterpret_cast<const volatile int*>(&s->seg_start[2 * experts]);
  }

  // The 128-row block of expert e's row `row`, read from shared memory at this point (a caller that needs a
  // tile's block long after decoding it need not hold it in a register).
  __device__ int block_of(int e, int row) const { return s->block_start[e] + (row - s->offsets[e]) / kBM; }

  // Item t -> which GEMM (0, 1) and its tile (rows, K stages, row block).
  __device__ TileCoord decode(int t, int* gemm) const {
    int lo = 0, hi = 2 * s->experts;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (s->seg_start[mid] <= t) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int owner = s->seg_owner[lo];
    const int g = owner & 1;
    TileCoord tile;
    tile.e = owner >> 1;
    band_position<kBandM, 1>(t - s->seg_start[lo], m_tiles(tile.e), n_tiles_of(g), 0, tile.m_idx, tile.n_idx);
    const int off = s->offsets[tile.e];
    tile.row0 = off + tile.m_idx * kBM;
    tile.rows = min(kBM, s->offsets[tile.e + 1] - tile.row0);
    tile.k_tiles = k_tiles_of(g);
    tile.m_block = s->block_start[tile.e] + tile.m_idx;
    *gemm = g;
    return tile;
  }
};

}  // namespace megamoe::device
