// Turning CUDA return codes into megamoe::Status, so that no CUDA failure passes silently.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "megamoe/status.hpp"

namespace megamoe {

inline Status cuda_status(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + " failed at " + file + ":" + std::to_string(line) +
                                            ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// After a kernel launch: the launch error always (no sync); in debug builds also the execution error,
// by synchronising the stream, so that a faulting kernel is named at its own launch.
inline Status check_launch(cudaStream_t stream, const char* kernel, const char* file, int line) {
  MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), kernel, file, line));
#ifndef NDEBUG
  MEGAMOE_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream), kernel, file, line));
#else
  (void)stream;
#endif
  return Status::ok();
}

}  // namespace megamoe

#define MEGAMOE_CUDA_RETURN_IF_ERROR(call) \
  MEGAMOE_RETURN_IF_ERROR(::megamoe::cuda_status((call), #call, __FILE__, __LINE__))

#define MEGAMOE_CHECK_LAUNCH(stream, kernel_name) \
  MEGAMOE_RETURN_IF_ERROR(::megamoe::check_launch((stream), (kernel_name), __FILE__, __LINE__))
