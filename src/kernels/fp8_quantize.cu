#include <cuda_fp8.h>

#include "kernels/cuda_check.hpp"
#include "kernels/fp8_quantize.hpp"

namespace megamoe::kernels {
namespace {

constexpr int kGroup = 128;
constexpr int kWarpsPerBlock = 8;
constexpr float kE4M3Max = 448.0f;

// One warp per 1x128 group: each lane holds 4 consecutive values (one 8-byte load).
__global__ void quantize_rows_1x128_kernel(const __nv_bfloat16* __restrict__ x, int64_t num_groups,
                                           uint8_t* __restrict__ q, float* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t group = warp; group < num_groups; group += warp_stride) {
    const int64_t base = group * kGroup + lane * 4;
    const uint2 packed = *reinterpret_cast<const uint2*>(x + base);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&packed.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&packed.y);
    const float v[4] = {__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    // Same rule as fp8::scale_from_amax: a NaN amax (all-NaN group) gives a NaN scale, not 1.
    const float scale = !(amax <= 0.0f) ? amax / kE4M3Max : 1.0f;
    uint32_t bytes = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t b = __nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3);
      bytes |= b << (8 * i);
    }
    *reinterpret_cast<uint32_t*>(q + base) = bytes;
    if (lane == 0) scales[group] = scale;
  }
}

}  // namespace

Status quantize_rows_1x128_bf16(const __nv_bfloat16* x, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % kGroup != 0)
    return Status::invalid("quantize_rows_1x128: cols must be a positive multiple of 128 and rows >= 0, got rows=" +
                           std::to_string(rows) + " cols=" + std::to_string(cols));
  if (rows == 0) return Status::ok();
  if (x == nullptr || q == nullptr || scales == nullptr)
    return Status::invalid("quantize_rows_1x128: null pointer");
  const int64_t num_groups = rows * (cols / kGroup);
  int device = 0;
  int num_sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks_needed = (num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int blocks = static_cast<int>(blocks_needed < num_sms * 16 ? blocks_needed : num_sms * 16);
  quantize_rows_1x128_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(x, num_groups, q, scales);
  MEGAMOE_CHECK_LAUNCH(stream, "quantize_rows_1x128_kernel");
  return Status::ok();
}

}  // namespace megamoe::kernels
