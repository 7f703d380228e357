// Command-line options of megamoe_run. Numbers are parsed strictly (strtoll accepts "12abc" as 12 and
// atoi reads "abc" as 0, both of which would run a configuration nobody asked for), and every refusal
// names the flag and the text it got.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace megamoe::tool {

// 0 means "not given": each path (GPU, CPU reference) then uses its own default.
struct RunOptions {
  int64_t tokens = 0;
  int64_t ranks = 0;
  int64_t iters = 0;
  bool cpu = false;
  bool help = false;
};

struct ParsedOptions {
  bool ok = false;
  std::string error;  // when !ok: what was wrong, for a person
  RunOptions options;
};

// Defaults of the two paths, also printed by --help.
inline constexpr int64_t kGpuDefaultTokens = 4096;
inline constexpr int64_t kGpuDefaultRanks = 1;
inline constexpr int64_t kGpuDefaultIters = 10;
inline constexpr int64_t kCpuDefaultTokens = 64;
inline constexpr int64_t kCpuDefaultRanks = 2;
inline constexpr int64_t kCpuDefaultIters = 1;
// The library's own limits (validate() in src/host/config.cpp) for tokens and ranks; iterations are
// bounded only so that a typo cannot start a run of days.
inline constexpr int64_t kMaxTokens = int64_t{1} << 20;
inline constexpr int64_t kMaxRanks = 1024;
inline constexpr int64_t kMaxIters = 1000000;

inline std::string run_usage() {
  return "usage: megamoe_run [--tokens T] [--ranks R] [--iters N] [--cpu] [--help]\n"
         "\n"
         "Runs forward + backward of one expert-parallel MoE layer on R virtual ranks and prints the time.\n"
         "With a Hopper GPU: the Qwen3-30B-A3B layer shape (H=2048, I=768, E=128, K=8) on the GPU.\n"
         "Without one (or with --cpu): the CPU reference, exact and FP8 blockwise, on a small shape\n"
         "(H=256, I=128, 4 experts per rank, K=2). Every flag applies to both paths.\n"
         "\n"
         "  --tokens T   tokens per rank, 1..1048576 (default: 4096 on the GPU, 64 on the CPU)\n"
         "  --ranks R    virtual ranks, 1..1024; on the GPU E=128 must be divisible by R\n"
         "               (default: 1 on the GPU, 2 on the CPU)\n"
         "  --iters N    timed runs, the median is printed, 1..1000000 (default: 10 on the GPU after\n"
         "               2 untimed warm-ups, 1 on the CPU)\n"
         "  --cpu        run the CPU reference even when a GPU is present\n"
         "  --help       print this text and exit\n"
         "\n"
         "Exit status: 0 done, 1 the run failed, 2 bad command line.\n";
}

// A whole decimal integer in [1, max]; anything else (empty, sign, trailing text, overflow) is refused.
inline bool parse_positive(const char* text, int64_t max, int64_t* value) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (errno == ERANGE || end == text || *end != '\0') return false;
  if (v < 1 || v > max) return false;
  *value = static_cast<int64_t>(v);
  return true;
}

inline ParsedOptions parse_run_options(int argc, const char* const* argv) {
  ParsedOptions result;
  struct NumberFlag {
    const char* name;
    int64_t max;
    int64_t* target;
  };
  RunOptions& o = result.options;
  const NumberFlag numbers[] = {
      {"--tokens", kMaxTokens, &o.tokens}, {"--ranks", kMaxRanks, &o.ranks}, {"--iters", kMaxIters, &o.iters}};
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    if (!std::strcmp(arg, "--help") || !std::strcmp(arg, "-h")) {
      o.help = true;
      continue;
    }
    if (!std::strcmp(arg, "--cpu")) {
      o.cpu = true;
      continue;
    }
    const NumberFlag* flag = nullptr;
    const char* value = nullptr;
    for (const NumberFlag& f : numbers) {
      const size_t n = std::strlen(f.name);
      if (!std::strcmp(arg, f.name)) {
        flag = &f;
        if (i + 1 >= argc) {
          result.error = std::string(f.name) + " needs a value";
          return result;
        }
        value = argv[++i];
      } else if (!std::strncmp(arg, f.name, n) && arg[n] == '=') {
        flag = &f;
        value = arg + n + 1;
      }
      if (flag != nullptr) break;
    }
    if (flag == nullptr) {
      result.error = std::string("unknown argument '") + arg + "'";
      return result;
    }
    if (!parse_positive(value, flag->max, flag->target)) {
      result.error = std::string(flag->name) + " needs a whole number from 1 to " + std::to_string(flag->max) +
                     ", got '" + value + "'";
      return result;
    }
  }
  result.ok = true;
  return result;
}

}  // namespace megamoe::tool
