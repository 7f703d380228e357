#include <cstdio>

#include "megamoe/config.hpp"

int main() {
  const megamoe::LayerConfig config = megamoe::LayerConfig::qwen3_30b_a3b();
  std::printf("megamoe: %s\n", config.to_string().c_str());
  return 0;
}
