// Sends finished expert-major rows home: row r goes to its (token, slot) in the source rank's combine
// buffer (row_dest, a peer address). Used when the GEMM cannot store to per-row peer addresses itself.
#include "comm/device_sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/ep_row_copy.cuh"

namespace megamoe::ep {
namespace {

__global__ void send_rows_kernel(Params p, const __nv_bfloat16* __restrict__ rows) {
  const int64_t total = at<int32_t>(p.local, p.layout.expert_offsets)[p.shape.experts_per_rank];
  void* const* row_dest = at<void*>(p.local, p.layout.row_dest);
  const int lane = threadIdx.x % 32;
  const int64_t first = first_warp(), num_warps = warp_count();
  for (int64_t row = first; row < total; row += num_warps)
    warp_copy_row(rows + row * p.shape.hidden, static_cast<__nv_bfloat16*>(row_dest[row]), p.shape.hidden, lane);
}

}  // namespace

Status launch_send_rows(const Params& p, const __nv_bfloat16* rows, cudaStream_t stream, int max_blocks) {
  send_rows_kernel<<<row_grid(p.shape.row_capacity, max_blocks), kRowBlockThreads, 0, stream>>>(p, rows);
  MEGAMOE_CHECK_LAUNCH(stream, "send_rows_kernel");
  return Status::ok();
}

Status load_send_rows_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, send_rows_kernel));
  return Status::ok();
}

}  // namespace megamoe::ep
