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

// Programmatic dependent launch of the modular path's kernels: each kernel's CTAs may be scheduled while
// the kernel before it in the stream finishes, and wait on the GPU for its results (no host involvement,
// the same results). Off by default: on an H100 it gave the same bits but no shorter step (docs/PERF.md runs
// 104-105); MEGAMOE_DEPENDENT_LAUNCH=1 in the environment, or set_dependent_launch(true), turns it on; off is
// the ordinary stream order. Process-wide,
// read at each launch: a change applies to the kernels launched after it.
void set_dependent_launch(bool enabled);
bool dependent_launch_enabled();

}  // namespace megamoe
