#include "megamoe/config.hpp"

#include <sstream>

namespace megamoe {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kBF16: return "bf16";
    case Precision::kFP8Blockwise: return "fp8-blockwise";
  }
  return "unknown";
}

double LayerConfig::forward_flops(int64_t routed_pairs) const {
  return 6.0 * static_cast<double>(hidden) * static_cast<double>(intermediate) *
         static_cast<double>(routed_pairs);
}

double LayerConfig::backward_flops(int64_t routed_pairs) const { return 2.0 * forward_flops(routed_pairs); }

std::string LayerConfig::to_string() const {
  std::ostringstream s;
  s << "H=" << hidden << " I=" << intermediate << " E=" << num_experts << " K=" << top_k
    << " R=" << num_ranks << " max_tokens_per_rank=" << max_tokens_per_rank << " " << precision_name(precision);
  return s.str();
}

LayerConfig LayerConfig::qwen3_30b_a3b() {
  LayerConfig c;
  c.hidden = 2048;
  c.intermediate = 768;
  c.num_experts = 128;
  c.top_k = 8;
  c.num_ranks = 1;
  c.max_tokens_per_rank = 4096;
  return c;
}

LayerConfig LayerConfig::qwen3_235b_a22b() {
  LayerConfig c = qwen3_30b_a3b();
  c.hidden = 4096;
  c.intermediate = 1536;
  return c;
}

LayerConfig LayerConfig::deepseek_v3() {
  LayerConfig c = qwen3_30b_a3b();
  c.hidden = 7168;
  c.intermediate = 2048;
  c.num_experts = 256;
  return c;
}

namespace {

std::string field_rule(const char* field, const std::string& rule, int64_t got) {
  std::ostringstream s;
  s << field << " " << rule << ", got " << got;
  return s.str();
}

}  // namespace

// Upper bounds keep every derived byte count inside int64 and every row index inside int32, the index
// type of the kernels.
inline constexpr int64_t kMaxChannels = 1 << 16;
inline constexpr int64_t kMaxExperts = 1 << 12;
inline constexpr int64_t kMaxTopK = 64;
inline constexpr int64_t kMaxTokensPerRank = 1 << 20;

Status validate(const LayerConfig& c) {
  auto positive = [](const char* field, int64_t v) -> Status {
    if (v <= 0) return Status::invalid(field_rule(field, "must be positive", v));
    return Status::ok();
  };
  MEGAMOE_RETURN_IF_ERROR(positive("hidden (H)", c.hidden));
  MEGAMOE_RETURN_IF_ERROR(positive("intermediate (I)", c.intermediate));
  MEGAMOE_RETURN_IF_ERROR(positive("num_experts (E)", c.num_experts));
  MEGAMOE_RETURN_IF_ERROR(positive("top_k (K)", c.top_k));
  MEGAMOE_RETURN_IF_ERROR(positive("num_ranks (R)", c.num_ranks));
  MEGAMOE_RETURN_IF_ERROR(positive("max_tokens_per_rank", c.max_tokens_per_rank));

  if (c.hidden % kChannelAlignment != 0)
    return Status::invalid(field_rule("hidden (H)", "must be a multiple of 128", c.hidden));
  if (c.intermediate % kChannelAlignment != 0)
    return Status::invalid(field_rule("intermediate (I)", "must be a multiple of 128", c.intermediate));
  if (c.hidden > kMaxChannels)
    return Status::invalid(field_rule("hidden (H)", "must be at most 65536", c.hidden));
  if (c.intermediate > kMaxChannels)
    return Status::invalid(field_rule("intermediate (I)", "must be at most 65536", c.intermediate));
  if (c.num_experts > kMaxExperts)
    return Status::invalid(field_rule("num_experts (E)", "must be at most 4096", c.num_experts));
  if (c.num_ranks > kMaxRanks)
    return Status::invalid(field_rule("num_ranks (R)", "must be at most 1024", c.num_ranks));
  if (c.num_experts % c.num_ranks != 0) {
    std::ostringstream s;
    s << "num_experts (E) must be divisible by num_ranks (R), got E=" << c.num_experts << " R=" << c.num_ranks;
    return Status::invalid(s.str());
  }
  if (c.top_k > c.num_experts) {
    std::ostringstream s;
    s << "top_k (K) must be at most num_experts (E), got K=" << c.top_k << " E=" << c.num_experts;
    return Status::invalid(s.str());
  }
  if (c.top_k > kMaxTopK) return Status::invalid(field_rule("top_k (K)", "must be at most 64", c.top_k));
  if (c.max_tokens_per_rank > kMaxTokensPerRank)
    return Status::invalid(field_rule("max_tokens_per_rank", "must be at most 1048576", c.max_tokens_per_rank));
  if (c.precision != Precision::kBF16 && c.precision != Precision::kFP8Blockwise)
    return Status::invalid(field_rule("precision", "must be bf16 (0) or fp8-blockwise (1)",
                                      static_cast<int64_t>(c.precision)));
  return Status::ok();
}

}  // namespace megamoe
