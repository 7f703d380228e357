// The stores of a bf16 epilogue: a consumer warpgroup's output leaves in boxes of 64 rows x 64 columns. A box
// is packed from the accumulator fragment into a shared-memory staging box (stmatrix, 16-byte chunks
// XOR-swizzled by row: conflict-free, and exactly the 128-byte swizzle of a TMA box), then leaves either
//   * through TMA (one thread, asynchronous: the epilogue does not wait for its own stores, they drain while
//     the next tile's main loop runs; boxes sent from an input's stage are waited for before the stage goes
//     back), when every row of the slice is a row of a contiguous output, or
//   * through the threads, as 16-byte row-contiguous stores to a destination address per row: a row of a
//     contiguous output, a scattered row index, or a row pointer (a peer's buffer, for instance).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/ptx/mbarrier.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/tma.cuh"

namespace megamoe::device {

inline constexpr int kBoxBytes = 64 * 128;  // 64 rows x 64 bf16

__device__ __forceinline__ int box_read_row(int lt) { return lt >> 3; }
__device__ __forceinline__ int box_read_chunk(int lt) { return lt & 7; }
// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a staging box: the 128-byte swizzle of TMA.
__device__ __forceinline__ int box_chunk_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// A warpgroup's read-out of a staging box by its threads: thread lt takes chunk box_read_chunk(lt) of rows
// box_read_row(lt) + 16 it (it < 4), so that eight threads carry a row and each row leaves as whole 128-byte
// lines. f(row, chunk, offset of the chunk in the box).
template <class F>
__device__ __forceinline__ void for_each_box_chunk(int lt, F&& f) {
  const int chunk = box_read_chunk(lt);
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int row = box_read_row(lt) + 16 * it;
    f(row, chunk, box_chunk_offset(row, chunk));
  }
}

// The stmatrix.x4 address of lane `lt` of a warpgroup for column groups jj and jj + 1 (8 bf16 columns each)
// of box `box` (rows 0-7 | 8-15 of its warp x the two groups), at staging_s.
__device__ __forceinline__ uint32_t staged_pair_address(uint32_t staging_s, int box, int jj, int lt) {
  const int warp = lt >> 5, lane = lt & 31;
  const int sm_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
  return staging_s + box * kBoxBytes + box_chunk_offset(sm_row, jj + (lane >> 4));
}

// How an output's rows are addressed, by the source row of the tile (its A row).
struct OutputRows {
  __nv_bfloat16* base;
  int64_t ld;                 // elements between rows
  const int32_t* scatter;     // optional: destination row per source row, -1 = dropped
  void* const* pointers;      // optional: destination address per source row, nullptr = dropped (wins over
                              // base and scatter)

  // Destination of read-back row `local` of the slice that starts at source row `slice0` (of which the
  // first `valid` rows exist), or nullptr.
  __device__ __forceinline__ __nv_bfloat16* row_of(int slice0, int valid, int local) const {
    if (local >= valid) return nullptr;
    const int src = slice0 + local;
    if (pointers != nullptr) return static_cast<__nv_bfloat16*>(pointers[src]);
    const int64_t d = scatter != nullptr ? scatter[src] : src;
    return d >= 0 ? base + d * ld : nullptr;
  }
};

// The outputs of a tile: C and an optional second one (aux); emit() names which one a box belongs to.
enum BoxOutput : int { kOutputC = 0, kOutputAux = 1 };

// Row destinations of the current slice, one per output and row, in shared memory: worked out once per tile
// by the warpgroup (not per box, and not in registers the accumulators need).
struct SliceRows {
  __nv_bfloat16* row[2][64];
};

template <int kSlots, bool kTma>
struct BoxStore {
  static constexpr int kSlotCount = kSlots;
  uint8_t* staging;    // this warpgroup's kSlots boxes (1024-aligned)
  uint32_t staging_s;  // the same, as a shared-memory address
  SliceRows* rows;     // this warpgroup's row table
  int bar_id;          // named barrier of this warpgroup's 128 threads
  int lt;              // thread in the warpgroup
  int box_no;          // boxes emitted in the current tile
  bool tma_slice;      // the current tile's slice leaves through TMA

  __device__ BoxStore(uint8_t* staging_, SliceRows* rows_, int bar_id_, int lt_)
      : staging(staging_), staging_s(smem_addr(staging_)), rows(rows_), bar_id(bar_id_), lt(lt_), box_no(0),
        tma_slice(false) {}

  __device__ __forceinline__ void barrier() const { named_barrier_sync(bar_id, 128); }

  // tma: whether this tile's slice may leave through TMA (uniform over the warpgroup: every output
  // contiguous and every row of the slice inside the expert). Otherwise the row table is filled for the
  // slice starting at source row slice0, `valid` rows of which exist.
  __device__ __forceinline__ void begin_tile(bool tma, const OutputRows& c, const OutputRows& aux, int slice0,
                                             int valid) {
    box_no = 0;
    tma_slice = kTma && tma;
    if constexpr (kTma) {
      // The previous tile's TMA stores were issued a whole main loop ago; make sure they have read the
      // staging boxes before anything is written into them again.
      if (lt == 0) tma_store_wait_read<0>();
    }
    if (!tma_slice) {
      // The previous tile's boxes have been read out (each drain ends with a barrier).
      const OutputRows& out = lt < 64 ? c : aux;
      rows->row[lt >> 6][lt & 63] = out.base != nullptr || out.pointers != nullptr ? out.row_of(slice0, valid, lt & 63)
                                                                                    : nullptr;
    }
    barrier();
  }

