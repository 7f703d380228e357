#include "megamoe/device.hpp"

#if MEGAMOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace megamoe {

DeviceInfo query_device() {
  DeviceInfo info;
#if MEGAMOE_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    info.why_unavailable = err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device";
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    info.why_unavailable = "cudaGetDeviceProperties failed";
    return info;
  }
  info.available = true;
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
#else
  info.why_unavailable = "built without CUDA";
#endif
  return info;
}

}  // namespace megamoe
