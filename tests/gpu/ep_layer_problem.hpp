// The layer problem the GPU layer tests share (ep_layer_test.cu, ep_layer_fuzz_test.cu): one problem's
// inputs on every rank (bf16-exact values; the weights are hashed, so the GPU fills them and the CPU
// regenerates any element), their upload, the CPU reference on a compact single-rank copy that holds only
// the routed experts, and the relative error every comparison uses.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/hashed_fill.hpp"
#include "megamoe/config.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/reference_fp8.hpp"
#include "megamoe/status.hpp"
#include "reference/layer_math.hpp"

namespace megamoe::testing::ep_problem {

inline double relative_error(const std::vector<float>& got, const std::vector<float>& want, int64_t* nans) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) ++*nans;
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = __bfloat162float(v[i]);
  return f;
}

// One rank's device tensors.
struct RankTensors {
  DeviceBuffer<__nv_bfloat16> x, w13, w2, out, d_out, d_x;
  DeviceBuffer<int64_t> idx;
  DeviceBuffer<float> weights, d_weights, d_w13, d_w2;
};

// The layer's arguments over one rank's tensors: the forward of `tokens` tokens (int64 ids), the backward into
// the rank's gradient buffers.
inline ForwardArgs forward_args_of(const RankTensors& t, int64_t tokens) {
  ForwardArgs f;
  f.num_tokens = tokens;
  f.x = t.x.get();
  f.topk_idx = t.idx.get();
  f.topk_weights = t.weights.get();
  f.w13 = t.w13.get();
  f.w2 = t.w2.get();
  f.out = t.out.get();
  return f;
}

inline BackwardArgs backward_args_of(const RankTensors& t) {
  BackwardArgs b;
  b.d_out = t.d_out.get();
  b.d_x = t.d_x.get();
  b.d_topk_weights = t.d_weights.get();
  b.d_w13 = t.d_w13.get();
  b.d_w2 = t.d_w2.get();
  return b;
}

struct Problem {
  LayerConfig config;
  uint64_t seed = 0;
  float x_scale = 1.0f, w13_scale = 0, w2_scale = 0;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<float>> x, d_out;  // bf16-exact values
  std::vector<int64_t> routed;                // distinct global experts used, ascending
  int64_t probe_expert = -1;                  // an unused expert whose gradients must be exactly 0

  uint64_t seed_of(int what) const { return seed * 16 + static_cast<uint64_t>(what); }
  float w13_value(int64_t expert, int64_t i) const {
    return kernels::hashed_bf16_value(seed_of(1), static_cast<uint64_t>(expert * 2 * config.intermediate * config.hidden + i),
                                      w13_scale);
  }
  float w2_value(int64_t expert, int64_t i) const {
    return kernels::hashed_bf16_value(seed_of(2), static_cast<uint64_t>(expert * config.hidden * config.intermediate + i),
                                      w2_scale);
  }
};

// d_topk_weights of a rank with few routed slots, entry by entry. Each entry is one dot product
// <d_out_t, y_j> = <da, a> whose value can be near zero while the bf16 rounding of a (and of h) stays of the size
// of its terms, so a relative norm over a handful of entries measures cancellation, not accuracy: such entries
// are held to |got - want| <= 1e-2 * max(|want|, sum_i |da_i a_i|, sum_h |d_out_h y_h|), the error bound of a
// dot product at 1e-2 of its conditioning scale. A bf16 emulation of the GPU's arithmetic stays below 2.5e-3 of
// it; on one entry the relative error exceeds 1e-2 for about 15% of random draws (2% with 3 entries, 1e-7 with
// 16: kMinSlotsForNorm). Run 123's seed 4096172831 (docs/PERF.md run 124): a rank of one token and 7 slots,
// the GPU's entry -0.4329 against -0.3968, which is what a computed from the bf16 h gives on the CPU.
inline constexpr int64_t kMinSlotsForNorm = 16;

