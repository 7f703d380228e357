// Launchers of the expert-parallel layer's data-movement kernels (modular path; the GEMMs and everything
// they fuse are in grouped_gemm.hpp). Each enqueues on `stream`, uses at most `max_blocks` blocks (virtual
// ranks share a GPU) and never synchronises with the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "comm/ep_workspace.hpp"
#include "megamoe/status.hpp"

namespace megamoe::ep {

// Loads every kernel of the layer (see grouped_gemm_preload for why); once per process is enough.
Status preload_kernels();
Status load_barrier_kernels();
Status load_layout_kernels();
Status load_dispatch_kernels();
Status load_route_rows_kernels();
Status load_combine_kernels();
Status load_failure_kernels();

// Cross-rank barrier `id` with timeout (comm/rank_barrier.cuh).
Status launch_barrier(const Params& p, BarrierId id, cudaStream_t stream);

// Validates expert ids, numbers every (token, slot) deterministically: its slot in the receiving rank's
// slab (one per token and destination rank) and its index among this rank's rows for its expert;
// writes the per-expert and per-rank counts into every receiver's recv_counts (ep_layout.cu).
Status launch_layout(const Params& p, const void* topk_idx, bool idx_is_int64, cudaStream_t stream, int max_blocks);

// Sends each token's row once per destination rank; with `weights` (forward, topk_idx given) into recv_x
// with the routing, without (backward, reusing the forward's routing) into recv_dout.
Status launch_dispatch(const Params& p, const __nv_bfloat16* rows, const void* topk_idx, bool idx_is_int64,
                       const float* weights, cudaStream_t stream, int max_blocks);
// Blockwise FP8: with `weights` (forward) the rows quantized into this rank's x_q / x_s go to recv_xq /
// recv_xs with the routing, as launch_dispatch sends them; without (backward, the forward's routing) the
// rows of dout_q / dout_s go to recv_doutq / recv_douts.
Status launch_dispatch_fp8(const Params& p, const void* topk_idx, bool idx_is_int64, const float* weights,
                           cudaStream_t stream, int max_blocks);

// Receiver: expert-major row offsets from every source's counts, capacity check, and per row its
// receive-buffer row, weight and destinations on the source (ep_route_rows.cu).
Status launch_route_rows(const Params& p, cudaStream_t stream, int max_blocks);

// Source: out[t] = sum_j w_j * y_j in slot order (ep_combine.cu); NaN rows if an error was recorded.
Status launch_combine_forward(const Params& p, const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream,
                              int max_blocks);
// Source: d_x[t] = sum_j dx_j in slot order; d_topk_weights from the slots' partials (0 when masked).
Status launch_combine_backward(const Params& p, __nv_bfloat16* d_x, float* d_topk_weights, cudaStream_t stream,
                               int max_blocks);

// Fills a and b with NaN if this call has failed (an error recorded on this rank, or the layer broken);
// otherwise does nothing (ep_failure.cu).
Status launch_nan_if_failed(const Params& p, float* a, int64_t count_a, float* b, int64_t count_b,
                            cudaStream_t stream, int max_blocks);
Status launch_nan_if_failed(const Params& p, __nv_bfloat16* a, int64_t count_a, __nv_bfloat16* b, int64_t count_b,
                            cudaStream_t stream, int max_blocks);
// Records that the forward this backward belongs to has failed (its error was already reported).
Status launch_record_forward_failed(const Params& p, cudaStream_t stream);

}  // namespace megamoe::ep
