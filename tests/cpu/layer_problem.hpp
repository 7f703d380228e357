// A layer problem for the reference tests (inputs of every rank plus the upstream gradient), and the
// one-rank problem holding the same tokens and experts, which partition-invariance tests compare against.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/reference.hpp"
#include "reference/layer_math.hpp"

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

// The one-rank problem holding the same tokens and experts. Rank r holds experts r*E_local .. (r+1)*E_local-1, so
// concatenating weights in rank order gives the global expert order and the global ids in topk_idx stay valid.
// Each rank's tokens start at a multiple of detail::kRoutingWindow in the merged rank (masked, zero tokens fill
// the gap), so that the merged rank routes its rows in the same order as the ranks do (layer_math.hpp).
template <typename Scalar>
LayerProblem<Scalar> merge_into_one_rank(const LayerProblem<Scalar>& p) {
  LayerProblem<Scalar> merged;
  merged.config = p.config;
  merged.config.num_ranks = 1;
  const int64_t H = p.config.hidden, K = p.config.top_k;
  RankInputs<Scalar> all;
  std::vector<Scalar> d_out;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    const RankInputs<Scalar>& rank = p.ranks[r];
    all.x.insert(all.x.end(), rank.x.begin(), rank.x.end());
    all.topk_idx.insert(all.topk_idx.end(), rank.topk_idx.begin(), rank.topk_idx.end());
    all.topk_weights.insert(all.topk_weights.end(), rank.topk_weights.begin(), rank.topk_weights.end());
    all.w13.insert(all.w13.end(), rank.w13.begin(), rank.w13.end());
    all.w2.insert(all.w2.end(), rank.w2.begin(), rank.w2.end());
    d_out.insert(d_out.end(), p.d_out[r].begin(), p.d_out[r].end());
    all.num_tokens += rank.num_tokens;
    constexpr int64_t kWindow = detail::kRoutingWindow;
    const int64_t gap = (kWindow - all.num_tokens % kWindow) % kWindow;
    if (r + 1 == p.ranks.size() || gap == 0) continue;
    all.x.insert(all.x.end(), gap * H, Scalar(0));
    all.topk_idx.insert(all.topk_idx.end(), gap * K, -1);
    all.topk_weights.insert(all.topk_weights.end(), gap * K, Scalar(0));
    d_out.insert(d_out.end(), gap * H, Scalar(0));
    all.num_tokens += gap;
  }
  merged.config.max_tokens_per_rank = std::max<int64_t>(all.num_tokens, 1);
  merged.ranks.push_back(std::move(all));
  merged.d_out.push_back(std::move(d_out));
  return merged;
}

// The merged rank's per-token rows [tokens, width] without the gap tokens merge_into_one_rank added: the ranks'
// rows concatenated.
template <typename Scalar, typename T>
std::vector<T> without_gaps(const LayerProblem<Scalar>& p, const std::vector<T>& merged_rows, int64_t width) {
  std::vector<T> rows;
  int64_t at = 0;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    const int64_t n = p.ranks[r].num_tokens * width;
    rows.insert(rows.end(), merged_rows.begin() + at, merged_rows.begin() + at + n);
    at += n;
    const int64_t tokens = at / width;
    constexpr int64_t kWindow = detail::kRoutingWindow;
    at += ((kWindow - tokens % kWindow) % kWindow) * width;
  }
  return rows;
}

}  // namespace megamoe::reference::testing
