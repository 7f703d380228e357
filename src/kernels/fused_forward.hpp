// The fused forward's launcher (fused_forward_kernel.cuh): one persistent kernel per rank that does what the
// modular forward's kernels do (layout, dispatch, route_rows, GEMM1 + SwiGLU, GEMM2, combine, its barrier)
// and leaves the workspace as they do. Asynchronous on `stream`, no host synchronisation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "comm/ep_workspace.hpp"
#include "megamoe/status.hpp"

namespace megamoe::ep {

struct FusedForwardArgs {
  const __nv_bfloat16* x = nullptr;
  const void* topk_idx = nullptr;
  bool idx_is_int64 = true;
  const float* topk_weights = nullptr;
  const __nv_bfloat16* w13 = nullptr;
  const __nv_bfloat16* w2 = nullptr;
  __nv_bfloat16* out = nullptr;
};

// Whether the fused forward runs this shape (local experts, ranks, the layout's and routing's shared-memory
// tables); the message names the limit otherwise.
Status check_fused_forward_shape(const Shape& s);

// max_blocks: the rank's SMs (one CTA each, all resident: virtual ranks share a GPU).
Status launch_fused_forward(const Params& p, const FusedForwardArgs& args, int max_blocks, cudaStream_t stream);

Status load_fused_forward_kernels();

}  // namespace megamoe::ep
