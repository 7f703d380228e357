// The layout step of the modular forward: ep_layout.cuh's two phases as two kernels (the launch boundary
// between them is the grid-wide dependency of the numbering on every CTA's counts).
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_layout.cuh"

namespace megamoe::ep {
namespace {

constexpr int kLayoutWarps = 8;
constexpr int kLayoutThreads = kLayoutWarps * 32;

template <typename Index>
__global__ void layout_count_kernel(Params p, const Index* __restrict__ idx) {
  extern __shared__ int32_t counts[];
  device::begin_dependent_grid();
  layout_count<kLayoutWarps>(p, idx, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), counts);
}

template <typename Index>
__global__ void layout_assign_kernel(Params p, const Index* __restrict__ idx) {
  extern __shared__ int32_t smem[];
  device::begin_dependent_grid();
  layout_assign<kLayoutWarps>(p, idx, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), smem, false);
}

template <typename Index>
Status launch_layout_typed(const Params& p, const Index* idx, cudaStream_t stream, int max_blocks) {
  const size_t count_smem = static_cast<size_t>(layout_count_smem(p.shape));
  const size_t assign_smem = static_cast<size_t>(layout_assign_smem<kLayoutWarps>(p.shape));
  if (static_cast<int64_t>(assign_smem) > kLayoutSmemLimit)
    return Status(StatusCode::kNotSupported, "layout: E + R too large for the layout kernel");
  const int blocks = layout_blocks(p.num_tokens, max_blocks);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(layout_count_kernel<Index>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(count_smem)));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(layout_assign_kernel<Index>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(assign_smem)));
  MEGAMOE_RETURN_IF_ERROR(kernels::launch_dependent(layout_count_kernel<Index>, dim3(blocks), dim3(kLayoutThreads),
                                                    count_smem, stream, "layout_count_kernel", p, idx));
  return kernels::launch_dependent(layout_assign_kernel<Index>, dim3(blocks), dim3(kLayoutThreads), assign_smem,
                                   stream, "layout_assign_kernel", p, idx);
}

}  // namespace

Status launch_layout(const Params& p, const void* topk_idx, bool idx_is_int64, cudaStream_t stream, int max_blocks) {
  if (idx_is_int64) return launch_layout_typed(p, static_cast<const int64_t*>(topk_idx), stream, max_blocks);
  return launch_layout_typed(p, static_cast<const int32_t*>(topk_idx), stream, max_blocks);
}

Status load_layout_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, layout_count_kernel<int64_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, layout_count_kernel<int32_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, layout_assign_kernel<int64_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, layout_assign_kernel<int32_t>));
  return Status::ok();
}

}  // namespace megamoe::ep