// The conditioning scale of the entry of token t (rank r) and `expert`: sum |da_i a_i| (the GPU's <da, a>), or
// sum |d_out_h y_h| (<d_out, y>) if larger, in double from the problem's exact inputs. Each expert's weights
// are regenerated from their hash once.
class DotProductScales {
 public:
  explicit DotProductScales(const Problem& p) : p_(p) {}
  double of(int r, int64_t t, int64_t expert) {
    const int64_t H = p_.config.hidden, I = p_.config.intermediate;
    auto it = weights_.find(expert);
    if (it == weights_.end()) {
      std::vector<double> w13(2 * I * H), w2(H * I);
      for (int64_t i = 0; i < 2 * I * H; ++i) w13[i] = p_.w13_value(expert, i);
      for (int64_t i = 0; i < H * I; ++i) w2[i] = p_.w2_value(expert, i);
      it = weights_.emplace(expert, std::make_pair(std::move(w13), std::move(w2))).first;
    }
    const std::vector<double>& w13 = it->second.first;
    const std::vector<double>& w2 = it->second.second;
    const float* x = p_.x[r].data() + t * H;
    const float* d_out = p_.d_out[r].data() + t * H;
    std::vector<double> a(I), da(I, 0.0);
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, up = 0;
      for (int64_t h = 0; h < H; ++h) {
        g += w13[i * H + h] * x[h];
        up += w13[(I + i) * H + h] * x[h];
      }
      a[i] = g / (1.0 + std::exp(-g)) * up;
    }
    double by_da = 0, by_y = 0;
    for (int64_t h = 0; h < H; ++h) {
      double y = 0;
      for (int64_t i = 0; i < I; ++i) {
        y += w2[h * I + i] * a[i];
        da[i] += d_out[h] * w2[h * I + i];
      }
      by_y += std::fabs(d_out[h] * y);
    }
    for (int64_t i = 0; i < I; ++i) by_da += std::fabs(da[i] * a[i]);
    return std::max(by_da, by_y);
  }

  // The routed entries of rank r's d_topk_weights `got` (reference `want`) farther from it than `tolerance`
  // times their dot product's scale, one message each ("[t, j] = ..."); NaN entries are left to the caller's
  // count of them.
  std::vector<std::string> entries_beyond_scale(int r, const std::vector<float>& got, const std::vector<float>& want,
                                                double tolerance) {
    const int64_t K = p_.config.top_k;
    const std::vector<int64_t>& idx = p_.idx[r];
    std::vector<std::string> beyond;
    for (size_t i = 0; i < idx.size(); ++i) {
      if (idx[i] < 0 || std::isnan(got[i])) continue;
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
      if (err <= tolerance * std::fabs(want[i])) continue;  // the scale is at least |want|: no need to compute it
      const double scale = std::max(std::fabs(static_cast<double>(want[i])), of(r, i / K, idx[i]));
      if (err <= tolerance * scale) continue;
      char line[200];
      std::snprintf(line, sizeof(line), "[%lld, %lld] = %.3e, reference %.3e: error %.3e > %.0e x its dot product's "
                    "scale %.3e", static_cast<long long>(i / K), static_cast<long long>(i % K), got[i], want[i], err,
                    tolerance, scale);
      beyond.emplace_back(line);
    }
    return beyond;
  }

 private:
  const Problem& p_;
  std::map<int64_t, std::pair<std::vector<double>, std::vector<double>>> weights_;
};

// The reference on a compact single-rank problem holding the routed experts only.
struct Expected {
  std::vector<std::vector<float>> out, d_x, d_weights;  // per rank
  std::map<int64_t, std::vector<float>> d_w13, d_w2;    // by global expert
};

// The problem as one rank holding the routed experts only (compact ids in routing order), all ranks' tokens
// in rank order, each rank's from a multiple of the reference's routing window (masked tokens in the gaps):
// the reference then takes every expert's rows in the order the GPU numbers them on each rank
// (reference/layer_math.hpp), which the FP8 weight gradients' groups of 128 rows depend on.
struct CompactProblem {
  LayerConfig config;
  std::vector<reference::RankInputs<float>> in;
};

