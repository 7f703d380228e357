// Comparison of the ranks' fingerprints (src/comm/rank_agreement.hpp).
#include "comm/rank_agreement.hpp"

#include <algorithm>
#include <cstring>
#include <string>

namespace megamoe::comm {

namespace {

RankFingerprint describe(const LayerConfig& config, int rank) {
  RankFingerprint f;
  f.rank = rank;
  f.hidden = config.hidden;
  f.intermediate = config.intermediate;
  f.num_experts = config.num_experts;
  f.top_k = config.top_k;
  f.num_ranks = config.num_ranks;
  f.max_tokens_per_rank = config.max_tokens_per_rank;
  f.precision = static_cast<int64_t>(config.precision);
  return f;
}

std::string message_of(const RankFingerprint& f) {
  const char* end = std::find(f.setup_message, f.setup_message + RankFingerprint::kMessageBytes, '\0');
  return std::string(f.setup_message, end);
}

}  // namespace

RankFingerprint RankFingerprint::ready(const LayerConfig& config, int rank, int64_t expert_row_capacity,
                                       int64_t workspace_bytes) {
  RankFingerprint f = describe(config, rank);
  f.expert_row_capacity = expert_row_capacity;
  f.workspace_bytes = workspace_bytes;
  return f;
}

RankFingerprint RankFingerprint::failed(const LayerConfig& config, int rank, const Status& why) {
  RankFingerprint f = describe(config, rank);
  f.setup_code = static_cast<int32_t>(why.is_ok() ? StatusCode::kInternal : why.code());
  const std::string& text = why.message();
  std::memcpy(f.setup_message, text.data(), std::min<size_t>(text.size(), kMessageBytes - 1));
  return f;
}

Status agree_on_layout(const std::vector<RankFingerprint>& ranks) {
  if (ranks.empty()) return Status(StatusCode::kInternal, "rank agreement over no ranks");
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankFingerprint& f = ranks[r];
    if (f.magic != RankFingerprint::kMagic || f.layout_version != ranks[0].layout_version)
      return Status::invalid("rank " + std::to_string(r) +
                             " runs another megamoe build (its workspace layout differs); every process must load "
                             "the same library");
    if (f.setup_code != 0)
      return Status(static_cast<StatusCode>(f.setup_code),
                    "rank " + std::to_string(r) + " could not set up its side of the group: " + message_of(f));
    if (f.rank != static_cast<int32_t>(r))
      return Status::invalid("the process in slot " + std::to_string(r) + " says it is rank " + std::to_string(f.rank) +
                             " (two processes passed the same rank, or ranks were not numbered 0..R-1)");
  }
  struct Field {
    const char* name;
    int64_t RankFingerprint::*member;
  };
  static constexpr Field kFields[] = {
      {"num_ranks", &RankFingerprint::num_ranks},
      {"hidden", &RankFingerprint::hidden},
      {"intermediate", &RankFingerprint::intermediate},
      {"num_experts", &RankFingerprint::num_experts},
      {"top_k", &RankFingerprint::top_k},
      {"max_tokens_per_rank", &RankFingerprint::max_tokens_per_rank},
      {"precision", &RankFingerprint::precision},
      {"expert_row_capacity", &RankFingerprint::expert_row_capacity},
      {"workspace_bytes", &RankFingerprint::workspace_bytes},
      {"forward_path", &RankFingerprint::forward_path},
      {"recompute_h", &RankFingerprint::recompute_h},
      {"backward_path", &RankFingerprint::backward_path},
  };
  for (const Field& field : kFields)
    for (size_t r = 1; r < ranks.size(); ++r)
      if (ranks[r].*field.member != ranks[0].*field.member)
        return Status::invalid("process ranks disagree on " + std::string(field.name) + ": rank 0 has " +
                               std::to_string(ranks[0].*field.member) + ", rank " + std::to_string(r) + " has " +
                               std::to_string(ranks[r].*field.member) +
                               " (every rank must create the group with the same config and options)");
  if (ranks[0].num_ranks != static_cast<int64_t>(ranks.size()))
    return Status::invalid("config.num_ranks is " + std::to_string(ranks[0].num_ranks) + " but " +
                           std::to_string(ranks.size()) + " processes joined");
  return Status::ok();
}

}  // namespace megamoe::comm
