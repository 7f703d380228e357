// Shared by the layer's data-movement kernels: one warp per row (or token), grid-stride over rows,
// 16-byte accesses (8 bf16 per lane per step).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace megamoe::ep {

inline constexpr int kRowWarpsPerBlock = 8;
inline constexpr int kRowBlockThreads = kRowWarpsPerBlock * 32;

// These kernels wait on nothing, so they may queue more blocks than fit at once; latency-bound row copies
// need many warps in flight (with one 256-thread block per SM the combine at H = 2048, T = 16384, K = 8 took
// 0.58 ms, about 4x the time its bytes take at the measured copy bandwidth).
inline constexpr int kRowBlocksPerSm = 8;

// Blocks of a warp-per-row grid over `rows`, capped at kRowBlocksPerSm blocks per SM of the rank's share
// (max_blocks: its SMs).
inline int row_grid(int64_t rows, int max_blocks) {
  const int64_t blocks = (rows + kRowWarpsPerBlock - 1) / kRowWarpsPerBlock;
  const int64_t cap = static_cast<int64_t>(max_blocks) * kRowBlocksPerSm;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

__device__ __forceinline__ int64_t first_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}
__device__ __forceinline__ int64_t warp_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x / 32; }

__device__ __forceinline__ void warp_copy_row(const __nv_bfloat16* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                              int64_t elements, int lane) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const int64_t n = elements / 8;
  // Four independent 16-byte loads in flight per lane before the first store (a row of H = 2048 is
  // 256 of them: two batches per lane).
  constexpr int kBatch = 4;
  int64_t i = lane;
  for (; i + 32 * (kBatch - 1) < n; i += 32 * kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = s[i + 32 * k];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) d[i + 32 * k] = v[k];
  }
  for (; i < n; i += 32) d[i] = s[i];
}

// Eight bf16 values as fp32: unpacked from one 16-byte load, stored back rounded to nearest.
struct Bf16x8 {
  float v[8];
  __device__ __forceinline__ void unpack(const uint4& raw) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ void store(__nv_bfloat16* p) const {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

}  // namespace megamoe::ep
