// Process ranks compare what decides their shared workspace before they map each other's memory: the
// verdict names the field and both ranks' values, and is the same whichever rank computes it.
#include "comm/rank_agreement.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace megamoe::comm {
namespace {

LayerConfig config_of(int ranks) {
  LayerConfig c;
  c.hidden = 2048;
  c.intermediate = 768;
  c.num_experts = 16;
  c.top_k = 4;
  c.num_ranks = ranks;
  c.max_tokens_per_rank = 512;
  return c;
}

std::vector<RankFingerprint> agreeing(int ranks) {
  std::vector<RankFingerprint> all;
  for (int r = 0; r < ranks; ++r) all.push_back(RankFingerprint::ready(config_of(ranks), r, 4096, 1 << 20));
  return all;
}

TEST(RankAgreementTest, IdenticalRanksAgree) {
  for (int ranks : {1, 2, 8}) EXPECT_TRUE(agree_on_layout(agreeing(ranks)).is_ok()) << ranks;
}

TEST(RankAgreementTest, EachFieldThatDiffersIsNamedWithBothValues) {
  struct Case {
    const char* field;
    void (*change)(RankFingerprint&);
    const char* rank0;
    const char* rank_other;
  };
  const Case cases[] = {
      {"hidden", [](RankFingerprint& f) { f.hidden = 4096; }, "2048", "4096"},
      {"intermediate", [](RankFingerprint& f) { f.intermediate = 1536; }, "768", "1536"},
      {"num_experts", [](RankFingerprint& f) { f.num_experts = 32; }, "16", "32"},
      {"top_k", [](RankFingerprint& f) { f.top_k = 8; }, "4", "8"},
      {"max_tokens_per_rank", [](RankFingerprint& f) { f.max_tokens_per_rank = 1024; }, "512", "1024"},
      {"precision", [](RankFingerprint& f) { f.precision = 1; }, "0", "1"},
      {"expert_row_capacity", [](RankFingerprint& f) { f.expert_row_capacity = 100; }, "4096", "100"},
      {"workspace_bytes", [](RankFingerprint& f) { f.workspace_bytes = 7; }, "1048576", "7"},
      {"num_ranks", [](RankFingerprint& f) { f.num_ranks = 8; }, "4", "8"},
      {"forward_path", [](RankFingerprint& f) { f.forward_path = 1; }, "0", "1"},
      {"recompute_h", [](RankFingerprint& f) { f.recompute_h = 1; }, "0", "1"},
      {"backward_path", [](RankFingerprint& f) { f.backward_path = 1; }, "0", "1"},
  };
  for (const Case& c : cases) {
    std::vector<RankFingerprint> all = agreeing(4);
    c.change(all[2]);
    const Status s = agree_on_layout(all);
    ASSERT_FALSE(s.is_ok()) << c.field;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.field;
    const std::string want = std::string("disagree on ") + c.field + ": rank 0 has " + c.rank0 + ", rank 2 has " +
                             c.rank_other;
    EXPECT_NE(s.message().find(want), std::string::npos) << s.message();
  }
}

TEST(RankAgreementTest, ARankWhoseSetupFailedIsNamedWithItsReason) {
  std::vector<RankFingerprint> all = agreeing(3);
  all[1] = RankFingerprint::failed(config_of(3), 1, Status(StatusCode::kCudaError, "cudaMalloc(workspace): out of memory"));
  const Status s = agree_on_layout(all);
  EXPECT_EQ(s.code(), StatusCode::kCudaError);
  EXPECT_NE(s.message().find("rank 1 could not set up its side of the group: cudaMalloc(workspace): out of memory"),
            std::string::npos)
      << s.message();
}

TEST(RankAgreementTest, ALongSetupMessageIsTruncatedNotOverrun) {
  std::vector<RankFingerprint> all = agreeing(2);
  all[1] = RankFingerprint::failed(config_of(2), 1, Status::invalid(std::string(1000, 'x')));
  const Status s = agree_on_layout(all);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_LT(s.message().size(), 300u);
  EXPECT_NE(s.message().find(std::string(RankFingerprint::kMessageBytes - 1, 'x')), std::string::npos);
}

TEST(RankAgreementTest, DuplicateOrMisnumberedRanksAreRefused) {
  std::vector<RankFingerprint> all = agreeing(3);
  all[2].rank = 1;
  const Status s = agree_on_layout(all);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("slot 2 says it is rank 1"), std::string::npos) << s.message();
}

TEST(RankAgreementTest, AnotherBuildIsRefused) {
  std::vector<RankFingerprint> all = agreeing(2);
  all[1].layout_version = 99;
  EXPECT_NE(agree_on_layout(all).message().find("rank 1 runs another megamoe build"), std::string::npos);
  all = agreeing(2);
  all[1].magic = 0;
  EXPECT_NE(agree_on_layout(all).message().find("rank 1 runs another megamoe build"), std::string::npos);
}

TEST(RankAgreementTest, FewerProcessesThanTheConfigSaysIsRefused) {
  std::vector<RankFingerprint> all = agreeing(4);
  all.resize(3);
  const Status s = agree_on_layout(all);
  EXPECT_NE(s.message().find("num_ranks is 4 but 3 processes joined"), std::string::npos) << s.message();
}

TEST(RankAgreementTest, SeveralDifferencesGiveOneVerdictInAFixedOrder) {
  // Every rank gets the same vector from the exchange and agree_on_layout reads nothing else, so all
  // ranks report the same message: the first field in the fixed order, whichever rank differs in it.
  std::vector<RankFingerprint> all = agreeing(4);
  all[1].top_k = 2;
  all[3].hidden = 1024;
  const Status s = agree_on_layout(all);
  EXPECT_NE(s.message().find("disagree on hidden: rank 0 has 2048, rank 3 has 1024"), std::string::npos)
      << s.message();
}

}  // namespace
}  // namespace megamoe::comm
