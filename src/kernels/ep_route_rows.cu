// The modular route_rows kernel (ep_route_rows.cuh): every block derives the offsets from the counts,
// block 0 publishes them and reports an overflow, and the blocks share the received tokens grid-stride.
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_route_rows.cuh"

namespace megamoe::ep {
namespace {

constexpr int kRouteThreads = 256;

__global__ void route_rows_kernel(Params p) {
  extern __shared__ int32_t smem[];
  device::begin_dependent_grid();
  const Shape& s = p.shape;
  const RouteTables t = RouteTables::in(smem, s);
  (void)route_offsets(p, t, blockIdx.x == 0, blockIdx.x == 0);
  if (t.overflow(s)) return;
  const int64_t items = static_cast<int64_t>(s.num_ranks) * s.max_tokens;
  for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x)
    (void)route_item(p, t, item, [](int64_t, int, int64_t, int) {});
}

}  // namespace

Status launch_route_rows(const Params& p, cudaStream_t stream, int max_blocks) {
  const size_t smem = static_cast<size_t>(RouteTables::smem_bytes(p.shape));
  if (smem > 48 * 1024) return Status(StatusCode::kNotSupported, "route_rows: too many experts");
  const int64_t items = static_cast<int64_t>(p.shape.num_ranks) * p.shape.max_tokens;
  int64_t blocks = (items + kRouteThreads - 1) / kRouteThreads;
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  return kernels::launch_dependent(route_rows_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kRouteThreads), smem,
                                   stream, "route_rows_kernel", p);
}

Status load_route_rows_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, route_rows_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
