// The layout step of the forward: deterministic numbering of every routed (token, slot) on the source.
//
// Order: the tokens are cut into one contiguous chunk per warp; a warp walks its chunk 32 tokens at a
// time and, for each slot j, numbers the lanes that share a key (an expert, or a destination rank on a
// token's first slot there) with __match_any_sync. Two passes over the same order: the first counts
// per warp, a scan over warps gives each warp's base, the second assigns. No atomics on the data path,
// so the numbering, and with it every later summation order, is identical from run to run.
#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"

namespace megamoe::ep {
namespace {

constexpr int kMaxLayoutWarps = 32;
constexpr int64_t kLayoutSmemBytes = 96 * 1024;

template <typename Index>
__device__ __forceinline__ int expert_at(const Index* idx, int64_t t, int64_t T, int K, int j) {
  return t < T ? static_cast<int>(idx[t * K + j]) : -1;
}

// Destination rank of slot j if j is the token's first slot on that rank, else -1.
template <typename Index>
__device__ __forceinline__ int first_send_rank(const Index* idx, int64_t t, int64_t T, int K, int j, int EL) {
  const int e = expert_at(idx, t, T, K, j);
  if (e < 0) return -1;
  const int d = e / EL;
  for (int jj = 0; jj < j; ++jj) {
    const int ee = expert_at(idx, t, T, K, jj);
    if (ee >= 0 && ee / EL == d) return -1;
  }
  return d;
}

template <typename Index>
__global__ void layout_kernel(Params p, const Index* __restrict__ idx) {
  extern __shared__ int32_t smem[];
  const Shape& s = p.shape;
  const int E = s.num_experts, R = s.num_ranks, K = s.top_k, EL = s.experts_per_rank;
  const int keys = E + R;
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t T = p.num_tokens;
  int32_t* hist = smem;                   // [warps][keys]
  int32_t* totals = smem + warps * keys;  // [keys]
  int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  int32_t* send_rank = at<int32_t>(p.local, p.layout.pair_send_rank);
  int32_t* row_index = at<int32_t>(p.local, p.layout.pair_row_index);

  // Reject the whole call on any id outside [-1, E): nothing is sent, every receiver gets zero counts.
  bool bad = false;
  for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
    const int64_t e = static_cast<int64_t>(idx[i]);
    if (e < -1 || e >= E) {
      bad = true;
      // Every rank learns of it: the whole call's outputs become NaN rather than partly stale.
      for (int peer = 0; peer < R; ++peer)
        record_error(error_record(p.peers[peer], p.layout), StatusCode::kInvalidArgument, kErrorExpertId, s.rank, i / K,
                     e);
    }
  }
  if (__syncthreads_or(bad)) {
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) dest_slot[i] = send_rank[i] = row_index[i] = -1;
    for (int k = threadIdx.x; k < R * (EL + 1); k += blockDim.x)
      at<int32_t>(p.peers[k / (EL + 1)], p.layout.recv_counts)[s.rank * (EL + 1) + k % (EL + 1)] = 0;
    return;
  }

  for (int k = threadIdx.x; k < warps * keys; k += blockDim.x) hist[k] = 0;
  __syncthreads();
  const int64_t chunk = (T + warps - 1) / warps;
  const int64_t begin = warp * chunk;
  const int64_t end = begin + chunk < T ? begin + chunk : T;
  int32_t* my_hist = hist + warp * keys;
  const unsigned lanes_below = (1u << lane) - 1u;

  // pass 1: per-warp counts; pass 2 (assign == true): numbering from the scanned bases.
  for (int assign = 0; assign < 2; ++assign) {
    for (int64_t step = begin; step < end; step += 32) {
      const int64_t t = step + lane;
      const bool live = t < end;
      for (int j = 0; j < K; ++j) {
        const int e = live ? expert_at(idx, t, T, K, j) : -1;
        const int d = live ? first_send_rank(idx, t, T, K, j, EL) : -1;
        for (int which = 0; which < 2; ++which) {
          const int key = which == 0 ? e : (d >= 0 ? E + d : -1);
          const unsigned peers = __match_any_sync(0xffffffffu, key);
          const bool leader = (peers & lanes_below) == 0;
          int32_t number = 0;
          if (key >= 0 && assign) number = my_hist[key] + __popc(peers & lanes_below);
          __syncwarp();
          if (key >= 0 && leader) my_hist[key] += __popc(peers);
          __syncwarp();
          if (assign && live) {
            const int64_t pair = t * K + j;
            if (which == 0) {
              row_index[pair] = e >= 0 ? number : -1;
            } else if (key >= 0) {
              send_rank[pair] = d;
              dest_slot[pair] = number;
            } else {
              send_rank[pair] = -1;
              int32_t slot = -1;  // a later slot on an already-visited rank shares the first one's slot
              if (e >= 0)
                for (int jj = 0; jj < j; ++jj)
                  if (send_rank[t * K + jj] == e / EL) slot = dest_slot[t * K + jj];
              dest_slot[pair] = slot;
            }
          }
        }
      }
    }
    __syncthreads();
    if (!assign) {
      for (int key = threadIdx.x; key < keys; key += blockDim.x) {
        int32_t running = 0;
        for (int w = 0; w < warps; ++w) {
          const int32_t c = hist[w * keys + key];
          hist[w * keys + key] = running;
          running += c;
        }
        totals[key] = running;
      }
      __syncthreads();
    }
  }

  // Counts to every receiver: rows per local expert, then the number of tokens.
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    at<int32_t>(p.peers[e / EL], p.layout.recv_counts)[s.rank * (EL + 1) + e % EL] = totals[e];
  for (int d = threadIdx.x; d < R; d += blockDim.x)
    at<int32_t>(p.peers[d], p.layout.recv_counts)[s.rank * (EL + 1) + EL] = totals[E + d];
}

}  // namespace

Status launch_layout(const Params& p, const void* topk_idx, bool idx_is_int64, cudaStream_t stream) {
  const int keys = p.shape.num_experts + p.shape.num_ranks;
  int warps = static_cast<int>((kLayoutSmemBytes / 4 - keys) / keys);
  if (warps > kMaxLayoutWarps) warps = kMaxLayoutWarps;
  if (warps < 1) return Status(StatusCode::kNotSupported, "layout: E + R too large for the layout kernel");
  const size_t smem = static_cast<size_t>(warps + 1) * keys * 4;
  if (idx_is_int64) {
    auto kernel = layout_kernel<int64_t>;
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<1, warps * 32, smem, stream>>>(p, static_cast<const int64_t*>(topk_idx));
  } else {
    auto kernel = layout_kernel<int32_t>;
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<1, warps * 32, smem, stream>>>(p, static_cast<const int32_t*>(topk_idx));
  }
  MEGAMOE_CHECK_LAUNCH(stream, "layout_kernel");
  return Status::ok();
}

Status load_layout_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, layout_kernel<int64_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, layout_kernel<int32_t>));
  return Status::ok();
}

}  // namespace megamoe::ep
