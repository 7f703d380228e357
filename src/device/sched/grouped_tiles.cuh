// The work items of a grouped GEMM, numbered on the device from the per-expert row offsets (which stay on
// the device: no host synchronisation), and the decoding of an item number into a tile. Every role of a
// CTA decodes the same numbers the same way, so a scheduler only has to hand out numbers.
//
// M-grouped forms (C rows are the expert's rows): an item is (expert, m-tile, n-tile) over the expert's
// rows. K-grouped form (the expert's rows are the reduction): an item is (expert, m-tile, n-tile) of the
// expert's own [M, N] output. With a 2-CTA cluster an item is a pair of vertically adjacent m-tiles
// sharing the B panel; CTA `rank` takes m-tile 2u + rank (possibly past the expert's last one: it then
// computes on rows it never stores and still loads its half of B).
#pragma once

#include <cstdint>

namespace megamoe::device {

inline constexpr int kMaxGroups = 1024;

struct TileCoord {
  int e;        // expert
  int m_idx;    // m-tile within the expert (M-grouped: over its rows; K-grouped: over M)
  int n_idx;    // n-tile
  int row0;     // M-grouped: first row of the tile; K-grouped: first row of the expert
  int rows;     // M-grouped: valid rows of the tile (<= BM); K-grouped: rows of the expert (reduction length)
  int k_tiles;  // BK-deep stages of the reduction
  int m_block;  // M-grouped: the tile's row block numbered over all experts (readiness counters); else 0
};

// Within an expert, tiles go in bands of kBandM m-tiles, m fastest inside a band: the CTAs running at the
// same time cover about kBandM x (grid / kBandM) tiles, so their A and B panels are shared in L2. Item
// `local` of an expert's m_tiles x n_tiles items (in cluster units of kCluster m-tiles; CTA `rank` of the
// cluster) is the tile (m_idx, n_idx).
template <int kBandM, int kCluster>
__device__ __forceinline__ void band_position(int local, int m_tiles, int n_tiles, int rank, int& m_idx, int& n_idx) {
  const int m_units = (m_tiles + kCluster - 1) / kCluster;
  constexpr int kBandU = kBandM / kCluster;
  const int band = local / (kBandU * n_tiles);
  const int in_band = local - band * (kBandU * n_tiles);
  const int band_h = min(kBandU, m_units - band * kBandU);
  n_idx = in_band / band_h;
  m_idx = (band * kBandU + (in_band - n_idx * band_h)) * kCluster + rank;
}

template <int kBM, int kBN, int kBK, int kCluster, bool kKGrouped>
struct GroupedTiles {
  static constexpr int kBandM = 16;  // band_position

  struct Storage {
    int offsets[kMaxGroups + 1];     // row offsets, clamped into [0, max_rows]
    int tile_start[kMaxGroups + 1];  // first item of each numbering position
    // K-grouped: the expert at each numbering position (identity unless longest-first). M-grouped: the
    // first row block of each expert (the numbering order is the expert order there).
    int per_position[kMaxGroups + 1];
  };

  Storage* s;
  int num_groups;
  int n_tiles;
  int M;  // K-grouped: rows of each expert's output
  int K;  // M-grouped: reduction length

  __device__ int total() const { return s->tile_start[num_groups]; }
  // The same, read from shared memory at this point of the program (never kept in a register).
  __device__ int total_now() const { return *reinterpret_cast<const volatile int*>(&s->tile_start[num_groups]); }
  __device__ int expert_at(int pos) const { return kKGrouped ? s->per_position[pos] : pos; }

  // All threads of the block. longest_first (K-grouped, dynamic scheduling): the experts with the most rows,
  // the longest items, are numbered first so that short items fill the tail (greedy longest-processing-time
  // order); ties keep the expert order. Contains __syncthreads().
  __device__ void build(const int32_t* group_offsets, int max_rows, bool longest_first, int tid, int threads) const {
    const int E = num_groups;
    // Clamped, so that a bad table can never send a load or a store out of the buffers; a decreasing pair
    // reads as an empty expert.
    for (int i = tid; i <= E; i += threads) s->offsets[i] = min(max(group_offsets[i], 0), max_rows);
    __syncthreads();
    for (int i = tid; i < E && kKGrouped; i += threads) {
      int pos = i;
      if (longest_first) {
        const int rows_i = max(s->offsets[i + 1] - s->offsets[i], 0);
        pos = 0;
        for (int f = 0; f < E; ++f) {
          const int rows_f = max(s->offsets[f + 1] - s->offsets[f], 0);
          pos += (rows_f > rows_i || (rows_f == rows_i && f < i)) ? 1 : 0;
        }
      }
      s->per_position[pos] = i;
    }
    __syncthreads();
    if (tid < 32) {
      // Prefix sums over the numbering order: warp 0 scans 32 positions at a time.
      int carry = 0, block_carry = 0;
      const int m_tiles_k = (M + kBM - 1) / kBM;
      for (int base = 0; base < E; base += 32) {
        const int pos = base + tid;
        int count = 0, blocks = 0;
        if (pos < E) {
          const int e = expert_at(pos);
          const int lo = s->offsets[e];
          const int hi = max(s->offsets[e + 1], lo);
          const int m_tiles = kKGrouped ? m_tiles_k : (hi - lo + kBM - 1) / kBM;
          count = ((m_tiles + kCluster - 1) / kCluster) * n_tiles;
          blocks = kKGrouped ? 0 : m_tiles;
        }
        int incl = count, incl_blocks = blocks;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, d);
          const int vb = __shfl_up_sync(0xffffffffu, incl_blocks, d);
          if (tid >= d) {
            incl += v;
            incl_blocks += vb;
          }
        }
        if (pos < E) s->tile_start[pos] = carry + incl - count;
        if (pos < E && !kKGrouped) s->per_position[pos] = block_carry + incl_blocks - blocks;
        carry += __shfl_sync(0xffffffffu, incl, 31);
        block_carry += __shfl_sync(0xffffffffu, incl_blocks, 31);
      }
      if (tid == 0) {
        s->tile_start[E] = carry;
        if (!kKGrouped) s->per_position[E] = block_carry;
      }
    }
    __syncthreads();
  }

  __device__ TileCoord decode(int t, int rank) const {
    int lo = 0, hi = num_groups;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (s->tile_start[mid] <= t) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    TileCoord tile;
    tile.e = expert_at(lo);
    const int off = s->offsets[tile.e];
    const int rows_e = s->offsets[tile.e + 1] - off;
    const int m_tiles = kKGrouped ? (M + kBM - 1) / kBM : (rows_e + kBM - 1) / kBM;
    band_position<kBandM, kCluster>(t - s->tile_start[lo], m_tiles, n_tiles, rank, tile.m_idx, tile.n_idx);
    if constexpr (kKGrouped) {
      tile.row0 = off;
      tile.rows = rows_e;
      tile.k_tiles = max((rows_e + kBK - 1) / kBK, 0);
      tile.m_block = 0;
    } else {
      tile.row0 = off + tile.m_idx * kBM;
      tile.rows = min(kBM, rows_e - tile.m_idx * kBM);
      tile.k_tiles = (K + kBK - 1) / kBK;
      tile.m_block = s->per_position[lo] + tile.m_idx;
    }
    return tile;
  }
};

}  // namespace megamoe::device