// The first token of each rank in the compact rank, and (last entry) its token count.
inline std::vector<int64_t> compact_token_starts(const Problem& p) {
  constexpr int64_t kWindow = reference::detail::kRoutingWindow;
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (const auto& x : p.x) {
    starts.push_back(at);
    at += static_cast<int64_t>(x.size()) / p.config.hidden;
    at = (at + kWindow - 1) / kWindow * kWindow;
  }
  const int64_t last_tokens = p.x.empty() ? 0 : static_cast<int64_t>(p.x.back().size()) / p.config.hidden;
  starts.push_back(p.x.empty() ? 0 : starts.back() + last_tokens);
  return starts;
}

// A per-token [tokens, width] tensor of every rank in the compact rank's layout (zeros in the gaps).
template <typename T>
std::vector<T> compact_rows(const Problem& p, const std::vector<std::vector<T>>& per_rank, int64_t width, T gap) {
  const std::vector<int64_t> starts = compact_token_starts(p);
  std::vector<T> all(static_cast<size_t>(starts.back() * width), gap);
  for (size_t r = 0; r < per_rank.size(); ++r)
    std::copy(per_rank[r].begin(), per_rank[r].end(), all.begin() + starts[r] * width);
  return all;
}

inline CompactProblem compact_problem(const Problem& p) {
  const LayerConfig& c = p.config;
  const int64_t H = c.hidden, I = c.intermediate, K = c.top_k;
  const int64_t R = c.num_ranks;
  LayerConfig compact = c;
  compact.num_ranks = 1;
  compact.num_experts = std::max<int64_t>(K, static_cast<int64_t>(p.routed.size()));
  const int64_t total_tokens = compact_token_starts(p).back();
  compact.max_tokens_per_rank = std::max<int64_t>(1, total_tokens);
  std::map<int64_t, int64_t> compact_id;
  for (size_t i = 0; i < p.routed.size(); ++i) compact_id[p.routed[i]] = static_cast<int64_t>(i);

  std::vector<reference::RankInputs<float>> in(1);
  auto& r0 = in[0];
  r0.num_tokens = total_tokens;
  std::vector<std::vector<int64_t>> ids(R);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t e : p.idx[r]) ids[r].push_back(e < 0 ? -1 : compact_id[e]);
  r0.x = compact_rows(p, p.x, H, 0.0f);
  r0.topk_idx = compact_rows<int64_t>(p, ids, K, -1);
  r0.topk_weights = compact_rows(p, p.weights, K, 0.0f);
  r0.w13.assign(compact.num_experts * 2 * I * H, 0.0f);
  r0.w2.assign(compact.num_experts * H * I, 0.0f);
  for (size_t i = 0; i < p.routed.size(); ++i) {
    for (int64_t k = 0; k < 2 * I * H; ++k) r0.w13[i * 2 * I * H + k] = p.w13_value(p.routed[i], k);
    for (int64_t k = 0; k < H * I; ++k) r0.w2[i * H * I + k] = p.w2_value(p.routed[i], k);
  }
  return CompactProblem{compact, std::move(in)};
}

// Each rank's rows of a compact [tokens, width] result (the gaps left out).
inline std::vector<std::vector<float>> split_by_rank(const Problem& p, const std::vector<float>& all, int64_t width) {
  const std::vector<int64_t> starts = compact_token_starts(p);
  std::vector<std::vector<float>> per_rank;
  for (size_t r = 0; r < p.x.size(); ++r) {
    const int64_t T = static_cast<int64_t>(p.x[r].size()) / p.config.hidden;
    per_rank.emplace_back(all.begin() + starts[r] * width, all.begin() + (starts[r] + T) * width);
  }
  return per_rank;
}

// The reference's forward, per rank: the exact one, or with fp8 the blockwise FP8 one (it quantizes where the
// GPU's FP8 path does).
inline std::vector<std::vector<float>> run_reference_forward(const Problem& p, bool fp8) {
  const CompactProblem compact = compact_problem(p);
  std::vector<std::vector<float>> out;
  const Status s = fp8 ? reference::forward_fp8(compact.config, compact.in, &out)
                       : reference::forward(compact.config, compact.in, &out);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  if (!s.is_ok()) return {};
  return split_by_rank(p, out[0], p.config.hidden);
}

