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

namespace megamoe::device {

template <int kBN, class Store>
struct DeferredReadOut {
  static constexpr int kBoxes = kBN / 64;
  static_assert(Store::kSlotCount >= kBoxes, "the staging boxes hold the whole slice");
  HeldSlice* slice;  // this warp's copy (deferred_plain.cuh); boxes = 0: nothing staged
  Store& store;
  int c_cols;

  // Before the first tile: nothing is staged.
  __device__ __forceinline__ void begin(int lane) { publish_held_slice(slice, lane, HeldSlice{0, 0, 0}); }

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
        uint32_t v[8][2];
        plain_box_pairs<kBN>(acc, sc, box, v);
        store.stage_box(box, v);
        boxes = box + 1;
      }
      store.barrier();  // every box is staged before any thread reads one out
    }
    publish_held_slice(slice, s.lane, HeldSlice{s.slice0, s.n0, boxes});
  }

  // The main loop's stage work: box kt leaves during K block kt of the next tile.
  __device__ __forceinline__ void operator()(int kt) {
    for_box_of_stage<kBoxes>(kt, [&](int box) { read_out_box(box); });
  }

  // Every staged box from `first` on that has not left yet.
  __device__ __forceinline__ void flush_from(int first) {
    for_boxes_from<kBoxes>(first, [&](int box) { read_out_box(box); });
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
