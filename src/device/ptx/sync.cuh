// Intra-CTA synchronisation and register/shared-memory primitives of sm_90a that CCCL does not wrap or that
// the kernels use in one fixed form: named barriers, the generic -> async proxy fence, setmaxnreg, stmatrix.
#pragma once

#include <cstdint>
#include <cuda/ptx>

namespace megamoe::device {

// Named barrier over `threads` threads of the block (id 0 is __syncthreads; ids 1..15 are free).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Shared-memory writes of this thread made so far (ordinary stores, stmatrix, landed cp.async copies it
// waited for) become visible to the async proxy (TMA, wgmma) after this fence.
__device__ __forceinline__ void fence_proxy_async_smem() { cuda::ptx::fence_proxy_async(cuda::ptx::space_shared); }

// Per-warpgroup register budget (sm_90a): the kernel needs a register cap at entry
// (__launch_bounds__(threads, 1)), and every warp of the warpgroup must execute the same instruction.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Registers per thread a CTA of kThreads threads gets at launch (its register count at entry, 168 for 384).
template <int kThreads>
inline constexpr int kRegistersAtLaunch = 65536 / kThreads / 8 * 8;
// Whether one producer warpgroup at kProducerRegs and two consumer warpgroups at kConsumerRegs fit the pool
// the launch allocated: setmaxnreg.inc waits until the pool has the registers, so budgets that do not fit
// leave the consumers waiting forever.
template <int kThreads, int kProducerRegs, int kConsumerRegs>
inline constexpr bool kRegisterSplitFits =
    kProducerRegs * 128 + kConsumerRegs * 256 <= kRegistersAtLaunch<kThreads> * kThreads;

// stmatrix: four 8x8 bf16 matrices from registers to shared memory (each lane gives one row address).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Cluster-wide barrier (all threads of all CTAs of the cluster).
__device__ __forceinline__ void cluster_sync() {
  cuda::ptx::barrier_cluster_arrive(cuda::ptx::sem_release);
  cuda::ptx::barrier_cluster_wait(cuda::ptx::sem_acquire);
}

__device__ __forceinline__ uint32_t cluster_cta_rank() { return cuda::ptx::get_sreg_cluster_ctarank(); }
__device__ __forceinline__ uint32_t cluster_id_x() { return cuda::ptx::get_sreg_clusterid_x(); }

}  // namespace megamoe::device
