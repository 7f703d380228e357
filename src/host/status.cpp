#include "megamoe/status.hpp"

namespace megamoe {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kCapacityExceeded: return "capacity exceeded";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kCudaError: return "CUDA error";
    case StatusCode::kNotSupported: return "not supported";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown status";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

}  // namespace megamoe
