// What a failed call leaves behind: every output NaN (the combines do out, d_x and d_topk_weights; this file
// the weight gradients, which the GEMMs write directly), and the failure of a forward carried into its
// backward after the host has already consumed the error.
#include <cmath>

#include "comm/device_sync.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

template <typename T>
__global__ void nan_if_failed_kernel(Params p, T* a, int64_t count_a, T* b, int64_t count_b) {
  device::begin_dependent_grid();
  if (!has_error(p)) return;
  const T nan = static_cast<T>(NAN);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count_a + count_b; i += stride) {
    if (i < count_a) {
      a[i] = nan;
    } else {
      b[i - count_a] = nan;
    }
  }
}

template <typename T>
Status launch_nan_fill(const Params& p, T* a, int64_t count_a, T* b, int64_t count_b, cudaStream_t stream,
                       int max_blocks) {
  // Normally every block returns at once; the grid only matters when the buffers are filled.
  return kernels::launch_dependent(nan_if_failed_kernel<T>, dim3(max_blocks * 4), dim3(256), 0, stream,
                                   "nan_if_failed_kernel", p, a, count_a, b, count_b);
}

__global__ void record_forward_failed_kernel(Params p) {
  device::begin_dependent_grid();
  record_error(error_record(p.local, p.layout), StatusCode::kInvalidArgument, kErrorForwardFailed, p.shape.rank, 0, 0);
}

}  // namespace

Status launch_nan_if_failed(const Params& p, float* a, int64_t count_a, float* b, int64_t count_b,
                            cudaStream_t stream, int max_blocks) {
  return launch_nan_fill(p, a, count_a, b, count_b, stream, max_blocks);
}

Status launch_nan_if_failed(const Params& p, __nv_bfloat16* a, int64_t count_a, __nv_bfloat16* b, int64_t count_b,
                            cudaStream_t stream, int max_blocks) {
  return launch_nan_fill(p, a, count_a, b, count_b, stream, max_blocks);
}

Status launch_record_forward_failed(const Params& p, cudaStream_t stream) {
  return kernels::launch_dependent(record_forward_failed_kernel, dim3(1), dim3(1), 0, stream,
                                   "record_forward_failed_kernel", p);
}

Status load_failure_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, nan_if_failed_kernel<float>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, nan_if_failed_kernel<__nv_bfloat16>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, record_forward_failed_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
