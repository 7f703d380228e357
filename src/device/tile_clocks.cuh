// Where an engine consumer warpgroup's time goes, tile by tile: a diagnostic build (MEGAMOE_TILE_CLOCKS=1 among
// the CUDA flags; scripts/tile-clocks.sh builds it, runs the layer's step and sums the counts up). Per tile, in
// SM cycles: before the tile's first stage is waited for (the schedule, the decode, the previous epilogue's
// tail), waiting for that stage (the producer behind), the main loop (its stages' wgmma and the waits between
// them), the epilogue (until its stores are issued). "total" spans the tile loop only (not the kernel's prologue
// or the final wait for the stores). Thread 0 of each consumer warpgroup of CTA 0 and of a CTA past the grid's
// middle (if the grid has more than two) appends its sums to a record ring in device memory when the kernel
// ends, and the process prints the ring's records ("TILECLK ...") when it exits normally.
// Not printf from the kernel: a function call in a wgmma kernel serialises its wgmma (ptxas C7510), which would
// time another kernel. Without the macro every member is empty and the kernels are the same instruction for
// instruction.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#ifndef MEGAMOE_TILE_CLOCKS
#define MEGAMOE_TILE_CLOCKS 0
#endif

namespace megamoe::device {

// What a record names: the kernel's configuration and problem.
struct TileClocksLabel {
  int form, activation, bn, cluster, tma_store, gathers, n, k;
};

struct TileClocksRecord {
  TileClocksLabel label;
  int cta, cwg, tiles, pad;
  long long stages, top, wait, loop, epilogue, total;
};

#if MEGAMOE_TILE_CLOCKS
inline constexpr int kTileClocksRecords = 4096;
// One ring per translation unit that includes this (internal linkage), each dumped by its own exit handler.
static __device__ TileClocksRecord g_tile_clock_records[kTileClocksRecords];
static __device__ unsigned int g_tile_clock_count;

struct TileClocks {
  static constexpr bool kEnabled = true;
  long long begin_at = 0, last = 0, start = 0, ready = 0, looped = 0;
  long long top = 0, wait = 0, loop = 0, epilogue = 0, stages = 0;
  int tiles = 0;

  __device__ __forceinline__ TileClocks() {
    begin_at = clock64();
    last = begin_at;
  }
  __device__ __forceinline__ void tile_start() { start = clock64(); }
  __device__ __forceinline__ void first_stage_ready() { ready = clock64(); }
  __device__ __forceinline__ void main_loop_done(int k_tiles) {
    looped = clock64();
    top += start - last;
    wait += ready - start;
    loop += looped - ready;
    stages += k_tiles;
    ++tiles;
  }
  __device__ __forceinline__ void epilogue_done() {
    last = clock64();
    epilogue += last - looped;
  }
  // From thread 0 of a warpgroup in CTA 0 and in a CTA past the grid's middle; records past the ring are dropped.
  __device__ __forceinline__ void report(const TileClocksLabel& l, int cwg, int thread) const {
    if (thread != 0 || (blockIdx.x != 0 && blockIdx.x != gridDim.x / 2 + 1)) return;
    const unsigned int slot = atomicAdd(&g_tile_clock_count, 1u);
    if (slot >= kTileClocksRecords) return;
    g_tile_clock_records[slot] = TileClocksRecord{l,    static_cast<int>(blockIdx.x), cwg,  tiles,   0,
                                                  stages, top, wait, loop, epilogue, last - begin_at};
  }
};

// Host side: at the first launch, an exit handler that prints this translation unit's records. Internal linkage,
// as the ring's: each translation unit prints its own.
[[maybe_unused]] static void print_tile_clock_records() {
  unsigned int count = 0;
  static TileClocksRecord records[kTileClocksRecords];
  cudaError_t err = cudaMemcpyFromSymbol(&count, g_tile_clock_count, sizeof(count));
  const unsigned int n = count < kTileClocksRecords ? count : kTileClocksRecords;
  if (err == cudaSuccess && n > 0) err = cudaMemcpyFromSymbol(records, g_tile_clock_records, n * sizeof(TileClocksRecord));
  if (err != cudaSuccess) {
    std::fprintf(stderr, "TILECLK: the records could not be read: %s\n", cudaGetErrorString(err));
    return;
  }
  for (unsigned int i = 0; i < n; ++i) {
    const TileClocksRecord& r = records[i];
    std::printf("TILECLK form=%d act=%d BN=%d cl=%d tma=%d gA=%d N=%d K=%d cta=%d cwg=%d tiles=%d kstages=%lld "
                "top=%lld wait=%lld loop=%lld epi=%lld total=%lld\n",
                r.label.form, r.label.activation, r.label.bn, r.label.cluster, r.label.tma_store, r.label.gathers,
                r.label.n, r.label.k, r.cta, r.cwg, r.tiles, r.stages, r.top, r.wait, r.loop, r.epilogue, r.total);
  }
  if (count > n) std::printf("TILECLK dropped=%u\n", count - n);
  std::fflush(stdout);
}
[[maybe_unused]] static void register_tile_clock_dump() {
  static const bool registered = (std::atexit(print_tile_clock_records), true);
  (void)registered;
}
#else
struct TileClocks {
  static constexpr bool kEnabled = false;
  __device__ __forceinline__ void tile_start() {}
  __device__ __forceinline__ void first_stage_ready() {}
  __device__ __forceinline__ void main_loop_done(int) {}
  __device__ __forceinline__ void epilogue_done() {}
  __device__ __forceinline__ void report(const TileClocksLabel&, int, int) const {}
};
inline void register_tile_clock_dump() {}
#endif

}  // namespace megamoe::device
