// Programmatic dependent launch, the host's side (the kernel's: device/ptx/grid_dependency.cuh). The
// modular path runs some thirty kernels a training step, each waiting for the one before it; launched
// this way, a kernel's CTAs are scheduled while its predecessor's last CTAs still run, so the launch
// latency and the ramp-up hide under the predecessor's tail, and the kernel's first instructions wait in
// device::wait_for_prior_grids instead. Every kernel launched here calls that wait before it touches
// global memory. The process-wide switch (megamoe/device.hpp) turns the attribute off, which gives the
// ordinary stream order with the same kernels.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda_check.hpp"
#include "megamoe/device.hpp"

namespace megamoe::kernels {

inline void set_dependent_launch_attribute(cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute->val.programmaticStreamSerializationAllowed = dependent_launch_enabled() ? 1 : 0;
}

// `name` names the kernel in a launch error.
template <class... Params, class... Args>
Status launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                        const char* name, Args&&... args) {
  cudaLaunchAttribute attribute[1]{};
  set_dependent_launch_attribute(&attribute[0]);
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  MEGAMOE_RETURN_IF_ERROR(
      cuda_status(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name, __FILE__, __LINE__));
  MEGAMOE_CHECK_LAUNCH(stream, name);
  return Status::ok();
}

}  // namespace megamoe::kernels
