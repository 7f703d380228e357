// Scattered output boxes handed from a consumer warpgroup to a store warp. A slice whose rows go to scattered
// destinations (row pointers into the combine slots, rows past an expert's end) cannot leave through TMA; on
// the threads' path the whole consumer warpgroup reads its staged boxes back and stores them row by row while
// the tensor cores idle (a GEMM with six K blocks a tile lost about a third of its time to it, docs/PERF.md run
// 73), and a bulk copy per row costs the TMA unit more than the stores themselves (run 73). Here the consumers
// only stage a box and arrive on its slot's `full` barrier; a warp of the producer warpgroup, otherwise idle,
// stores it row by row and arrives on `empty`, while the consumers run the next tile's main loop.
//
// Protocol (two slots, used in the order of a per-warpgroup handoff count k: slot k % 2, phase (k / 2) % 2):
//   consumers: before staging into the slots, or rewriting the row table, wait until the last box handed off
//     has been stored (BoxStore::begin_tile); stage the box, thread 0 writes its place, every thread arrives on
//     full (release: each thread's own stmatrix writes). The end is a box with col0 < 0.
//   store warp: wait on full, read the place, store the rows (the table gives each row's destination), every
//     lane arrives on empty (its reads of the slot are done: the stores used the loaded values).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/ptx/mbarrier.cuh"

namespace megamoe::device {

inline constexpr int kHandoffSlots = 2;

struct BoxHandoff {
  uint64_t full[kHandoffSlots];   // kConsumerThreads arrivals: the box is staged
  uint64_t empty[kHandoffSlots];  // 32 arrivals: the store warp has read it
  int col0[kHandoffSlots];        // the box's first column of its output; < 0: no more boxes
  int which[kHandoffSlots];       // BoxOutput
  int ncols[kHandoffSlots];       // the output's width

  static constexpr int kConsumerThreads = 128;

  // By one thread, before the block's first barrier (and the init fence).
  __device__ __forceinline__ void init() {
    for (int s = 0; s < kHandoffSlots; ++s) {
      mbarrier_init(&full[s], kConsumerThreads);
      mbarrier_init(&empty[s], 32);
    }
  }

  // Consumer side: waits until handoff number `handed - 1` (the last one, 0 if none yet) has been stored; the
  // store warp takes them in order, so every earlier one has been too.
  __device__ __forceinline__ void wait_drained(int handed) {
    if (handed == 0) return;
    const int k = handed - 1;
    mbarrier_wait(&empty[k % kHandoffSlots], static_cast<uint32_t>((k / kHandoffSlots) & 1));
  }

  // Consumer side, every thread of the warpgroup: box number k (staged in slot k % 2) is ready.
  __device__ __forceinline__ void hand_off(int k, int col0_, int which_, int ncols_, int lt) {
    const int s = k % kHandoffSlots;
    if (lt == 0) {
      col0[s] = col0_;
      which[s] = which_;
      ncols[s] = ncols_;
    }
    mbarrier_arrive(&full[s]);
  }

  // The store warp of one consumer warpgroup: its boxes in order until the end marker. staging: that
  // warpgroup's slots (kSlotBytes each, boxes of 64 rows x 128 bytes in the 128-byte swizzle); rows: its row
  // table (BoxStore's SliceRows: rows->row[output][row], a destination or nullptr).
  template <int kSlotBytes, class Rows>
  __device__ void drain(const uint8_t* staging, const Rows* rows, int lane) {
    for (int k = 0;; ++k) {
      const int s = k % kHandoffSlots;
      mbarrier_wait(&full[s], static_cast<uint32_t>((k / kHandoffSlots) & 1));
      const int first = col0[s];
      if (first < 0) return;
      const int out = which[s], width = ncols[s];
      const uint8_t* src = staging + s * kSlotBytes;
      // Lane l takes 16-byte chunk l % 8 of rows l / 8 + 4 i: each store of the warp is four 128-byte rows.
      const int chunk = lane & 7, col = first + chunk * 8;
#pragma unroll 4
      for (int i = 0; i < 16; ++i) {
        const int row = (lane >> 3) + 4 * i;
        __nv_bfloat16* dst = rows->row[out][row];
        if (dst != nullptr && col < width) {
          const uint4 v = *reinterpret_cast<const uint4*>(src + row * 128 + ((chunk ^ (row & 7)) << 4));
          *reinterpret_cast<uint4*>(dst + col) = v;
        }
      }
      mbarrier_arrive(&empty[s]);
    }
  }
};

}  // namespace megamoe::device