  // Reserves the next kN boxes of the tile (kN <= kSlots), staged and committed in any order before the
  // next reservation; returns the first box number. On the TMA path a reused slot must have been read by
  // the store issued into it before: all but the last kSlots - kN committed stores are waited for.
  template <int kN>
  __device__ __forceinline__ int reserve() {
    static_assert(kN >= 1 && kN <= kSlots, "boxes reserved at once must fit the staging slots");
    const int b = box_no;
    box_no += kN;
    if (kTma && tma_slice && b + kN > kSlots) {
      if (lt == 0) tma_store_wait_read<kSlots - kN>();
      barrier();
    }
    return b;
  }

  // Column groups jj and jj + 1 (8 columns each) of box `box`: v[g][h] is the packed bf16x2 of group jj + g
  // and row half h of the fragment. stmatrix.x4 stores the four 8x8 matrices (rows 0-7 | 8-15) x (jj | jj+1).
  __device__ __forceinline__ void stage_pair(int box, int jj, const uint32_t (&v)[2][2]) const {
    stmatrix_x4(staged_pair_address(staging_s, box % kSlots, jj, lt), v[0][0], v[0][1], v[1][0], v[1][1]);
  }

  // Box `box` leaves: columns [col0, col0 + 64) of output `which` (`ncols` wide). `map`: its TMA store target,
  // used only on the TMA path (whose output is contiguous, so the box lands at row slice0).
  __device__ void commit(int box, const CUtensorMap* map, BoxOutput which, int slice0, int col0, int ncols) {
    const uint8_t* src = staging + (box % kSlots) * kBoxBytes;
    if (kTma && tma_slice) {
      fence_proxy_async_smem();  // the stmatrix writes become visible to TMA
      barrier();
      if (lt == 0) {
        tma_store_2d(map, col0, slice0, src);
        tma_store_commit();
      }
    } else {
      barrier();
      read_out(src, which, col0, ncols);
      barrier();
    }
  }

  // Boxes in this layout elsewhere in shared memory (an epilogue input's stage the warpgroup wrote its outputs
  // over): publish() once the warpgroup has written them, send() each, then sent(). On the TMA path they leave
  // as one bulk group (thread 0's); on the threads' path every thread has read them when sent() returns.
  // The fence on both paths: the writes must also be ordered before the async proxy's next writes to the same
  // bytes (a TMA refill of the stage, or a cluster peer's multicast into it). commit() fences for TMA only: the
  // staging slots are never written by the async proxy.
  __device__ __forceinline__ void publish() const {
    fence_proxy_async_smem();
    barrier();
  }
  __device__ __forceinline__ void send(const uint8_t* src, const CUtensorMap* map, BoxOutput which, int slice0,
                                       int col0, int ncols) const {
    if (kTma && tma_slice) {
      if (lt == 0) tma_store_2d(map, col0, slice0, src);
    } else {
      read_out(src, which, col0, ncols);
    }
  }
  __device__ __forceinline__ void sent() const {
    if (kTma && tma_slice) {
      if (lt == 0) tma_store_commit();
    } else {
      barrier();
    }
  }

  // A whole box at once: v[jj][h] for the 8 column groups of the box.
  __device__ __forceinline__ void emit(const uint32_t (&v)[8][2], const CUtensorMap* map, BoxOutput which, int slice0,
                                       int col0, int ncols) {
    const int b = reserve<1>();
#pragma unroll
    for (int jj = 0; jj < 8; jj += 2) {
      const uint32_t pair[2][2] = {{v[jj][0], v[jj][1]}, {v[jj + 1][0], v[jj + 1][1]}};
      stage_pair(b, jj, pair);
    }
    commit(b, map, which, slice0, col0, ncols);
  }

  // The threads' path: the box at src leaves as 16-byte row-contiguous stores to the rows of the row table.
  __device__ __forceinline__ void read_out(const uint8_t* src, BoxOutput which, int col0, int ncols) const {
    for_each_box_chunk(lt, [&](int row, int chunk, int offset) {
      const int col = col0 + chunk * 8;
      __nv_bfloat16* dst = rows->row[which][row];
      if (dst != nullptr && col < ncols) {
        const uint4 val = *reinterpret_cast<const uint4*>(src + offset);
        *reinterpret_cast<uint4*>(dst + col) = val;
      }
    });
  }

  // Before the kernel ends: the staging boxes must not be released while TMA may still read them.
  __device__ __forceinline__ void finish() const {
    if constexpr (kTma) {
      if (lt == 0) tma_store_wait_all<0>();
    }
  }
};

}  // namespace megamoe::device
