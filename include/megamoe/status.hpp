// Error reporting shared by every public entry point: a code a program can branch on and a message a
// person can act on. Nothing in megamoe throws across the public API.
#pragma once

#include <string>
#include <utility>

namespace megamoe {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,   // a field or tensor that breaks a documented rule
  kCapacityExceeded = 2,  // a rank would receive more rows than its buffers hold
  kTimeout = 3,           // a device spin-wait gave up (a peer never arrived)
  kCudaError = 4,         // a CUDA runtime or driver call failed
  kNotSupported = 5,      // valid request this build or device cannot run (e.g. no GPU)
  kInternal = 6,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  static Status invalid(std::string message) { return {StatusCode::kInvalidArgument, std::move(message)}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: hidden (H) must be a multiple of 128, got 100"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace megamoe

// Propagate a non-OK Status to the caller.
#define MEGAMOE_RETURN_IF_ERROR(expr)            \
  do {                                           \
    ::megamoe::Status megamoe_status_ = (expr);  \
    if (!megamoe_status_.is_ok()) return megamoe_status_; \
  } while (0)
