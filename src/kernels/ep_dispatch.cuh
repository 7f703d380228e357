// Dispatch as device code: a token's row goes once to every rank that owns one of its experts, into the slot
// the layout step gave it in that rank's receive slab for this source. The forward also sends the routing
// (local expert and row index per top-k slot, and the weights); the backward reuses it. Used by the modular
// dispatch kernel (ep_dispatch.cu) and by the fused forward's dispatch role.
#pragma once

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {

// One warp: token t to each of its destination ranks. recv_buffer: the offset of recv_x (forward) or
// recv_dout (backward); weights == nullptr for the backward (rows only). sent, optional (shared memory,
// R entries): lane 0 counts each destination the token went to.
template <typename Index>
__device__ __forceinline__ void dispatch_token(const Params& p, const __nv_bfloat16* __restrict__ rows,
                                               int64_t recv_buffer, const Index* __restrict__ idx,
                                               const float* __restrict__ weights, int64_t t, int lane,
                                               uint32_t* sent) {
  const Shape& s = p.shape;
  const int K = s.top_k, EL = s.experts_per_rank;
  const int32_t* send_rank = at<int32_t>(p.local, p.layout.pair_send_rank);
  const int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  const int32_t* row_index = at<int32_t>(p.local, p.layout.pair_row_index);
  for (int j = 0; j < K; ++j) {
    const int d = send_rank[t * K + j];
    if (d < 0) continue;
    const int64_t recv = static_cast<int64_t>(s.rank) * s.max_tokens + dest_slot[t * K + j];
    char* peer = p.peers[d];
    warp_copy_row(rows + t * s.hidden, at<__nv_bfloat16>(peer, recv_buffer) + recv * s.hidden, s.hidden, lane);
    if (sent != nullptr && lane == 0) atomicAdd(&sent[d], 1u);
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

}  // namespace megamoe::ep
