// The threads' path of the plain epilogue with its global stores moved into the next tile's main loop, for
// configurations whose staging boxes hold a warpgroup's whole slice (the FP8 GEMM's 64 x 128: two boxes). At the
// end of a tile the warpgroup stages the slice into its boxes (stmatrix, as BoxStore::emit does) and prepares its
// row table; the boxes are then read out to their rows one per K block of the next tile, each right after that
// block's wgmma are issued, so that the shared-memory loads, the row pointers and the global stores run in the
// shadow of the tensor cores. Slices that leave through TMA are already asynchronous and go as before
// (epilogue_plain). Unlike DeferredPlainEpilogue this holds nothing in registers: the FP8 main loops keep two or
// three accumulators there.
//
// The same values in the same places as epilogue_plain: only when they are stored changes.
#pragma once

#include <cstdint>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/deferred_plain.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/gemm/fragment.cuh"

namespace megamoe::device {

template <int kBN, class Store>
struct DeferredReadOut {
  static constexpr int kBoxes = kBN / 64;
  static_assert(Store::kSlotCount >= kBoxes, "the staging boxes hold the whole slice");
  HeldSlice* slice;  // this warp's copy (deferred_plain.cuh); boxes = 0: nothing staged
  Store& store;
  int c_cols;

  // Before the first tile: nothing is staged.
  __device__ __forceinline__ void begin(int lane) {
    if (lane == 0) *slice = HeldSlice{0, 0, 0};
    __syncwarp();
  }

  // The finished tile's slice. Whatever the previous tile staged must have left (flush_from first).
  __device__ __forceinline__ void take(const float (&acc)[kBN / 2], const EpilogueArgs& e, const SliceCoord& s,
                                       bool tma, const CUtensorMap* map_c) {
    store.begin_tile(tma, e.c, e.aux, s.slice0, s.valid);
    int boxes = 0;
    if (store.tma_slice) {
      epilogue_plain<kBN>(acc, e, s, map_c, store);
    } else {
      const float sc[2] = {row_scale_of(e, s, 0), row_scale_of(e, s, 1)};
#pragma unroll
      for (int box = 0; box < kBoxes; ++box) {
        if (s.n0 + box * 64 >= c_cols) break;  // uniform over the warpgroup
#pragma unroll
        for (int jj = 0; jj < 8; jj += 2) {
          uint32_t v[2][2];
#pragma unroll
          for (int d = 0; d < 2; ++d)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int j = box * 8 + jj + d;
              v[d][h] = pack_bf16x2(acc[Fragment::reg(j, h, 0)] * sc[h], acc[Fragment::reg(j, h, 1)] * sc[h]);
            }
          store.stage_pair(box, jj, v);
        }
        boxes = box + 1;
      }
      store.barrier();  // every box is staged before any thread reads one out
    }
    __syncwarp();  // the warp's reads of the previous slice's place are done
    if (s.lane == 0) *slice = HeldSlice{s.slice0, s.n0, boxes};
    __syncwarp();
  }

  // The main loop's stage work: box kt leaves during K block kt of the next tile.
  __device__ __forceinline__ void operator()(int kt) {
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
      if (kt == box) read_out_box(box);
    }
  }

  // Every staged box from `first` on that has not left yet (after a tile of `first` K blocks, or 0 at the end).
  __device__ __forceinline__ void flush_from(int first) {
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
      if (box >= first) read_out_box(box);
    }
  }

 private:
  // The barrier after the read-out: the next tile's begin_tile rewrites the row table and its stmatrix the boxes.
  __device__ __forceinline__ void read_out_box(int box) {
    const HeldSlice h = *slice;
    if (box >= h.boxes) return;  // uniform over the warpgroup
    store.read_out(store.staging + box * kBoxBytes, kOutputC, h.col0 + box * 64, c_cols);
    store.barrier();
  }
};

}  // namespace megamoe::device
