// Creation and release of a process group on one GPU: what a single device can show of the multi-process
// path (NCCL refuses two ranks of one communicator on one device, so the two-process cases live in
// python/tests/test_distributed_gpu.py and need two GPUs). A rank alone in a group of two must get a
// timeout, not hang; a rank whose own setup fails must report it through the exchange every rank runs;
// a group released and created again must leave nothing behind.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "gpu_test_util.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/process_group.hpp"

namespace megamoe {
namespace {

LayerConfig tiny(int ranks) {
  LayerConfig c;
  c.hidden = 128;
  c.intermediate = 128;
  c.num_experts = 2 * ranks;
  c.top_k = 2;
  c.num_ranks = ranks;
  c.max_tokens_per_rank = 64;
  return c;
}

// Skips where the library has no process groups (a build without NCCL).
bool make_id(BootstrapId* id) {
  const Status s = ProcessRankGroup::create_bootstrap_id(id);
  if (s.code() == StatusCode::kNotSupported) return false;
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return s.is_ok();
}

TEST(ProcessGroupCreationTest, APeerThatNeverJoinsIsATimeoutNotAHang) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  BootstrapId id{};
  if (!make_id(&id)) GTEST_SKIP() << "no process groups in this build";
  LayerOptions options;
  options.wait_timeout_seconds = 2.0;
  std::unique_ptr<ProcessRankGroup> group;
  const auto start = std::chrono::steady_clock::now();
  const Status s = ProcessRankGroup::create(tiny(2), options, 0, id, &group);  // rank 1 never comes
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("never joined"), std::string::npos) << s.message();
  EXPECT_EQ(group, nullptr);
  EXPECT_GE(seconds, 1.9);
  EXPECT_LT(seconds, 12.0) << "the bound is the wait timeout plus NCCL's abort";
  // Nothing left broken: a group of one is created and used right after.
  BootstrapId again{};
  ASSERT_TRUE(make_id(&again));
  const Status ok = ProcessRankGroup::create(tiny(1), LayerOptions{}, 0, again, &group);
  ASSERT_TRUE(ok.is_ok()) << ok.to_string();
  EXPECT_TRUE(group->synchronize_and_check().is_ok());
}

TEST(ProcessGroupCreationTest, ALocalSetupFailureIsReportedThroughTheExchange) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  BootstrapId id{};
  if (!make_id(&id)) GTEST_SKIP() << "no process groups in this build";
  LayerConfig bad = tiny(1);
  bad.hidden = 100;  // breaks a config rule: this rank still joins and tells its peers why it cannot run
  std::unique_ptr<ProcessRankGroup> group;
  const Status s = ProcessRankGroup::create(bad, LayerOptions{}, 0, id, &group);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("rank 0 could not set up its side of the group"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("hidden (H) must be a multiple of 128"), std::string::npos) << s.message();
  EXPECT_EQ(group, nullptr);
}

TEST(ProcessGroupCreationTest, OptionsThatCannotBoundTheJoinAreRefusedBeforeIt) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  BootstrapId id{};
  if (!make_id(&id)) GTEST_SKIP() << "no process groups in this build";
  LayerOptions options;
  options.wait_timeout_seconds = 1e300;
  std::unique_ptr<ProcessRankGroup> group;
  const auto start = std::chrono::steady_clock::now();
  const Status s = ProcessRankGroup::create(tiny(2), options, 0, id, &group);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("wait_timeout_seconds"), std::string::npos) << s.message();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
}

TEST(ProcessGroupCreationTest, ReleasedAndCreatedAgainManyTimes) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  size_t free_before = 0, free_after = 0, total = 0;
  for (int round = 0; round < 4; ++round) {
    BootstrapId id{};
    if (!make_id(&id)) GTEST_SKIP() << "no process groups in this build";
    std::unique_ptr<ProcessRankGroup> group;
    const Status s = ProcessRankGroup::create(tiny(1), LayerOptions{}, 0, id, &group);
    ASSERT_TRUE(s.is_ok()) << round << ": " << s.to_string();
    group.reset();  // the collective release
    MEGAMOE_ASSERT_CUDA(cudaMemGetInfo(round == 0 ? &free_before : &free_after, &total));
  }
  // The workspace goes back on every release (NCCL's own pools may move a little).
  EXPECT_GE(static_cast<double>(free_after), static_cast<double>(free_before) - 64.0 * (1 << 20));
}

}  // namespace
}  // namespace megamoe
