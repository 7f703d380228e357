// What process ranks tell each other before they share memory: every field that decides the layout of
// the symmetric workspace (a rank that differs in any of them would read and write its peers at wrong
// offsets), whether the rank could set up its side at all, and which rank it thinks it is. Each rank
// gathers every rank's RankFingerprint and runs the same comparison over the same bytes, so all ranks
// reach the same verdict with the same message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/status.hpp"

namespace megamoe::comm {

// Plain bytes, the same on every rank of one build; sent as is.
struct RankFingerprint {
  static constexpr uint32_t kMagic = 0x6d6f6566;  // "feom": a rank of another library or build
  static constexpr int kMessageBytes = 200;

  uint32_t magic = kMagic;
  uint32_t layout_version = 4;  // bumped whenever the workspace layout changes between builds
  int32_t rank = -1;
  int32_t setup_code = 0;       // StatusCode of this rank's local setup (0 = ready)
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t num_ranks = 0;
  int64_t max_tokens_per_rank = 0;
  int64_t precision = 0;
  int64_t expert_row_capacity = 0;  // after defaults
  int64_t workspace_bytes = 0;
  int64_t forward_path = 0;         // LayerOptions::forward_path: the ranks' kernels meet at different counters
  int64_t recompute_h = 0;          // LayerOptions::recompute_h: h and dh share a buffer or not
  int64_t backward_path = 0;        // LayerOptions::backward_path: the ranks' kernels meet at different counters
  char setup_message[kMessageBytes] = {};  // why setup failed, truncated

  static RankFingerprint ready(const LayerConfig& config, int rank, int64_t expert_row_capacity,
                               int64_t workspace_bytes);
  // A rank whose own setup failed still joins the exchange, so that its peers fail with its reason
  // instead of waiting for it.
  static RankFingerprint failed(const LayerConfig& config, int rank, const Status& why);
};

// The verdict over all ranks' fingerprints (index = the slot the exchange put it in, which is the rank):
// OK only when every rank is ready, says it is the rank of its slot, and agrees with rank 0 on every
// field; otherwise the first problem found, naming the field and the two ranks' values.
Status agree_on_layout(const std::vector<RankFingerprint>& ranks);

}  // namespace megamoe::comm
