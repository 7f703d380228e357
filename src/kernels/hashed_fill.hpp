// Reproducible pseudo-random bf16 data for tests and benchmarks: generated on the GPU from a
// counter-based hash (multi-GB weights cost no host time); the CPU regenerates any element it needs
// (for the reference) with the same function.
#pragma once

#include <cuda_bf16.h>

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::kernels {

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-scale, scale), rounded to bf16 (the value both sides use).
__host__ __device__ inline float hashed_bf16_value(uint64_t seed, uint64_t index, float scale) {
  const uint64_t bits = mix64(seed ^ mix64(index));
  const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return __bfloat162float(__float2bfloat16((2.0f * unit - 1.0f) * scale));
}

// Fills dst[i] = hashed_bf16_value(seed, first_index + i, scale) on the GPU; returns false on a CUDA error.
bool fill_hashed_bf16(__nv_bfloat16* dst, int64_t count, uint64_t seed, uint64_t first_index, float scale,
                      cudaStream_t stream = nullptr);

}  // namespace megamoe::kernels
