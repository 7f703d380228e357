// The kernel's side of programmatic dependent launch (host side: kernels/dependent_launch.hpp). A kernel
// launched that way may start while the kernel before it in the stream still runs, so every such kernel
// waits for its predecessors before its first access to global memory that they may write or read. Both
// instructions do nothing in a kernel launched the ordinary way, so one kernel body serves both launches.
#pragma once

namespace megamoe::device {

// Blocks until every grid this one depends on has completed and its memory operations are visible here.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream be scheduled once every CTA of this grid has said so (or exited); its
// CTAs then take the SMs this grid's CTAs free and wait in wait_for_prior_grids. Never called by a kernel
// whose completion waits on another stream or rank (the rank barrier, the fused kernels): CTAs resident
// early and waiting on it could hold the SMs a peer rank's kernel needs to let it finish.
__device__ __forceinline__ void allow_next_grid_launch() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The usual prologue of a kernel that depends only on earlier kernels of its own stream.
__device__ __forceinline__ void begin_dependent_grid() {
  allow_next_grid_launch();
  wait_for_prior_grids();
}

}  // namespace megamoe::device
