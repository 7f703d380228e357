// The modular dispatch kernel: one warp per token (ep_dispatch.cuh), grid-stride.
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_dispatch.cuh"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

template <typename Index, class Row>
__global__ void dispatch_kernel(Params p, Row row, const Index* __restrict__ idx, const float* __restrict__ weights) {
  device::begin_dependent_grid();
  if (has_error(p)) return;
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t t = first; t < p.num_tokens; t += num_warps) dispatch_token(p, row, idx, weights, t, lane, nullptr);
}

template <class Row>
Status launch_rows(const Params& p, const Row& row, const void* topk_idx, bool idx_is_int64, const float* weights,
                   cudaStream_t stream, int max_blocks) {
  if (p.num_tokens == 0) return Status::ok();
  const int blocks = row_grid(p.num_tokens, max_blocks);
  if (idx_is_int64)
    return kernels::launch_dependent(dispatch_kernel<int64_t, Row>, dim3(blocks), dim3(kRowBlockThreads), 0, stream,
                                     "dispatch_kernel", p, row, static_cast<const int64_t*>(topk_idx), weights);
  return kernels::launch_dependent(dispatch_kernel<int32_t, Row>, dim3(blocks), dim3(kRowBlockThreads), 0, stream,
                                   "dispatch_kernel", p, row, static_cast<const int32_t*>(topk_idx), weights);
}

}  // namespace

Status launch_dispatch(const Params& p, const __nv_bfloat16* rows, const void* topk_idx, bool idx_is_int64,
                       const float* weights, cudaStream_t stream, int max_blocks) {
  // The forward's x stays in recv_x for the backward's weight gradient; d_out has its own buffer.
  const int64_t recv = weights != nullptr ? p.layout.recv_x : p.layout.recv_dout;
  return launch_rows(p, Bf16Row{rows, recv}, topk_idx, idx_is_int64, weights, stream, max_blocks);
}

Status launch_dispatch_fp8(const Params& p, const void* topk_idx, bool idx_is_int64, const float* weights,
                           cudaStream_t stream, int max_blocks) {
  // The forward's x (with its routing) or, without weights, the backward's d_out (the forward's routing).
  const Fp8Row row = weights != nullptr ? Fp8Row::forward(p.layout) : Fp8Row::backward(p.layout);
  return launch_rows(p, row, topk_idx, idx_is_int64, weights, stream, max_blocks);
}

Status load_dispatch_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_kernel<int64_t, Bf16Row>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_kernel<int32_t, Bf16Row>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_kernel<int64_t, Fp8Row>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_kernel<int32_t, Fp8Row>));
  return Status::ok();
}

}  // namespace megamoe::ep
