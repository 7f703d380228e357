#include <gtest/gtest.h>

#include "megamoe/config.hpp"

namespace megamoe {
namespace {

TEST(ConfigTest, NamedConfigsAreValid) {
  EXPECT_TRUE(validate(LayerConfig::qwen3_30b_a3b()).is_ok());
  EXPECT_TRUE(validate(LayerConfig::qwen3_235b_a22b()).is_ok());
  EXPECT_TRUE(validate(LayerConfig::deepseek_v3()).is_ok());
}

}  // namespace
}  // namespace megamoe
