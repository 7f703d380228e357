// The engine's kernels of form 1 (B K-major): GEMM1 / GEMM2 of the forward.
#include "kernels/grouped_gemm_kernel.cuh"

namespace megamoe::kernels {

Status launch_grouped_gemm_nt(const GemmLaunch& l, cudaStream_t stream) {
  if (l.activation == GemmActivation::kSwiGLU) return launch_matching<GemmForm::kNT, GemmActivation::kSwiGLU>(l, stream);
  return launch_matching<GemmForm::kNT, GemmActivation::kNone>(l, stream);
}

Status preload_grouped_gemm_nt() {
  MEGAMOE_RETURN_IF_ERROR((preload_all<GemmForm::kNT, GemmActivation::kNone>()));
  MEGAMOE_RETURN_IF_ERROR((preload_all<GemmForm::kNT, GemmActivation::kSwiGLU>()));
  return Status::ok();
}

}  // namespace megamoe::kernels
