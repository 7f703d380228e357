// The modular dispatch kernel: one warp per token (ep_dispatch.cuh), grid-stride.
#include "kernels/cuda_check.hpp"
#include "kernels/ep_dispatch.cuh"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

template <typename Index>
__global__ void dispatch_kernel(Params p, const __nv_bfloat16* __restrict__ rows, int64_t recv_buffer,
                                const Index* __restrict__ idx, const float* __restrict__ weights) {
  if (has_error(p)) return;
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t t = first; t < p.num_tokens; t += num_warps)
    dispatch_token(p, rows, recv_buffer, idx, weights, t, lane, nullptr);
}

}  // namespace

Status launch_dispatch(const Params& p, const __nv_bfloat16* rows, const void* topk_idx, bool idx_is_int64,
                       const float* weights, cudaStream_t stream, int max_blocks) {
  if (p.num_tokens == 0) return Status::ok();
  const int blocks = row_grid(p.num_tokens, max_blocks);
  // The forward's x stays in recv_x for the backward's weight gradient; d_out has its own buffer.
  const int64_t recv = weights != nullptr ? p.layout.recv_x : p.layout.recv_dout;
  if (idx_is_int64)
    dispatch_kernel<int64_t><<<blocks, kRowBlockThreads, 0, stream>>>(p, rows, recv,
                                                                          static_cast<const int64_t*>(topk_idx), weights);
  else
    dispatch_kernel<int32_t><<<blocks, kRowBlockThreads, 0, stream>>>(p, rows, recv,
                                                                          static_cast<const int32_t*>(topk_idx), weights);
  MEGAMOE_CHECK_LAUNCH(stream, "dispatch_kernel");
  return Status::ok();
}

Status load_dispatch_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_kernel<int64_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_kernel<int32_t>));
  return Status::ok();
}

}  // namespace megamoe::ep
