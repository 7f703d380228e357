// The plain epilogue (C = row_scale * acc, bf16) with its stores moved into the next tile's main loop. At the
// end of a tile the warpgroup only rounds its 64 x BN slice to bf16 pairs (BN / 4 registers, outside the
// accumulators) and prepares the slice's row table; the slice's BN / 64 boxes then leave one per stage of the
// next tile, each right after that stage's wgmma are issued (mma_tile's stage work), so that their staging,
// read-out and global stores run while the tensor cores work instead of between two main loops. Boxes that a
// short next tile (fewer stages than boxes), or the end of the schedule, leaves no stage for go at once
// (flush_from).
//
// The same values in the same places as epilogue_plain: only when they are stored changes.
#pragma once

#include <cstdint>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogues.cuh"

#ifndef MEGAMOE_DEFERRED_STORES
#define MEGAMOE_DEFERRED_STORES 0
#endif

namespace megamoe::device {

// Whether the kernels use the deferred stores (this file's and DeferredReadOut): a build option
// (MEGAMOE_DEFERRED_STORES in CMake), off until they are measured on a GPU.
inline constexpr bool kDeferredStoresEnabled = MEGAMOE_DEFERRED_STORES != 0;

// Where the held slice goes, kept in shared memory (registers are all taken by the accumulators and the held
// values), one copy per warp: lane 0 writes its warp's copy, the warp's lanes read it, and __syncwarp orders the
// two, so no warp waits for another to have read it.
struct HeldSlice {
  int slice0;  // source row of the slice's first row
  int col0;    // first column of the tile
  int boxes;   // boxes of the tile inside C
};

// A warp's new held slice, once the warp's lanes have read the previous one.
__device__ __forceinline__ void publish_held_slice(HeldSlice* slot, int lane, const HeldSlice& h) {
  __syncwarp();
  if (lane == 0) *slot = h;
  __syncwarp();
}

// The walks of a held slice's kBoxes boxes: f(box) for the box that leaves during stage kt of the next tile, or
// for every box from `first` on (after a tile of `first` stages, or 0 at the end). The loops unroll, so `box` is
// a constant where f runs and register arrays indexed by it stay in registers.
template <int kBoxes, class F>
__device__ __forceinline__ void for_box_of_stage(int kt, F&& f) {
#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    if (kt == box) f(box);
  }
}
template <int kBoxes, class F>
__device__ __forceinline__ void for_boxes_from(int first, F&& f) {
#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    if (box >= first) f(box);
  }
}

template <int kBN, class Store>
struct DeferredPlainEpilogue {
  static constexpr int kBoxes = kBN / 64;
  uint32_t held[kBoxes][8][2];  // bf16 pairs of column group jj and row half h of each box
  HeldSlice* slice;             // this warp's copy
  Store& store;
  const CUtensorMap* map_c;
  int c_cols;

  // Takes the finished tile's accumulators (any boxes still held must have left: flush_from first).
  __device__ __forceinline__ void hold(const float (&acc)[kBN / 2], const EpilogueArgs& e, const SliceCoord& s,
                                       bool tma) {
    const float sc[2] = {row_scale_of(e, s, 0), row_scale_of(e, s, 1)};
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) plain_box_pairs<kBN>(acc, sc, box, held[box]);
    const int inside = (c_cols - s.n0 + 63) / 64;
    publish_held_slice(slice, s.lane, HeldSlice{s.slice0, s.n0, inside < kBoxes ? inside : kBoxes});
    store.begin_tile(tma, e.c, e.aux, s.slice0, s.valid);
  }

  // mma_tile's stage work: box kt leaves during stage kt of the next tile.
  __device__ __forceinline__ void operator()(int kt) {
    for_box_of_stage<kBoxes>(kt, [&](int box) { emit_box(box); });
  }

  // Every box from `first` on that has not left yet.
  __device__ __forceinline__ void flush_from(int first) {
    for_boxes_from<kBoxes>(first, [&](int box) { emit_box(box); });
  }

 private:
  // Box `box` (a constant where this is inlined) of the held slice, if it lies inside C (uniform over the
  // warpgroup).
  __device__ __forceinline__ void emit_box(int box) {
    const HeldSlice h = *slice;
    if (box >= h.boxes) return;
    store.emit(held[box], map_c, kOutputC, h.slice0, h.col0 + box * 64, c_cols);
  }
};

}  // namespace megamoe::device
