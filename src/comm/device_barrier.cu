// The modular path's rank barrier: one thread runs rank_barrier (rank_barrier.cuh) between the kernels
// whose data it orders.
#include "comm/rank_barrier.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

__global__ void barrier_kernel(Params p, int id) {
  if (threadIdx.x != 0) return;
  rank_barrier(p, id);
}

}  // namespace

Status launch_barrier(const Params& p, BarrierId id, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(p, static_cast<int>(id));
  MEGAMOE_CHECK_LAUNCH(stream, "barrier_kernel");
  return Status::ok();
}

Status load_barrier_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, barrier_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
