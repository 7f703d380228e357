// The C ABI as a binding sees it: status codes, messages, and no crash when the GPU layer is missing.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "megamoe/config.hpp"
#include "megamoe/megamoe.h"
#include "megamoe/status.hpp"

namespace {

megamoe_config small_config() {
  megamoe_config c{};
  c.hidden = 256;
  c.intermediate = 128;
  c.num_experts = 8;
  c.top_k = 2;
  c.num_ranks = 2;
  c.max_tokens_per_rank = 64;
  c.precision = MEGAMOE_PRECISION_BF16;
  return c;
}

std::string last_error() { return megamoe_last_error(); }

TEST(CApiTest, AbiVersionMatchesHeader) { EXPECT_EQ(megamoe_abi_version(), MEGAMOE_ABI_VERSION); }

TEST(CApiTest, ValidConfigPassesAndClearsLastError) {
  megamoe_config bad = small_config();
  bad.hidden = 100;
  ASSERT_NE(megamoe_validate_config(&bad), MEGAMOE_OK);
  ASSERT_FALSE(last_error().empty());

  megamoe_config good = small_config();
  EXPECT_EQ(megamoe_validate_config(&good), MEGAMOE_OK);
  EXPECT_EQ(last_error(), "");
}

TEST(CApiTest, InvalidConfigReportsTheCppMessage) {
  megamoe_config c = small_config();
  c.hidden = 100;
  EXPECT_EQ(megamoe_validate_config(&c), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(last_error(), "hidden (H) must be a multiple of 128, got 100");

  // Same verdict as the C++ validate() for another rule.
  c = small_config();
  c.num_experts = 6;
  c.num_ranks = 4;
  EXPECT_EQ(megamoe_validate_config(&c), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("divisible by num_ranks"), std::string::npos) << last_error();
}

TEST(CApiTest, UnknownPrecisionAndReservedFieldAreRejected) {
  megamoe_config c = small_config();
  c.precision = 7;
  EXPECT_EQ(megamoe_validate_config(&c), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("precision"), std::string::npos) << last_error();

  c = small_config();
  c.reserved = 1;
  EXPECT_EQ(megamoe_validate_config(&c), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("reserved"), std::string::npos) << last_error();
}

TEST(CApiTest, NullPointersAreErrorsNotCrashes) {
  EXPECT_EQ(megamoe_validate_config(nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("config must not be NULL"), std::string::npos) << last_error();
  EXPECT_EQ(megamoe_default_options(nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_vgroup_create(nullptr, nullptr, nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_vgroup_forward(nullptr, nullptr, nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_vgroup_backward(nullptr, nullptr, nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_vgroup_synchronize_and_check(nullptr), MEGAMOE_INVALID_ARGUMENT);
  int32_t ranks = 0;
  EXPECT_EQ(megamoe_vgroup_num_ranks(nullptr, &ranks), MEGAMOE_INVALID_ARGUMENT);
  megamoe_vgroup_destroy(nullptr);
}

TEST(CApiTest, StatusNamesMatchTheCppNames) {
  for (int32_t code = MEGAMOE_OK; code <= MEGAMOE_INTERNAL; ++code)
    EXPECT_STREQ(megamoe_status_name(code), megamoe::status_code_name(static_cast<megamoe::StatusCode>(code)));
  EXPECT_STREQ(megamoe_status_name(-1), "unknown status");
  EXPECT_STREQ(megamoe_status_name(99), "unknown status");
}

TEST(CApiTest, DefaultOptionsMatchTheLibrary) {
  megamoe_options o{};
  o.expert_row_capacity = 5;
  ASSERT_EQ(megamoe_default_options(&o), MEGAMOE_OK);
  EXPECT_EQ(o.expert_row_capacity, 0);
  EXPECT_EQ(o.wait_timeout_seconds, 20.0);
}

TEST(CApiTest, CreateWithInvalidConfigFailsBeforeTouchingTheGpu) {
  megamoe_config c = small_config();
  c.top_k = 0;
  megamoe_vgroup* group = reinterpret_cast<megamoe_vgroup*>(&c);  // must be overwritten with NULL
  EXPECT_EQ(megamoe_vgroup_create(&c, nullptr, &group), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(group, nullptr);
  EXPECT_NE(last_error().find("top_k (K) must be positive"), std::string::npos) << last_error();
}

// Where there is no GPU (or no CUDA in the build) create reports an error with a message; where there is
// one it succeeds and the handle is usable and destroyable.
TEST(CApiTest, CreateWithoutGpuIsAnErrorNotACrash) {
  megamoe_config c = small_config();
  megamoe_vgroup* group = nullptr;
  const int32_t rc = megamoe_vgroup_create(&c, nullptr, &group);
  if (rc == MEGAMOE_OK) {
    ASSERT_NE(group, nullptr);
    int32_t ranks = 0;
    EXPECT_EQ(megamoe_vgroup_num_ranks(group, &ranks), MEGAMOE_OK);
    EXPECT_EQ(ranks, 2);
    EXPECT_EQ(megamoe_vgroup_synchronize_and_check(group), MEGAMOE_OK) << last_error();
    megamoe_vgroup_destroy(group);
    GTEST_SKIP() << "a GPU is present: create succeeded";
  }
  EXPECT_EQ(group, nullptr);
  EXPECT_TRUE(rc == MEGAMOE_NOT_SUPPORTED || rc == MEGAMOE_CUDA_ERROR) << megamoe_status_name(rc);
  EXPECT_FALSE(last_error().empty());
  if (!megamoe_built_with_cuda()) {
    EXPECT_EQ(rc, MEGAMOE_NOT_SUPPORTED);
    EXPECT_NE(last_error().find("built without CUDA"), std::string::npos) << last_error();
    int64_t bytes = -1;
    EXPECT_EQ(megamoe_workspace_bytes(&c, nullptr, &bytes), MEGAMOE_NOT_SUPPORTED);
    EXPECT_EQ(bytes, 0);
  }
}

TEST(CApiTest, LastErrorIsPerThread) {
  megamoe_config c = small_config();
  c.hidden = 100;
  ASSERT_EQ(megamoe_validate_config(&c), MEGAMOE_INVALID_ARGUMENT);
  std::string other;
  std::thread t([&] { other = megamoe_last_error(); });
  t.join();
  EXPECT_EQ(other, "");
  EXPECT_FALSE(last_error().empty());
}

}  // namespace
