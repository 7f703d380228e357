// The modular combine kernels: one warp per token (ep_combine.cuh), grid-stride, after the rank barrier
// that follows the GEMM storing the rows home.
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_combine.cuh"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

template <bool kWeighted>
__global__ void combine_kernel(Params p, const float* __restrict__ topk_weights, __nv_bfloat16* __restrict__ out,
                               float* __restrict__ d_topk_weights) {
  device::begin_dependent_grid();
  const bool failed = has_error(p);
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t t = first; t < p.num_tokens; t += num_warps)
    combine_token<kWeighted>(p, t, lane, failed, topk_weights, out, d_topk_weights);
}

}  // namespace

Status launch_combine_forward(const Params& p, const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream,
                              int max_blocks) {
  if (p.num_tokens == 0) return Status::ok();
  return kernels::launch_dependent(combine_kernel<true>, dim3(row_grid(p.num_tokens, max_blocks)),
                                   dim3(kRowBlockThreads), 0, stream, "combine_forward_kernel", p, topk_weights, out,
                                   static_cast<float*>(nullptr));
}

Status launch_combine_backward(const Params& p, __nv_bfloat16* d_x, float* d_topk_weights, cudaStream_t stream,
                               int max_blocks) {
  if (p.num_tokens == 0) return Status::ok();
  return kernels::launch_dependent(combine_kernel<false>, dim3(row_grid(p.num_tokens, max_blocks)),
                                   dim3(kRowBlockThreads), 0, stream, "combine_backward_kernel", p,
                                   static_cast<const float*>(nullptr), d_x, d_topk_weights);
}

Status load_combine_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_kernel<true>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_kernel<false>));
  return Status::ok();
}

}  // namespace megamoe::ep
