// Combine on the source rank: the K rows a token's slots sent home are summed in slot order (0..K-1), in
// fp32, so the result is bitwise reproducible; the backward also sums each slot's d_topk_weights partials
// in n-tile order. A recorded error turns the call's outputs into NaN.
#include <cmath>

#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {
namespace {

template <bool kWeighted>
__global__ void combine_kernel(Params p, const float* __restrict__ topk_weights, __nv_bfloat16* __restrict__ out,
                               float* __restrict__ d_topk_weights) {
  const Shape& s = p.shape;
  const int K = s.top_k;
  const int64_t H = s.hidden;
  const bool failed = has_error(p);
  const int32_t* dest_slot = at<int32_t>(p.local, p.layout.pair_dest_slot);
  const __nv_bfloat16* combine = at<__nv_bfloat16>(p.local, p.layout.combine);
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  // Slots are loaded four at a time before they are added (in slot order): several 16-byte loads in flight.
  constexpr int kBatch = 4;
  for (int64_t t = first; t < p.num_tokens; t += num_warps) {
    for (int64_t i = lane * 8; i < H; i += 32 * 8) {
      Bf16x8 acc;
#pragma unroll
      for (int k = 0; k < 8; ++k) acc.v[k] = failed ? NAN : 0.0f;
      for (int j0 = 0; j0 < K && !failed; j0 += kBatch) {
        Bf16x8 y[kBatch];
        float w[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int j = j0 + b;
          w[b] = 0.0f;
          if (j < K && dest_slot[t * K + j] >= 0) {
            y[b].load(combine + (t * K + j) * H + i);
            w[b] = kWeighted ? topk_weights[t * K + j] : 1.0f;
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int j = j0 + b;
          if (j >= K || dest_slot[t * K + j] < 0) continue;
#pragma unroll
          for (int k = 0; k < 8; ++k) acc.v[k] += w[b] * y[b].v[k];
        }
      }
      acc.store(out + t * H + i);
    }
    if (!kWeighted) {
      const float* dots = at<float>(p.local, p.layout.slot_dots);
      for (int j = lane; j < K; j += 32) {
        float dw = 0.0f;
        if (failed) {
          dw = NAN;
        } else if (dest_slot[t * K + j] >= 0) {
          for (int part = 0; part < s.dot_parts; ++part) dw += dots[(t * K + j) * s.dot_parts + part];
        }
        d_topk_weights[t * K + j] = dw;
      }
    }
  }
}

}  // namespace

Status launch_combine_forward(const Params& p, const float* topk_weights, __nv_bfloat16* out, cudaStream_t stream,
                              int max_blocks) {
  if (p.num_tokens == 0) return Status::ok();
  combine_kernel<true><<<row_grid(p.num_tokens, max_blocks), kRowBlockThreads, 0, stream>>>(p, topk_weights, out,
                                                                                                nullptr);
  MEGAMOE_CHECK_LAUNCH(stream, "combine_forward_kernel");
  return Status::ok();
}

Status launch_combine_backward(const Params& p, __nv_bfloat16* d_x, float* d_topk_weights, cudaStream_t stream,
                               int max_blocks) {
  if (p.num_tokens == 0) return Status::ok();
  combine_kernel<false><<<row_grid(p.num_tokens, max_blocks), kRowBlockThreads, 0, stream>>>(p, nullptr, d_x,
                                                                                                 d_topk_weights);
  MEGAMOE_CHECK_LAUNCH(stream, "combine_backward_kernel");
  return Status::ok();
}

Status load_combine_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_kernel<true>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_kernel<false>));
  return Status::ok();
}

}  // namespace megamoe::ep
