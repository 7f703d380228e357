#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

__global__ void barrier_kernel(Params p, int id) {
  if (threadIdx.x != 0) return;
  const int64_t offset = p.layout.barriers + 8 * static_cast<int64_t>(id);
  // Make every store of this rank's earlier kernels (peer stores included) visible before arriving.
  __threadfence_system();
  for (int peer = 0; peer < p.shape.num_ranks; ++peer) red_add_release_sys(at<uint64_t>(p.peers[peer], offset), 1);
  uint64_t* mine = at<uint64_t>(p.local, offset);
  const uint64_t start = global_timer_ns();
  uint64_t seen = 0;
  while ((seen = load_acquire_sys(mine)) < static_cast<uint64_t>(p.shape.num_ranks)) {
    if (global_timer_ns() - start > p.timeout_ns) {
      // The counter is left as it is: a late arrival would make it wrong anyway; the layer must be
      // recreated after a timeout (documented in layer.hpp).
      record_error(error_record(p.local, p.layout), StatusCode::kTimeout, kErrorBarrierTimeout, p.shape.rank, id,
                   static_cast<int64_t>(seen));
      return;
    }
    __nanosleep(64);
  }
  *mine = 0;
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
