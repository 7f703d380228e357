// The engine's kernels of form 3 (K-grouped): the weight gradients.
#include "kernels/grouped_gemm_kernel.cuh"

namespace megamoe::kernels {

Status launch_grouped_gemm_tn(const GemmLaunch& l, cudaStream_t stream) {
  return launch_matching<GemmForm::kTN, GemmActivation::kNone>(l, stream);
}

Status preload_grouped_gemm_tn() {
  MEGAMOE_RETURN_IF_ERROR((preload_all<GemmForm::kTN, GemmActivation::kNone>()));
  return Status::ok();
}

}  // namespace megamoe::kernels
