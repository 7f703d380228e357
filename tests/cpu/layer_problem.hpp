// A layer problem for the reference tests (inputs of every rank plus the upstream gradient), and the
// one-rank problem holding the same tokens and experts, which partition-invariance tests compare against.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/reference.hpp"

namespace megamoe::reference::testing {

template <typename Scalar>
struct LayerProblem {
  LayerConfig config;
  std::vector<RankInputs<Scalar>> ranks;
  std::vector<std::vector<Scalar>> d_out;
};

template <typename T>
std::vector<T> concatenate(const std::vector<std::vector<T>>& parts) {
  std::vector<T> all;
  for (const std::vector<T>& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

// Rank r holds experts r*E_local .. (r+1)*E_local-1, so concatenating weights in rank order gives the global
// expert order and the global ids in topk_idx stay valid.
template <typename Scalar>
LayerProblem<Scalar> merge_into_one_rank(const LayerProblem<Scalar>& p) {
  LayerProblem<Scalar> merged;
  merged.config = p.config;
  merged.config.num_ranks = 1;
  int64_t total_tokens = 0;
  for (const RankInputs<Scalar>& rank : p.ranks) total_tokens += rank.num_tokens;
  merged.config.max_tokens_per_rank = std::max<int64_t>(total_tokens, 1);
  RankInputs<Scalar> all;
  all.num_tokens = total_tokens;
  for (const RankInputs<Scalar>& rank : p.ranks) {
    all.x.insert(all.x.end(), rank.x.begin(), rank.x.end());
    all.topk_idx.insert(all.topk_idx.end(), rank.topk_idx.begin(), rank.topk_idx.end());
    all.topk_weights.insert(all.topk_weights.end(), rank.topk_weights.begin(), rank.topk_weights.end());
    all.w13.insert(all.w13.end(), rank.w13.begin(), rank.w13.end());
    all.w2.insert(all.w2.end(), rank.w2.begin(), rank.w2.end());
  }
  merged.ranks.push_back(std::move(all));
  merged.d_out.push_back(concatenate(p.d_out));
  return merged;
}

}  // namespace megamoe::reference::testing
