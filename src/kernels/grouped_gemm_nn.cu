// The engine's kernels of form 2 (B N-major): the activation gradients.
#include "kernels/grouped_gemm_kernel.cuh"

namespace megamoe::kernels {

Status launch_grouped_gemm_nn(const GemmLaunch& l, cudaStream_t stream) {
  if (l.activation == GemmActivation::kSwiGLUBackward) return launch_matching<GemmForm::kNN, GemmActivation::kSwiGLUBackward>(l, stream);
  return launch_matching<GemmForm::kNN, GemmActivation::kNone>(l, stream);
}

Status preload_grouped_gemm_nn() {
  MEGAMOE_RETURN_IF_ERROR((preload_all<GemmForm::kNN, GemmActivation::kNone>()));
  MEGAMOE_RETURN_IF_ERROR((preload_all<GemmForm::kNN, GemmActivation::kSwiGLUBackward>()));
  return Status::ok();
}

}  // namespace megamoe::kernels
