// The grid of a warp-per-item kernel on the current device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda_check.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

// `needed` blocks, at most 16 per SM (the kernel's warps stride over the rest of their items).
inline Status warp_grid(int64_t needed, int* blocks) {
  int device = 0;
  int num_sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  *blocks = static_cast<int>(needed < num_sms * 16 ? needed : num_sms * 16);
  return Status::ok();
}

}  // namespace megamoe::kernels