// The reference's forward and backward: the exact layer, or with fp8 the blockwise FP8 one.
inline Expected run_reference(const Problem& p, bool fp8 = false) {
  const LayerConfig& c = p.config;
  const int64_t H = c.hidden, I = c.intermediate, K = c.top_k;
  CompactProblem compact_p = compact_problem(p);
  const LayerConfig& compact = compact_p.config;
  const std::vector<reference::RankInputs<float>>& in = compact_p.in;
  std::vector<std::vector<float>> out, d_out(1);
  d_out[0] = compact_rows(p, p.d_out, H, 0.0f);
  std::vector<reference::RankGradients<float>> grads;
  const Status forward_status = fp8 ? reference::forward_fp8(compact, in, &out) : reference::forward(compact, in, &out);
  EXPECT_TRUE(forward_status.is_ok()) << forward_status.to_string();
  const Status backward_status = fp8 ? reference::backward_fp8(compact, in, d_out, &grads)
                                     : reference::backward(compact, in, d_out, &grads);
  EXPECT_TRUE(backward_status.is_ok()) << backward_status.to_string();
  Expected e;
  e.out = split_by_rank(p, out[0], H);
  e.d_x = split_by_rank(p, grads[0].d_x, H);
  e.d_weights = split_by_rank(p, grads[0].d_topk_weights, K);
  for (size_t i = 0; i < p.routed.size(); ++i) {
    e.d_w13[p.routed[i]].assign(grads[0].d_w13.begin() + i * 2 * I * H, grads[0].d_w13.begin() + (i + 1) * 2 * I * H);
    e.d_w2[p.routed[i]].assign(grads[0].d_w2.begin() + i * H * I, grads[0].d_w2.begin() + (i + 1) * H * I);
  }
  return e;
}

inline std::vector<RankTensors> upload(const Problem& p) {
  const LayerConfig& c = p.config;
  const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, EL = c.experts_per_rank();
  std::vector<RankTensors> t(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    const int64_t T = static_cast<int64_t>(p.x[r].size()) / H;
    auto& rt = t[r];
    rt.x = DeviceBuffer<__nv_bfloat16>(T * H);
    rt.d_out = DeviceBuffer<__nv_bfloat16>(T * H);
    std::vector<__nv_bfloat16> xb(T * H), db(T * H);
    for (int64_t i = 0; i < T * H; ++i) {
      xb[i] = __float2bfloat16(p.x[r][i]);
      db[i] = __float2bfloat16(p.d_out[r][i]);
    }
    rt.x.upload(xb);
    rt.d_out.upload(db);
    rt.idx = DeviceBuffer<int64_t>(T * K);
    rt.idx.upload(p.idx[r]);
    rt.weights = DeviceBuffer<float>(T * K);
    rt.weights.upload(p.weights[r]);
    rt.w13 = DeviceBuffer<__nv_bfloat16>(EL * 2 * I * H);
    rt.w2 = DeviceBuffer<__nv_bfloat16>(EL * H * I);
    const uint64_t first = static_cast<uint64_t>(r * EL);
    EXPECT_TRUE(kernels::fill_hashed_bf16(rt.w13.get(), EL * 2 * I * H, p.seed_of(1), first * 2 * I * H, p.w13_scale));
    EXPECT_TRUE(kernels::fill_hashed_bf16(rt.w2.get(), EL * H * I, p.seed_of(2), first * H * I, p.w2_scale));
    rt.out = DeviceBuffer<__nv_bfloat16>(T * H);
    rt.d_x = DeviceBuffer<__nv_bfloat16>(T * H);
    rt.d_weights = DeviceBuffer<float>(T * K);
    rt.d_w13 = DeviceBuffer<float>(EL * 2 * I * H);
    rt.d_w2 = DeviceBuffer<float>(EL * H * I);
  }
  return t;
}

}  // namespace megamoe::testing::ep_problem
