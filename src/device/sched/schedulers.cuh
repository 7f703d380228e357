// Who computes which work item. Every role of a CTA (loads, math, epilogue) walks the same sequence of item
// numbers, j = 0, 1, 2, ...; an item number >= GroupedTiles::total() ends the walk.
//   StaticSchedule: a grid stride over the numbering (CTAs, or 2-CTA clusters, in turn).
//   DynamicSchedule: the next item from a global counter (atomicAdd), so a CTA that drew long items simply
//     draws fewer. One thread of the CTA draws and publishes each number through a small shared-memory ring;
//     the other roles read it there, in order.
//   ReadinessGate: for tiles whose input rows are produced while the GEMM runs (fused kernels): the loading
//     threads wait until the tile's row-block counter has reached its target before loading.
#pragma once

#include <cstdint>

#include "device/comm/signal.cuh"
#include "device/ptx/mbarrier.cuh"

namespace megamoe::device {

struct StaticSchedule {
  int first;
  int stride;
  __device__ __forceinline__ int item(int j) const { return first + j * stride; }
};

template <int kRing>
struct DynamicSchedule {
  struct Storage {
    uint64_t full[kRing];
    uint64_t empty[kRing];
    int item[kRing];
  };
  Storage* s;
  int* counter;  // zero when the launch starts
  // When >= 0, the number the last drawing CTA draws: every CTA draws until it gets a number past the end, so
  // with G CTAs drawing from total items the draws end at total + G - 1, and that CTA, the counter's last user,
  // leaves it zero for the next launch (no memset between two kernels, which would keep the next one from
  // starting early: kernels/dependent_launch.hpp).
  int last_draw = -1;

  // One thread, before use; `readers`: the threads that read each published number.
  __device__ void init(int readers) const {
    for (int i = 0; i < kRing; ++i) {
      mbarrier_init(&s->full[i], 1);
      mbarrier_init(&s->empty[i], readers);
    }
  }
  // The drawing thread: the next number, published for the readers (also the end: t >= total).
  __device__ int draw(int j) const {
    const int slot = j % kRing;
    const int t = atomicAdd(counter, 1);
    if (t == last_draw) atomicExch(counter, 0);
    mbarrier_wait(&s->empty[slot], ((j / kRing) & 1) ^ 1);
    reinterpret_cast<volatile int*>(s->item)[slot] = t;
    mbarrier_arrive(&s->full[slot]);
    return t;
  }
  // Every reader: the number the drawer published as its j-th.
  __device__ int read(int j) const {
    const int slot = j % kRing;
    mbarrier_wait(&s->full[slot], (j / kRing) & 1);
    const int t = reinterpret_cast<const volatile int*>(s->item)[slot];
    mbarrier_arrive(&s->empty[slot]);
    return t;
  }
};

// counters[m_block] counts arrivals of the row block's producers (release adds, gpu or system scope); a tile
// may load once its block has `target` of them.
struct ReadinessGate {
  const uint32_t* counters;  // nullptr: every tile is ready
  uint32_t target;
  WaitReport report;

  // Waits for the tile's block; false after a timeout (recorded: the wait id is the block). The tile is then
  // loaded anyway, so that no role waits forever; the recorded error marks the call's outputs as invalid.
  // The loads that follow may go through TMA (the async proxy), so the acquire is extended to it.
  __device__ bool wait(int m_block) const { return wait(m_block, target, m_block); }
  // The same with a target of its own (a block's row count, say) and the id its timeout is reported with.
  __device__ bool wait(int m_block, uint32_t block_target, int64_t wait_id) const {
    if (counters == nullptr) return true;
    const bool ok = wait_at_least<Scope::kSystem>(counters + m_block, block_target, report, wait_id);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    return ok;
  }
};

}  // namespace megamoe::device
