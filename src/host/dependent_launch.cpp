#include <atomic>
#include <cstdlib>
#include <cstring>

#include "megamoe/device.hpp"

namespace megamoe {
namespace {

bool enabled_by_environment() {
  const char* value = std::getenv("MEGAMOE_DEPENDENT_LAUNCH");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

std::atomic<bool>& dependent_launch_flag() {
  static std::atomic<bool> flag{enabled_by_environment()};
  return flag;
}

}  // namespace

void set_dependent_launch(bool enabled) { dependent_launch_flag().store(enabled, std::memory_order_relaxed); }

bool dependent_launch_enabled() { return dependent_launch_flag().load(std::memory_order_relaxed); }

}  // namespace megamoe
