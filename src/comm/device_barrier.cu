// The modular path's rank barrier: one thread runs rank_barrier (rank_barrier.cuh) between the kernels
// whose data it orders.
#include "comm/rank_barrier.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

// Launched as a dependent grid, it waits for the kernels before it; it never lets the next kernel launch
// early (device::allow_next_grid_launch): that kernel's CTAs would wait, resident, on a barrier that waits on
// peer ranks, whose kernels may need those SMs when the ranks share a GPU.
__global__ void barrier_kernel(Params p, int id) {
  device::wait_for_prior_grids();
  if (threadIdx.x != 0) return;
  rank_barrier(p, id);
}

}  // namespace

Status launch_barrier(const Params& p, BarrierId id, cudaStream_t stream) {
  return kernels::launch_dependent(barrier_kernel, dim3(1), dim3(32), 0, stream, "barrier_kernel", p,
                                   static_cast<int>(id));
}

Status load_barrier_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, barrier_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
