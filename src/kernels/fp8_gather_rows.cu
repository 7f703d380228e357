// One warp per row: the row copied by the layer's warp row copy (ep_row_copy.cuh: 16-byte pieces, four in
// flight a lane), the row's scales by the first cols / 128 lanes. The rows revisit a receive buffer (top-K
// copies of a token), but by the time of the copy it is no longer in L2: the copy runs at DRAM bandwidth,
// reads and writes (docs/PERF.md run 62).
#include <string>

#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/ep_row_copy.cuh"
#include "kernels/fp8_gather_rows.hpp"
#include "kernels/warp_grid.hpp"

namespace megamoe::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void gather_rows_e4m3_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                        int64_t source_rows, const int32_t* __restrict__ row_src, int64_t cols,
                                        const int32_t* __restrict__ rows_used, int64_t capacity,
                                        uint8_t* __restrict__ out_q, float* __restrict__ out_s, int64_t pitch) {
  device::begin_dependent_grid();
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t rows = min(max(static_cast<int64_t>(__ldg(rows_used)), int64_t{0}), capacity);
  const int64_t groups = cols / 128;
  for (int64_t r = ep::first_warp(); r < rows; r += ep::warp_count()) {
    const int64_t src = min(max(static_cast<int64_t>(__ldg(row_src + r)), int64_t{0}), source_rows - 1);
    // The e4m3 bytes as bf16 pairs, as the dispatch copies them (ep_dispatch.cuh): the same 16-byte pieces.
    ep::warp_copy_row(reinterpret_cast<const __nv_bfloat16*>(q + src * cols),
                      reinterpret_cast<__nv_bfloat16*>(out_q + r * cols), cols / 2, lane);
    for (int64_t kb = lane; kb < groups; kb += 32) out_s[kb * pitch + r] = __ldg(scales + src * groups + kb);
  }
}

}  // namespace

Status gather_rows_e4m3(const uint8_t* q, const float* scales, int64_t source_rows, const int32_t* row_src,
                        int64_t cols, const int32_t* rows_used, int64_t capacity, uint8_t* out_q, float* out_s,
                        int64_t scales_pitch, cudaStream_t stream) {
  if (cols <= 0 || cols % 128 != 0 || capacity < 0)
    return Status::invalid("gather_rows_e4m3: cols must be a positive multiple of 128 and capacity >= 0, got cols=" +
                           std::to_string(cols) + " capacity=" + std::to_string(capacity));
  if (capacity == 0) return Status::ok();
  if (source_rows < 1) return Status::invalid("gather_rows_e4m3: source_rows must be >= 1");
  if (scales_pitch < capacity)
    return Status::invalid("gather_rows_e4m3: scales_pitch must be at least capacity=" + std::to_string(capacity) +
                           ", got " + std::to_string(scales_pitch));
  if (q == nullptr || scales == nullptr || row_src == nullptr || rows_used == nullptr || out_q == nullptr ||
      out_s == nullptr)
    return Status::invalid("gather_rows_e4m3: null pointer");
  if ((reinterpret_cast<uintptr_t>(q) & 15u) != 0 || (reinterpret_cast<uintptr_t>(out_q) & 15u) != 0)
    return Status::invalid("gather_rows_e4m3: q and out_q must be 16-byte aligned");
  int blocks = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid((capacity + kWarpsPerBlock - 1) / kWarpsPerBlock, &blocks));
  return kernels::launch_dependent(gather_rows_e4m3_kernel, dim3(blocks), dim3(kWarpsPerBlock * 32), 0, stream,
                                   "gather_rows_e4m3_kernel", q, scales, source_rows, row_src, cols, rows_used,
                                   capacity, out_q, out_s, scales_pitch);
}

Status gather_rows_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, gather_rows_e4m3_kernel));
  return Status::ok();
}

}  // namespace megamoe::kernels
