// Dispatch as device code: a token's row goes once to every rank that owns one of its experts, into the slot
// the layout step gave it in that rank's receive slab for this source. The forward also sends the routing
// (local expert and row index per top-k slot, and the weights); the backward reuses it. Used by the modular
// dispatch kernel (ep_dispatch.cu) and by the fused forward's dispatch role.
#pragma once

#include "comm/device_sync.cuh"
#include "comm/ep_workspace.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {

// What a token's row is on the wire. Bf16Row: its bf16 row, into the buffer at recv_buffer (recv_x in the
// forward, recv_dout in the backward).
struct Bf16Row {
  const __nv_bfloat16* rows;
  int64_t recv_buffer;
  __device__ __forceinline__ void send(const Params& p, int64_t t, char* peer, int64_t recv, int lane) const {
    const int64_t H = p.shape.hidden;
    warp_copy_row(rows + t * H, at<__nv_bfloat16>(peer, recv_buffer) + recv * H, H, lane);
  }
};

// Fp8Row (blockwise FP8): its e4m3 row and the row's H / 128 scales, quantized on this rank (workspace offsets
// q, s), into the receive buffers recv_q, recv_s: half the bytes of the bf16 row, plus 1 / 64 of them for the
// scales. The forward sends x (x_q, x_s -> recv_xq, recv_xs), the backward d_out (dout_q, dout_s ->
// recv_doutq, recv_douts).
struct Fp8Row {
  int64_t q, s, recv_q, recv_s;

  static Fp8Row forward(const WorkspaceLayout& l) { return {l.x_q, l.x_s, l.recv_xq, l.recv_xs}; }
  static Fp8Row backward(const WorkspaceLayout& l) { return {l.dout_q, l.dout_s, l.recv_doutq, l.recv_douts}; }

  __device__ __forceinline__ void send(const Params& p, int64_t t, char* peer, int64_t recv, int lane) const {
    const int64_t H = p.shape.hidden, groups = H / 128;
    // The e4m3 bytes as bf16 pairs (H / 2 of them: a whole number of 16-byte pieces, H % 128 == 0).
    warp_copy_row(at<__nv_bfloat16>(p.local, q) + t * (H / 2), at<__nv_bfloat16>(peer, recv_q) + recv * (H / 2),
                  H / 2, lane);
    const float* from = at<float>(p.local, s) + t * groups;
    float* to = at<float>(peer, recv_s) + recv * groups;
    for (int64_t i = lane; i < groups; i += 32) to[i] = from[i];
  }
};

// One warp: token t to each of its destination ranks, its row as `row` sends it; weights == nullptr for the
// backward (rows only). sent, optional (shared memory, R entries): lane 0 counts each destination the token
// went to.
template <typename Index, class Row>
__device__ __forceinline__ void dispatch_token(const Params& p, const Row& row, const Index* __restrict__ idx,
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
    row.send(p, t, peer, recv, lane);
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
