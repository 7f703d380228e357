// SwiGLU over the received expert-major rows, forward and backward (the modular path's separate pass;
// the fused kernels do this in the GEMM epilogue).
#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {
namespace {

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + __expf(-g)); }

__global__ void swiglu_forward_kernel(Params p) {
  const Shape& s = p.shape;
  const int64_t total = at<int32_t>(p.local, p.layout.expert_offsets)[s.experts_per_rank];
  const int64_t I = s.intermediate;
  const __nv_bfloat16* h = at<__nv_bfloat16>(p.local, p.layout.h);
  __nv_bfloat16* a = at<__nv_bfloat16>(p.local, p.layout.a);
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t row = first; row < total; row += num_warps) {
    for (int64_t i = lane * 8; i < I; i += 32 * 8) {
      Bf16x8 g, u;
      g.load(h + row * 2 * I + i);
      u.load(h + row * 2 * I + I + i);
#pragma unroll
      for (int k = 0; k < 8; ++k) g.v[k] = g.v[k] * sigmoid(g.v[k]) * u.v[k];
      g.store(a + row * I + i);
    }
  }
}

// da holds d_out . W2 for each row, before the routing weight: d_topk_weights = <da, a> (DESIGN.md
// section 2, contracted on the I side so y is never kept), then dh = SwiGLU'(w * da).
template <typename DaT>
__global__ void swiglu_backward_kernel(Params p) {
  const Shape& s = p.shape;
  const int K = s.top_k;
  const int64_t total = at<int32_t>(p.local, p.layout.expert_offsets)[s.experts_per_rank];
  const int64_t I = s.intermediate;
  const __nv_bfloat16* h = at<__nv_bfloat16>(p.local, p.layout.h);
  const __nv_bfloat16* a = at<__nv_bfloat16>(p.local, p.layout.a);
  const DaT* da = at<DaT>(p.local, p.layout.da);
  __nv_bfloat16* dh = at<__nv_bfloat16>(p.local, p.layout.dh);
  const RowOrigin* origin = at<RowOrigin>(p.local, p.layout.row_origin);
  const float* row_weight = at<float>(p.local, p.layout.row_weight);
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t row = first; row < total; row += num_warps) {
    const float w = row_weight[row];
    float dot = 0.0f;
    for (int64_t i = lane * 8; i < I; i += 32 * 8) {
      Bf16x8 g, u, av, dg, du;
      g.load(h + row * 2 * I + i);
      u.load(h + row * 2 * I + I + i);
      av.load(a + row * I + i);
      float d[8];
      if constexpr (sizeof(DaT) == 4) {
        const float4 d0 = *reinterpret_cast<const float4*>(da + row * I + i);
        const float4 d1 = *reinterpret_cast<const float4*>(da + row * I + i + 4);
        d[0] = d0.x, d[1] = d0.y, d[2] = d0.z, d[3] = d0.w, d[4] = d1.x, d[5] = d1.y, d[6] = d1.z, d[7] = d1.w;
      } else {
        Bf16x8 packed;
        packed.load(reinterpret_cast<const __nv_bfloat16*>(da) + row * I + i);
#pragma unroll
        for (int k = 0; k < 8; ++k) d[k] = packed.v[k];
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        dot += d[k] * av.v[k];
        const float sg = sigmoid(g.v[k]);
        const float dak = w * d[k];
        dg.v[k] = dak * u.v[k] * sg * (1.0f + g.v[k] * (1.0f - sg));
        du.v[k] = dak * g.v[k] * sg;
      }
      dg.store(dh + row * 2 * I + i);
      du.store(dh + row * 2 * I + I + i);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) {
      const RowOrigin o = origin[row];
      at<float>(p.peers[o.src_rank], p.layout.slot_dw)[static_cast<int64_t>(o.token) * K + o.topk_slot] = dot;
    }
  }
}

}  // namespace

Status launch_swiglu_forward(const Params& p, cudaStream_t stream, int max_blocks) {
  swiglu_forward_kernel<<<row_grid(p.shape.row_capacity, max_blocks), kRowBlockThreads, 0, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH(stream, "swiglu_forward_kernel");
  return Status::ok();
}

Status launch_swiglu_backward(const Params& p, bool da_is_bf16, cudaStream_t stream, int max_blocks) {
  const int grid = row_grid(p.shape.row_capacity, max_blocks);
  if (da_is_bf16)
    swiglu_backward_kernel<__nv_bfloat16><<<grid, kRowBlockThreads, 0, stream>>>(p);
  else
    swiglu_backward_kernel<float><<<grid, kRowBlockThreads, 0, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH(stream, "swiglu_backward_kernel");
  return Status::ok();
}

Status load_swiglu_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_forward_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_backward_kernel<float>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_backward_kernel<__nv_bfloat16>));
  return Status::ok();
}

}  // namespace megamoe::ep
