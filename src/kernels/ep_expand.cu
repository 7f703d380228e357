// Receiver side of dispatch: from every source's counts to expert-major rows.
// Rows of local expert e are ordered by (source rank, the source's row index), so the order, and the
// weight-gradient summation order that follows it, never depends on timing.
#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {
namespace {

__device__ void record_everywhere(const Params& p, StatusCode code, ErrorWhat what, int64_t a, int64_t b) {
  for (int peer = 0; peer < p.shape.num_ranks; ++peer)
    record_error(error_record(p.peers[peer], p.layout), code, what, p.shape.rank, a, b);
}

__global__ void expert_offsets_kernel(Params p) {
  const Shape& s = p.shape;
  const int EL = s.experts_per_rank, R = s.num_ranks;
  const int32_t* counts = at<int32_t>(p.local, p.layout.recv_counts);
  int32_t* base = at<int32_t>(p.local, p.layout.src_expert_base);
  int32_t* offsets = at<int32_t>(p.local, p.layout.expert_offsets);
  extern __shared__ int64_t rows_per_expert[];  // [EL]
  for (int e = threadIdx.x; e < EL; e += blockDim.x) {
    int64_t running = 0;
    for (int src = 0; src < R; ++src) {
      base[src * EL + e] = static_cast<int32_t>(running);
      running += counts[src * (EL + 1) + e];
    }
    rows_per_expert[e] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int e = 0; e < EL; ++e) {
      const int64_t n = rows_per_expert[e];
      rows_per_expert[e] = total;
      total += n;
    }
    if (total > s.row_capacity) record_everywhere(p, StatusCode::kCapacityExceeded, kErrorCapacity, total, s.row_capacity);
    // On overflow every expert is left empty: nothing is written past the buffers, the GEMMs do nothing,
    // and the recorded error turns the outputs into NaN.
    const bool overflow = total > s.row_capacity;
    for (int e = 0; e < EL; ++e) offsets[e] = overflow ? 0 : static_cast<int32_t>(rows_per_expert[e]);
    offsets[EL] = overflow ? 0 : static_cast<int32_t>(total);
  }
  __syncthreads();
  for (int k = threadIdx.x; k < R * EL; k += blockDim.x) base[k] += offsets[k % EL];
}

__global__ void expand_rows_kernel(Params p) {
  const Shape& s = p.shape;
  const int EL = s.experts_per_rank, K = s.top_k;
  const int32_t* offsets = at<int32_t>(p.local, p.layout.expert_offsets);
  if (offsets[EL] == 0) return;
  const int lane = threadIdx.x % 32;
  const int32_t* counts = at<int32_t>(p.local, p.layout.recv_counts);
  const int32_t* base = at<int32_t>(p.local, p.layout.src_expert_base);
  const int32_t* recv_token = at<int32_t>(p.local, p.layout.recv_token);
  const SlotRoute* routes = at<SlotRoute>(p.local, p.layout.recv_routes);
  const float* recv_weights = at<float>(p.local, p.layout.recv_weights);
  const __nv_bfloat16* recv_x = at<__nv_bfloat16>(p.local, p.layout.recv_x);
  __nv_bfloat16* rows_x = at<__nv_bfloat16>(p.local, p.layout.rows_x);
  RowOrigin* origin = at<RowOrigin>(p.local, p.layout.row_origin);
  float* row_weight = at<float>(p.local, p.layout.row_weight);
  void** row_dest = at<void*>(p.local, p.layout.row_dest);
  const int64_t items = static_cast<int64_t>(s.num_ranks) * s.max_tokens;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t item = first; item < items; item += num_warps) {
    const int src = static_cast<int>(item / s.max_tokens);
    const int slot = static_cast<int>(item % s.max_tokens);
    if (slot >= counts[src * (EL + 1) + EL]) continue;
    const int token = recv_token[item];
    for (int j = 0; j < K; ++j) {
      const SlotRoute route = routes[item * K + j];
      if (route.local_expert < 0) continue;
      const int64_t row = base[src * EL + route.local_expert] + route.index;
      warp_copy_row(recv_x + item * s.hidden, rows_x + row * s.hidden, s.hidden, lane);
      if (lane == 0) {
        origin[row] = RowOrigin{src, slot, token, j};
        row_weight[row] = recv_weights[item * K + j];
        row_dest[row] = at<__nv_bfloat16>(p.peers[src], p.layout.combine) + (static_cast<int64_t>(token) * K + j) * s.hidden;
      }
    }
  }
}

__global__ void gather_grad_rows_kernel(Params p) {
  const Shape& s = p.shape;
  const int64_t total = at<int32_t>(p.local, p.layout.expert_offsets)[s.experts_per_rank];
  const int lane = threadIdx.x % 32;
  const RowOrigin* origin = at<RowOrigin>(p.local, p.layout.row_origin);
  const float* row_weight = at<float>(p.local, p.layout.row_weight);
  const __nv_bfloat16* recv_x = at<__nv_bfloat16>(p.local, p.layout.recv_x);
  __nv_bfloat16* rows_dout = at<__nv_bfloat16>(p.local, p.layout.rows_dout);
  __nv_bfloat16* rows_dy = at<__nv_bfloat16>(p.local, p.layout.rows_dy);
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t row = first; row < total; row += num_warps) {
    const RowOrigin o = origin[row];
    const float w = row_weight[row];
    const __nv_bfloat16* src = recv_x + (static_cast<int64_t>(o.src_rank) * s.max_tokens + o.recv_slot) * s.hidden;
    for (int64_t i = lane * 8; i < s.hidden; i += 32 * 8) {
      Bf16x8 v;
      v.load(src + i);
      v.store(rows_dout + row * s.hidden + i);
#pragma unroll
      for (int k = 0; k < 8; ++k) v.v[k] *= w;
      v.store(rows_dy + row * s.hidden + i);
    }
  }
}

}  // namespace

Status launch_expert_offsets(const Params& p, cudaStream_t stream) {
  const size_t smem = 8 * static_cast<size_t>(p.shape.experts_per_rank);
  if (smem > 48 * 1024) return Status(StatusCode::kNotSupported, "expert_offsets: too many local experts");
  expert_offsets_kernel<<<1, 256, smem, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH(stream, "expert_offsets_kernel");
  return Status::ok();
}

Status launch_expand_rows(const Params& p, cudaStream_t stream, int max_blocks) {
  expand_rows_kernel<<<row_grid(static_cast<int64_t>(p.shape.num_ranks) * p.shape.max_tokens, max_blocks),
                       kRowBlockThreads, 0, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH(stream, "expand_rows_kernel");
  return Status::ok();
}

Status launch_gather_grad_rows(const Params& p, cudaStream_t stream, int max_blocks) {
  gather_grad_rows_kernel<<<row_grid(p.shape.row_capacity, max_blocks), kRowBlockThreads, 0, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH(stream, "gather_grad_rows_kernel");
  return Status::ok();
}

Status load_expand_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, expert_offsets_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, expand_rows_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, gather_grad_rows_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
