// The C ABI as a binding sees it: status codes, messages, and no crash when the GPU layer is missing.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
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
  o.forward_path = MEGAMOE_FORWARD_FUSED;
  o.recompute_h = 1;
  o.backward_path = MEGAMOE_BACKWARD_FUSED;
  ASSERT_EQ(megamoe_default_options(&o), MEGAMOE_OK);
  EXPECT_EQ(o.expert_row_capacity, 0);
  EXPECT_EQ(o.wait_timeout_seconds, 20.0);
  EXPECT_EQ(o.forward_path, MEGAMOE_FORWARD_MODULAR);
  EXPECT_EQ(o.recompute_h, 0);
  EXPECT_EQ(o.backward_path, MEGAMOE_BACKWARD_MODULAR);
  EXPECT_EQ(offsetof(megamoe_options, forward_path), 16u);
  EXPECT_EQ(offsetof(megamoe_options, backward_path), 24u);
  EXPECT_EQ(sizeof(megamoe_options), 32u);
}

// The layout the Python binding mirrors (python/tests/test_c_abi.py checks the same numbers on its side).
TEST(CApiTest, ForwardArgsLayout) {
  EXPECT_EQ(offsetof(megamoe_forward_args, topk_weights), 32u);
  EXPECT_EQ(offsetof(megamoe_forward_args, weights_version), 64u);
  EXPECT_EQ(offsetof(megamoe_forward_args, w13_fp8), 72u);
  EXPECT_EQ(offsetof(megamoe_forward_args, w2_scales), 96u);
  EXPECT_EQ(sizeof(megamoe_forward_args), 104u);
  EXPECT_EQ(offsetof(megamoe_backward_args, accumulate_weight_grads), 40u);
  EXPECT_EQ(offsetof(megamoe_backward_args, d_w13_bf16), 48u);
  EXPECT_EQ(offsetof(megamoe_backward_args, d_w2_bf16), 56u);
  EXPECT_EQ(sizeof(megamoe_backward_args), 64u);
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

// ---- process groups ----

TEST(CApiTest, ProcessGroupNullPointersAreErrorsNotCrashes) {
  megamoe_config c = small_config();
  megamoe_bootstrap_id id{};
  megamoe_pgroup* group = reinterpret_cast<megamoe_pgroup*>(&c);  // must be overwritten with NULL
  EXPECT_EQ(megamoe_pgroup_create(nullptr, nullptr, 0, &id, &group), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(group, nullptr);
  EXPECT_NE(last_error().find("config must not be NULL"), std::string::npos) << last_error();
  EXPECT_EQ(megamoe_pgroup_create(&c, nullptr, 0, nullptr, &group), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("id must not be NULL"), std::string::npos) << last_error();
  EXPECT_EQ(megamoe_pgroup_create(&c, nullptr, 0, &id, nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("group must not be NULL"), std::string::npos) << last_error();
  EXPECT_EQ(megamoe_create_bootstrap_id(nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("id must not be NULL"), std::string::npos) << last_error();

  megamoe_forward_args f{};
  megamoe_backward_args b{};
  EXPECT_EQ(megamoe_pgroup_forward(nullptr, &f, nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("megamoe_pgroup_forward: group must not be NULL"), std::string::npos) << last_error();
  EXPECT_EQ(megamoe_pgroup_backward(nullptr, &b, nullptr), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_pgroup_synchronize_and_check(nullptr), MEGAMOE_INVALID_ARGUMENT);
  int32_t value = -1;
  int64_t rows = -1;
  EXPECT_EQ(megamoe_pgroup_rank(nullptr, &value), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_pgroup_num_ranks(nullptr, &value), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(megamoe_pgroup_expert_row_capacity(nullptr, &rows), MEGAMOE_INVALID_ARGUMENT);
  megamoe_pgroup_destroy(nullptr);
}

TEST(CApiTest, ProcessGroupCreateChecksConfigAndRankFirst) {
  megamoe_bootstrap_id id{};
  megamoe_config c = small_config();
  c.top_k = 0;
  megamoe_pgroup* group = reinterpret_cast<megamoe_pgroup*>(&c);
  EXPECT_EQ(megamoe_pgroup_create(&c, nullptr, 0, &id, &group), MEGAMOE_INVALID_ARGUMENT);
  EXPECT_EQ(group, nullptr);
  EXPECT_NE(last_error().find("top_k (K) must be positive"), std::string::npos) << last_error();

  c = small_config();  // num_ranks = 2
  for (int32_t rank : {-1, 2, 7}) {
    group = reinterpret_cast<megamoe_pgroup*>(&c);
    EXPECT_EQ(megamoe_pgroup_create(&c, nullptr, rank, &id, &group), MEGAMOE_INVALID_ARGUMENT) << rank;
    EXPECT_EQ(group, nullptr);
    EXPECT_NE(last_error().find("rank must be in [0, num_ranks=2), got " + std::to_string(rank)), std::string::npos)
        << last_error();
  }
}

// Handles of either kind cross bindings as untyped pointers: a handle that is not a live pgroup (here
// memory that holds a vgroup's tag, and memory that holds nothing) must be refused, not used.
TEST(CApiTest, ProcessGroupFunctionsRefuseOtherHandles) {
  alignas(64) unsigned char storage[256] = {};
  constexpr uint64_t kVgroupTag = 0x70756f7267656f6dULL;
  for (uint64_t tag : {kVgroupTag, uint64_t{0}}) {
    std::memcpy(storage, &tag, sizeof(tag));
    auto* fake = reinterpret_cast<megamoe_pgroup*>(storage);
    EXPECT_EQ(megamoe_pgroup_synchronize_and_check(fake), MEGAMOE_INVALID_ARGUMENT);
    EXPECT_NE(last_error().find("not a live megamoe_pgroup"), std::string::npos) << last_error();
    int32_t rank = -1;
    EXPECT_EQ(megamoe_pgroup_rank(fake, &rank), MEGAMOE_INVALID_ARGUMENT);
    EXPECT_EQ(rank, -1);
    megamoe_pgroup_destroy(fake);  // ignored: not a live pgroup
  }
}

// No CUDA in the build: not supported, with a message, and the id comes back zeroed. A CUDA build makes an
// id where NCCL is present (a GPU is not needed for that) and reports why where it is not.
TEST(CApiTest, BootstrapIdIsMadeOrCleanlyRefused) {
  megamoe_bootstrap_id id;
  std::memset(id.bytes, 0x5a, sizeof(id.bytes));
  const int32_t rc = megamoe_create_bootstrap_id(&id);
  if (!megamoe_built_with_cuda()) {
    EXPECT_EQ(rc, MEGAMOE_NOT_SUPPORTED);
    EXPECT_NE(last_error().find("megamoe_create_bootstrap_id"), std::string::npos) << last_error();
    EXPECT_NE(last_error().find("built without CUDA"), std::string::npos) << last_error();
    for (char byte : id.bytes) EXPECT_EQ(byte, 0);
    return;
  }
  if (rc == MEGAMOE_OK) {
    EXPECT_EQ(last_error(), "");
    bool nonzero = false;
    for (char byte : id.bytes) nonzero = nonzero || byte != 0;
    EXPECT_TRUE(nonzero);
  } else {
    EXPECT_TRUE(rc == MEGAMOE_NOT_SUPPORTED || rc == MEGAMOE_CUDA_ERROR) << megamoe_status_name(rc);
    EXPECT_FALSE(last_error().empty());
  }
}

// Without a GPU (or CUDA) create fails cleanly; with one, a group of one rank bootstraps in this process.
TEST(CApiTest, ProcessGroupCreateWithoutGpuIsAnErrorNotACrash) {
  megamoe_config c = small_config();
  c.num_ranks = 1;
  megamoe_bootstrap_id id{};
  if (megamoe_built_with_cuda() && megamoe_create_bootstrap_id(&id) != MEGAMOE_OK)
    GTEST_SKIP() << "no bootstrap id: " << last_error();
  megamoe_pgroup* group = nullptr;
  const int32_t rc = megamoe_pgroup_create(&c, nullptr, 0, &id, &group);
  if (rc == MEGAMOE_OK) {
    ASSERT_NE(group, nullptr);
    int32_t value = -1;
    EXPECT_EQ(megamoe_pgroup_rank(group, &value), MEGAMOE_OK);
    EXPECT_EQ(value, 0);
    EXPECT_EQ(megamoe_pgroup_num_ranks(group, &value), MEGAMOE_OK);
    EXPECT_EQ(value, 1);
    int64_t rows = 0;
    EXPECT_EQ(megamoe_pgroup_expert_row_capacity(group, &rows), MEGAMOE_OK);
    EXPECT_GT(rows, 0);
    EXPECT_EQ(megamoe_pgroup_synchronize_and_check(group), MEGAMOE_OK) << last_error();
    // A pgroup is not a vgroup.
    EXPECT_EQ(megamoe_vgroup_synchronize_and_check(reinterpret_cast<megamoe_vgroup*>(group)),
              MEGAMOE_INVALID_ARGUMENT);
    megamoe_pgroup_destroy(group);
    GTEST_SKIP() << "a GPU is present: create succeeded";
  }
  EXPECT_EQ(group, nullptr);
  EXPECT_TRUE(rc == MEGAMOE_NOT_SUPPORTED || rc == MEGAMOE_CUDA_ERROR) << megamoe_status_name(rc);
  EXPECT_FALSE(last_error().empty());
  if (!megamoe_built_with_cuda()) {
    EXPECT_EQ(rc, MEGAMOE_NOT_SUPPORTED);
    EXPECT_NE(last_error().find("megamoe_pgroup_create"), std::string::npos) << last_error();
    EXPECT_NE(last_error().find("built without CUDA"), std::string::npos) << last_error();
  }
}

}  // namespace
