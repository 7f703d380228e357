#include <cuda_runtime_api.h>

#include "kernels/hashed_fill.hpp"

namespace megamoe::kernels {
namespace {

__global__ void fill_hashed_kernel(__nv_bfloat16* dst, int64_t count, uint64_t seed, uint64_t first_index,
                                   float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16(hashed_bf16_value(seed, first_index + static_cast<uint64_t>(i), scale));
}

}  // namespace

bool fill_hashed_bf16(__nv_bfloat16* dst, int64_t count, uint64_t seed, uint64_t first_index, float scale,
                      cudaStream_t stream) {
  if (count == 0) return true;
  fill_hashed_kernel<<<1024, 256, 0, stream>>>(dst, count, seed, first_index, scale);
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace megamoe::kernels
