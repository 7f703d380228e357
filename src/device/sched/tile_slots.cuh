// Decoded work items handed from the producer to the consumers of a pipelined GEMM. The producer decodes every
// tile anyway, ahead of the consumers; it leaves the decoded tile in a small ring of shared-memory slots, and
// the consumers read it there instead of decoding it again at the tile boundary, where nothing else keeps the
// tensor cores busy (the decoding, a search over the experts' first items and the band position's divisions,
// was a fifth of a consumer warpgroup's time at 6 K blocks a tile: docs/PERF.md run 77).
//
// Slot j % kSlots holds the j-th tile of the schedule. The producer thread that fills the tile's first
// stage writes the slot after acquiring that stage and before its arrival on the stage's full barrier
// (release); a consumer reads it after waiting for that barrier (acquire). Reuse is safe when kSlots is at
// least the ring's stage count and every tile has at least one stage: the producer can acquire the first
// stage of tile j only once the consumers have released the stage used kStages stages earlier, which comes
// at or after the first stage of tile j - kSlots, and a consumer reads a tile's slot before it releases that
// tile's first stage.
#pragma once

#include "device/sched/grouped_tiles.cuh"

namespace megamoe::device {

template <int kSlots>
struct TileSlots {
  static_assert(kSlots > 0 && (kSlots & (kSlots - 1)) == 0, "a power of two: the slot is j & (kSlots - 1)");
  TileCoord tile[kSlots];

  // The producer thread that arrives on tile j's first stage, after acquiring it.
  __device__ __forceinline__ void publish(int j, const TileCoord& t) { tile[j & (kSlots - 1)] = t; }
  // A consumer, once tile j's first stage has landed.
  __device__ __forceinline__ TileCoord read(int j) const { return tile[j & (kSlots - 1)]; }
};

}  // namespace megamoe::device
