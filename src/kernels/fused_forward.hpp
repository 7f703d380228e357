// The fused kernels' launchers (fused_forward_kernel.cuh, fused_backward_kernel.cuh): one persistent kernel per
// rank that does what the modular forward's kernels do (layout, dispatch, route_rows, GEMM1 + SwiGLU, GEMM2,
// combine, its barrier) and leaves the workspace as they do; and one that does the modular backward's data
// path (dispatch of d_out, both dgrad GEMMs, combine, its barrier). Asynchronous on `stream`, no host
// synchronisation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "comm/ep_workspace.hpp"
#include "megamoe/status.hpp"

namespace megamoe::ep {

// The moments a CTA of the fused forward stamps into FusedForwardArgs::timeline (global timer, ns), when set.
enum FusedStamp : int {
  kStampStart = 0,     // kernel entry
  kStampLayout = 1,    // the layout numbered (second grid barrier passed)
  kStampDispatch = 2,  // this CTA's dispatch done (comm CTAs; the others: right after kStampLayout)
  kStampCounts = 3,    // every source's counts in, the GEMM work numbered
  kStampRouted = 4,    // this CTA's routing done (comm CTAs; the others: right after kStampCounts)
  kStampGemms = 5,     // the CTA's last GEMM item done
  kStampCombined = 6,  // its tokens combined
  kStampEnd = 7,       // the rank barrier passed, outputs final
  // Not moments: what the CTA's producer did in the GEMM phase.
  kStampGateWaitNs = 8,  // ns its first thread spent at readiness gates (rows_ready, act_ready)
  kStampItems = 9,       // GEMM items it loaded
};
inline constexpr int kFusedTimelineStamps = 10;

struct FusedForwardArgs {
  const __nv_bfloat16* x = nullptr;
  const void* topk_idx = nullptr;
  bool idx_is_int64 = true;
  const float* topk_weights = nullptr;
  const __nv_bfloat16* w13 = nullptr;
  const __nv_bfloat16* w2 = nullptr;
  __nv_bfloat16* out = nullptr;
  uint64_t* timeline = nullptr;  // diagnostics (ExpertParallelLayer::set_fused_timeline)
  int wave_lag = 1;              // ExpertParallelLayer::set_fused_wave_lag
};

struct FusedBackwardArgs {
  const __nv_bfloat16* d_out = nullptr;
  const __nv_bfloat16* w13 = nullptr;  // the forward's weights
  const __nv_bfloat16* w2 = nullptr;
  __nv_bfloat16* d_x = nullptr;
  float* d_topk_weights = nullptr;
  uint64_t* timeline = nullptr;  // diagnostics (ExpertParallelLayer::set_fused_timeline)
  int wave_lag = 1;              // ExpertParallelLayer::set_fused_wave_lag
};

// Whether the fused forward runs this shape (local experts, ranks, the layout's and routing's shared-memory
// tables); the message names the limit otherwise.
Status check_fused_forward_shape(const Shape& s);

// max_blocks: the rank's SMs (one CTA each, all resident: virtual ranks share a GPU).
Status launch_fused_forward(const Params& p, const FusedForwardArgs& args, int max_blocks, cudaStream_t stream);

// The fused backward's data path (fused_backward_kernel.cuh): d_out dispatched, both dgrad GEMMs, d_x and
// d_topk_weights combined, the rank barrier; the forward's routing and h must be in the workspace. The same
// shapes as the fused forward (check_fused_forward_shape).
Status launch_fused_backward(const Params& p, const FusedBackwardArgs& args, int max_blocks, cudaStream_t stream);

// Loads the fused kernels and sets their shared memory size; the layer calls it at creation, before any launch.
Status load_fused_forward_kernels();

}  // namespace megamoe::ep
