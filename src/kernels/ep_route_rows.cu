// Receiver side of dispatch: from every source's counts to the expert-major row numbering, without moving
// a single row. Rows of local expert e are ordered by (source rank, the source's row index), so the order,
// and the weight-gradient summation order that follows it, never depends on timing. For each row the kernel
// records where its input lies in the receive buffer (row_src, read by the GEMMs' gathering loads), its
// routing weight, and where its results go on the source rank (its combine row and its d_topk_weights
// partials, written straight there by the GEMM epilogues).
#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {
namespace {

constexpr int kRouteThreads = 256;

// Peers write the counts, routes and token indices this kernel reads: every one is checked against its
// range before it addresses anything (a violation is recorded on every rank and the value is not used).
__device__ __forceinline__ bool peer_value_ok(const Params& p, bool ok, int src, int64_t value, PeerField field) {
  if (!ok) record_error_everywhere(p, StatusCode::kInternal, kErrorPeerIndex, src, value, field);
  return ok;
}

// Every block derives the same offsets from the counts (a few hundred integers); block 0 publishes them.
__global__ void route_rows_kernel(Params p) {
  extern __shared__ int32_t base[];  // [R * EL]: first row of (source, local expert); then [EL + 1] offsets
  const Shape& s = p.shape;
  const int EL = s.experts_per_rank, R = s.num_ranks, K = s.top_k;
  int32_t* offsets = base + R * EL;
  const int32_t* counts = at<int32_t>(p.local, p.layout.recv_counts);
  const int64_t max_rows_per_source = static_cast<int64_t>(s.max_tokens) * K;
  for (int e = threadIdx.x; e < EL; e += blockDim.x) {
    int64_t running = 0;
    for (int src = 0; src < R; ++src) {
      base[src * EL + e] = static_cast<int32_t>(running);
      const int32_t n = counts[src * (EL + 1) + e];
      if (peer_value_ok(p, n >= 0 && n <= max_rows_per_source, src, n, kPeerCount)) running += n;
    }
    // Rows of expert e (scanned below); past the capacity the scan reports the overflow.
    offsets[e] = static_cast<int32_t>(running <= s.row_capacity ? running : s.row_capacity + 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int e = 0; e < EL; ++e) {
      const int64_t n = offsets[e];
      offsets[e] = static_cast<int32_t>(total);  // zeroed below on overflow
      total += n;
    }
    // On overflow every expert is left empty: nothing is written past the buffers, the GEMMs do nothing,
    // and the recorded error turns the outputs into NaN.
    const bool overflow = total > s.row_capacity;
    if (overflow) {
      for (int e = 0; e < EL; ++e) offsets[e] = 0;
      if (blockIdx.x == 0) {
        // The per-expert sums above stop at capacity + 1; the message gives the rows this call needed.
        int64_t needed = 0;
        for (int i = 0; i < R * (EL + 1); ++i) {
          const int32_t n = counts[i];
          if (i % (EL + 1) < EL && n > 0 && n <= max_rows_per_source) needed += n;
        }
        record_error_everywhere(p, StatusCode::kCapacityExceeded, kErrorCapacity, needed, s.row_capacity);
      }
    }
    offsets[EL] = overflow ? -1 : static_cast<int32_t>(total);
  }
  __syncthreads();
  const bool overflow = offsets[EL] < 0;
  if (blockIdx.x == 0) {
    int32_t* out = at<int32_t>(p.local, p.layout.expert_offsets);
    for (int e = threadIdx.x; e <= EL; e += blockDim.x) out[e] = overflow ? 0 : offsets[e];
  }
  if (overflow) return;
  for (int k = threadIdx.x; k < R * EL; k += blockDim.x) base[k] += offsets[k % EL];
  __syncthreads();

  const int32_t* recv_token = at<int32_t>(p.local, p.layout.recv_token);
  const SlotRoute* routes = at<SlotRoute>(p.local, p.layout.recv_routes);
  const float* recv_weights = at<float>(p.local, p.layout.recv_weights);
  int32_t* row_src = at<int32_t>(p.local, p.layout.row_src);
  float* row_weight = at<float>(p.local, p.layout.row_weight);
  void** row_dest = at<void*>(p.local, p.layout.row_dest);
  float** row_dot_dest = at<float*>(p.local, p.layout.row_dot_dest);
  const int64_t items = static_cast<int64_t>(R) * s.max_tokens;
  for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int src = static_cast<int>(item / s.max_tokens);
    const int slot = static_cast<int>(item % s.max_tokens);
    const int32_t tokens = counts[src * (EL + 1) + EL];
    if (slot == 0) (void)peer_value_ok(p, tokens >= 0 && tokens <= s.max_tokens, src, tokens, kPeerTokens);
    if (slot >= tokens) continue;
    const int64_t token = recv_token[item];
    if (!peer_value_ok(p, token >= 0 && token < s.max_tokens, src, token, kPeerToken)) continue;
    for (int j = 0; j < K; ++j) {
      const SlotRoute route = routes[item * K + j];
      if (route.local_expert < 0) continue;
      if (!peer_value_ok(p, route.local_expert < EL, src, route.local_expert, kPeerLocalExpert)) continue;
      const int32_t rows_of_source = counts[src * (EL + 1) + route.local_expert];
      if (!peer_value_ok(p, route.index >= 0 && route.index < rows_of_source, src, route.index, kPeerRowIndex))
        continue;
      const int64_t row = base[src * EL + route.local_expert] + route.index;
      const int64_t pair = token * K + j;
      row_src[row] = static_cast<int32_t>(item);
      row_weight[row] = recv_weights[item * K + j];
      row_dest[row] = at<__nv_bfloat16>(p.peers[src], p.layout.combine) + pair * s.hidden;
      row_dot_dest[row] = at<float>(p.peers[src], p.layout.slot_dots) + pair * s.dot_parts;
    }
  }
}

}  // namespace

Status launch_route_rows(const Params& p, cudaStream_t stream, int max_blocks) {
  const size_t smem = 4 * (static_cast<size_t>(p.shape.num_ranks) * p.shape.experts_per_rank + p.shape.experts_per_rank + 1);
  if (smem > 48 * 1024) return Status(StatusCode::kNotSupported, "route_rows: too many experts");
  const int64_t items = static_cast<int64_t>(p.shape.num_ranks) * p.shape.max_tokens;
  int64_t blocks = (items + kRouteThreads - 1) / kRouteThreads;
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  route_rows_kernel<<<static_cast<int>(blocks), kRouteThreads, smem, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH(stream, "route_rows_kernel");
  return Status::ok();
}

Status load_route_rows_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, route_rows_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
