// What GPU, if any, this process can use.
#pragma once

#include <string>

namespace megamoe {

struct DeviceInfo {
  bool available = false;
  std::string name;          // e.g. "NVIDIA H200"
  int compute_major = 0;
  int compute_minor = 0;
  int multiprocessors = 0;
  std::string why_unavailable;  // filled when !available
  bool is_hopper() const { return available && compute_major == 9; }
};

// Device 0 as the CUDA runtime sees it; never fails (a build without CUDA reports "built without CUDA").
DeviceInfo query_device();

}  // namespace megamoe
