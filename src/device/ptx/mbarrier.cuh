// Shared-memory mbarriers: initialisation, arrivals (plain, with an expected transaction count, on a
// cluster peer's barrier, on completion of this thread's cp.async copies) and parity waits.
#pragma once

#include <cstdint>
#include <cuda/ptx>

namespace megamoe::device {

namespace ptx = cuda::ptx;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  ptx::mbarrier_init(bar, static_cast<uint32_t>(arrivals));
}

// Makes initialised barriers visible to the other threads of the cluster (and to the async proxy).
__device__ __forceinline__ void mbarrier_init_fence() { ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster); }

// Spins until the barrier's phase with the given parity has completed. Unbounded: every wait inside one
// CTA is on work this CTA issued itself (TMA, copies, its own warps), so it cannot be waited on forever
// unless the kernel is already broken; waits on other CTAs or ranks go through device/comm/signal.cuh.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// Whether the phase with the given parity has completed, without waiting.
__device__ __forceinline__ bool mbarrier_test(uint64_t* bar, uint32_t parity) {
  return ptx::mbarrier_test_wait_parity(bar, parity);
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  (void)ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar);
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  (void)ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar, bytes);
}

// Arrive on the barrier at the same shared-memory offset in CTA `cta_rank` of the cluster, with the default
// semantics (release at CTA scope): the peer only needs to learn that this warpgroup's wgmma reads of a
// stage are complete, so no cluster-scope release fence belongs on the critical path of every K stage
// (measured: `.release.cluster` here made 2-CTA clusters 10-35% slower, docs/GEMM.md).
__device__ __forceinline__ void mbarrier_arrive_cluster_peer(uint64_t* bar, uint32_t cta_rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(cta_rank)
      : "memory");
}

// Arrives on the barrier once every cp.async this thread issued so far has landed. `.noinc`: the arrival
// counts against the barrier's initial arrival count (the barrier must be initialised to expect it).
__device__ __forceinline__ void mbarrier_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

}  // namespace megamoe::device
