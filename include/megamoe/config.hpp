// The shape of one expert-parallel MoE layer and the rules it must satisfy.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/status.hpp"

namespace megamoe {

enum class Precision : int {
  kBF16 = 0,
  kFP8Blockwise = 1,  // E4M3 values, 1x128 activation scales, 128x128 weight scales
};

const char* precision_name(Precision p);

// Tiles, FP8 scale groups and the GEMM engine all work in units of 128 channels.
inline constexpr int64_t kChannelAlignment = 128;
// The most expert-parallel ranks a layer may have.
inline constexpr int64_t kMaxRanks = 1024;

struct LayerConfig {
  int64_t hidden = 0;               // H: model width
  int64_t intermediate = 0;         // I: expert MLP width (w13 has 2I rows: gate then up)
  int64_t num_experts = 0;          // E: global expert count
  int64_t top_k = 0;                // K: experts per token
  int64_t num_ranks = 1;            // R: expert-parallel ranks; expert e lives on rank e / (E / R)
  int64_t max_tokens_per_rank = 0;  // upper bound on T for every rank; sizes all buffers
  Precision precision = Precision::kBF16;

  int64_t experts_per_rank() const { return num_experts / num_ranks; }
  int64_t rank_of_expert(int64_t expert) const { return expert / experts_per_rank(); }

  // FLOPs of the forward for T routed tokens (6*H*I per token-expert pair) and of the backward
  // (12*H*I), the SonicMoE convention: padding, recompute and masked slots are not counted.
  double forward_flops(int64_t routed_pairs) const;
  double backward_flops(int64_t routed_pairs) const;

  std::string to_string() const;

  // Named configurations used by the tools, tests and benchmarks.
  static LayerConfig qwen3_30b_a3b();    // H=2048, I=768, E=128, K=8
  static LayerConfig qwen3_235b_a22b();  // H=4096, I=1536, E=128, K=8
  static LayerConfig deepseek_v3();      // H=7168, I=2048, E=256, K=8
};

// Checks every rule of a LayerConfig; the message names the field and the rule it breaks.
Status validate(const LayerConfig& config);

}  // namespace megamoe
