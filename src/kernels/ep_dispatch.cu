// Dispatch: each token's row goes once to every rank that owns one of its experts, into the slot the
// layout step gave it in that rank's receive slab for this source. The forward also sends the routing
// (local expert and row index per top-k slot, and the weights); the backward reuses it.
#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {
namespace {

template <typename Index>
__global__ void dispatch_kernel(Params p, const __nv_bfloat16* __restrict__ rows, int64_t recv_buffer,
                                const Index* __restrict__ idx, const float* __restrict__ weights) {
  if (has_error(p)) return;
  const Shape& s = p.shape;
  const int K = s.top_k, EL = s.experts_per_rank;
  const int lane = threadIdx.x % 32;
  const int32_t* send_rank = at<int32_t>(p.local, p.layout.pair_send_rank);
  const int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  const int32_t* row_index = at<int32_t>(p.local, p.layout.pair_row_index);
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t t = first; t < p.num_tokens; t += num_warps) {
    for (int j = 0; j < K; ++j) {
      const int d = send_rank[t * K + j];
      if (d < 0) continue;
      const int64_t recv = static_cast<int64_t>(s.rank) * s.max_tokens + dest_slot[t * K + j];
      char* peer = p.peers[d];
      warp_copy_row(rows + t * s.hidden, at<__nv_bfloat16>(peer, recv_buffer) + recv * s.hidden, s.hidden, lane);
      if (weights == nullptr) continue;
      if (lane == 0) at<int32_t>(peer, p.layout.recv_token)[recv] = static_cast<int32_t>(t);
      for (int jj = lane; jj < K; jj += 32) {
        const int e = static_cast<int>(idx[t * K + jj]);
        SlotRoute route{-1, 0};
        if (e >= 0 && e / EL == d) route = SlotRoute{e % EL, row_index[t * K + jj]};
        at<SlotRoute>(peer, p.layout.recv_routes)[recv * K + jj] = route;
        at<float>(peer, p.layout.recv_weights)[recv * K + jj] = weights[t * K + jj];
      }
    }
  }
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
