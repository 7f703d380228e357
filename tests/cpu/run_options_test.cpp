// The command line of megamoe_run: every number strictly parsed, every refusal says what it got.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../../tools/run_options.hpp"

namespace megamoe::tool {
namespace {

ParsedOptions parse(std::vector<std::string> args) {
  std::vector<const char*> argv = {"megamoe_run"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return parse_run_options(static_cast<int>(argv.size()), argv.data());
}

TEST(RunOptionsTest, NoFlagsLeaveEveryDefaultToThePath) {
  const ParsedOptions p = parse({});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.tokens, 0);
  EXPECT_EQ(p.options.ranks, 0);
  EXPECT_EQ(p.options.iters, 0);
  EXPECT_FALSE(p.options.cpu);
  EXPECT_FALSE(p.options.help);
}

TEST(RunOptionsTest, ReadsEveryFlagInBothSpellings) {
  const ParsedOptions p = parse({"--tokens", "128", "--ranks=4", "--iters", "3", "--cpu"});
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.options.tokens, 128);
  EXPECT_EQ(p.options.ranks, 4);
  EXPECT_EQ(p.options.iters, 3);
  EXPECT_TRUE(p.options.cpu);
}

TEST(RunOptionsTest, HelpIsAnOptionNotAnError) {
  for (const char* flag : {"--help", "-h"}) {
    const ParsedOptions p = parse({flag});
    ASSERT_TRUE(p.ok) << flag;
    EXPECT_TRUE(p.options.help) << flag;
  }
  const std::string usage = run_usage();
  for (const char* flag : {"--tokens", "--ranks", "--iters", "--cpu", "--help"})
    EXPECT_NE(usage.find(flag), std::string::npos) << flag;
}

TEST(RunOptionsTest, RefusesWhatIsNotAPositiveWholeNumber) {
  for (const char* bad : {"abc", "0", "-4", "12abc", "", "+3", " 7", "3.5", "99999999999999999999999"}) {
    const ParsedOptions p = parse({"--ranks", bad});
    EXPECT_FALSE(p.ok) << "'" << bad << "'";
    EXPECT_NE(p.error.find("--ranks needs a whole number"), std::string::npos) << p.error;
    EXPECT_NE(p.error.find(std::string("got '") + bad + "'"), std::string::npos) << p.error;
  }
}

TEST(RunOptionsTest, RefusesValuesAboveTheLimits) {
  EXPECT_TRUE(parse({"--tokens", std::to_string(kMaxTokens)}).ok);
  EXPECT_FALSE(parse({"--tokens", std::to_string(kMaxTokens + 1)}).ok);
  EXPECT_FALSE(parse({"--ranks", std::to_string(kMaxRanks + 1)}).ok);
  EXPECT_FALSE(parse({"--iters", std::to_string(kMaxIters + 1)}).ok);
}

TEST(RunOptionsTest, RefusesUnknownArgumentsAndMissingValues) {
  ParsedOptions p = parse({"--token", "5"});
  EXPECT_FALSE(p.ok);
  EXPECT_NE(p.error.find("unknown argument '--token'"), std::string::npos) << p.error;
  p = parse({"--iters"});
  EXPECT_FALSE(p.ok);
  EXPECT_NE(p.error.find("--iters needs a value"), std::string::npos) << p.error;
}

}  // namespace
}  // namespace megamoe::tool
