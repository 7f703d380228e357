// Tests of the CPU reference layer: it is the oracle of every GPU test, so its own gradients are checked
// by finite differences, its multi-rank bookkeeping against the one-rank layer, and its formulas against
// a computation written out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/reference.hpp"
#include "cpu/layer_problem.hpp"
#include "reference/layer_math.hpp"

namespace megamoe::reference {
namespace {

LayerConfig small_config(int64_t num_ranks, int64_t num_experts, int64_t top_k, int64_t max_tokens_per_rank) {
  LayerConfig config;
  config.hidden = 128;
  config.intermediate = 128;
  config.num_experts = num_experts;
  config.top_k = top_k;
  config.num_ranks = num_ranks;
  config.max_tokens_per_rank = max_tokens_per_rank;
  return config;
}

using Problem = testing::LayerProblem<double>;
using testing::concatenate;
using testing::merge_into_one_rank;
using testing::without_gaps;

void fill_uniform(std::vector<double>& values, size_t count, double low, double high, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(low, high);
  values.resize(count);
  for (double& v : values) v = dist(rng);
}

// Random inputs of moderate magnitude: weights scaled by 1/sqrt(fan-in) keep h, a, y of order one, so
// SwiGLU runs in its curved region where a wrong derivative shows. Each token gets K distinct experts.
Problem make_problem(const LayerConfig& config, const std::vector<int64_t>& tokens_per_rank, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.config = config;
  const auto hidden = static_cast<size_t>(config.hidden);
  const auto intermediate = static_cast<size_t>(config.intermediate);
  const auto top_k = static_cast<size_t>(config.top_k);
  const auto experts_per_rank = static_cast<size_t>(config.experts_per_rank());
  const double w13_scale = 2.0 / std::sqrt(static_cast<double>(hidden));
  const double w2_scale = 2.0 / std::sqrt(static_cast<double>(intermediate));
  std::vector<int64_t> expert_ids(static_cast<size_t>(config.num_experts));
  std::iota(expert_ids.begin(), expert_ids.end(), int64_t{0});
  for (int64_t r = 0; r < config.num_ranks; ++r) {
    RankInputs<double> rank;
    rank.num_tokens = tokens_per_rank[r];
    const auto tokens = static_cast<size_t>(rank.num_tokens);
    fill_uniform(rank.x, tokens * hidden, -1.0, 1.0, rng);
    fill_uniform(rank.topk_weights, tokens * top_k, 0.1, 1.0, rng);
    fill_uniform(rank.w13, experts_per_rank * 2 * intermediate * hidden, -w13_scale, w13_scale, rng);
    fill_uniform(rank.w2, experts_per_rank * hidden * intermediate, -w2_scale, w2_scale, rng);
    rank.topk_idx.resize(tokens * top_k);
    for (size_t t = 0; t < tokens; ++t) {
      std::shuffle(expert_ids.begin(), expert_ids.end(), rng);
      std::copy_n(expert_ids.begin(), top_k, rank.topk_idx.begin() + static_cast<std::ptrdiff_t>(t * top_k));
    }
    p.ranks.push_back(std::move(rank));
    std::vector<double> d_out;
    fill_uniform(d_out, tokens * hidden, -1.0, 1.0, rng);
    p.d_out.push_back(std::move(d_out));
  }
  return p;
}

std::vector<std::vector<double>> run_forward(const Problem& p) {
  std::vector<std::vector<double>> out;
  const Status status = forward(p.config, p.ranks, &out);
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  return out;
}

std::vector<RankGradients<double>> run_backward(const Problem& p) {
  std::vector<RankGradients<double>> grads;
  const Status status = backward(p.config, p.ranks, p.d_out, &grads);
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  return grads;
}

// The scalar whose gradients backward returns: sum_r <d_out[r], out[r]>.
double loss(const Problem& p) {
  const std::vector<std::vector<double>> out = run_forward(p);
  double sum = 0.0;
  for (size_t r = 0; r < out.size(); ++r)
    for (size_t k = 0; k < out[r].size(); ++k) sum += p.d_out[r][k] * out[r][k];
  return sum;
}

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double e : v) m = std::max(m, std::abs(e));
  return m;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (size_t k = 0; k < std::min(a.size(), b.size()); ++k) m = std::max(m, std::abs(a[k] - b[k]));
  return m;
}


// ---------------------------------------------------------------------------------------------------
// Finite differences: every gradient against central differences of the loss, in double.

enum class Tensor { kX, kTopkWeights, kW13, kW2 };

std::vector<double>& input_tensor(Problem& p, int64_t rank, Tensor tensor) {
  RankInputs<double>& inputs = p.ranks[rank];
  switch (tensor) {
    case Tensor::kX: return inputs.x;
    case Tensor::kTopkWeights: return inputs.topk_weights;
    case Tensor::kW13: return inputs.w13;
    case Tensor::kW2: return inputs.w2;
  }
  return inputs.x;
}

const std::vector<double>& gradient_tensor(const std::vector<RankGradients<double>>& grads, int64_t rank,
                                           Tensor tensor) {
  const RankGradients<double>& g = grads[rank];
  switch (tensor) {
    case Tensor::kX: return g.d_x;
    case Tensor::kTopkWeights: return g.d_topk_weights;
    case Tensor::kW13: return g.d_w13;
    case Tensor::kW2: return g.d_w2;
  }
  return g.d_x;
}

const char* tensor_name(Tensor tensor) {
  switch (tensor) {
    case Tensor::kX: return "x";
    case Tensor::kTopkWeights: return "topk_weights";
    case Tensor::kW13: return "w13";
    case Tensor::kW2: return "w2";
  }
  return "?";
}

TEST(ReferenceLayerTest, GradientsMatchFiniteDifferences) {
  const LayerConfig config = small_config(/*num_ranks=*/2, /*num_experts=*/4, /*top_k=*/2, /*max_tokens=*/8);
  Problem p = make_problem(config, {5, 4}, /*seed=*/1234);
  // Cover the special routes too: a duplicate expert in one token, a masked slot, a token routed only to
  // the other rank's experts (experts 2 and 3 live on rank 1).
  p.ranks[0].topk_idx[1 * 2 + 0] = 2;
  p.ranks[0].topk_idx[1 * 2 + 1] = 2;
  p.ranks[1].topk_idx[0 * 2 + 1] = -1;
  p.ranks[0].topk_idx[3 * 2 + 0] = 3;
  p.ranks[0].topk_idx[3 * 2 + 1] = 2;
  // Precondition of the weight-gradient checks: every expert receives rows, so no gradient is trivially 0.
  std::vector<int> rows_per_expert(4, 0);
  for (const RankInputs<double>& rank : p.ranks)
    for (int64_t e : rank.topk_idx)
      if (e >= 0) ++rows_per_expert[static_cast<size_t>(e)];
  for (int count : rows_per_expert) ASSERT_GT(count, 0);

  const std::vector<RankGradients<double>> grads = run_backward(p);
  ASSERT_EQ(grads.size(), 2u);
  EXPECT_EQ(grads[1].d_topk_weights[0 * 2 + 1], 0.0) << "masked slot must get d_topk_weights = 0";

  // Central differences have truncation error O(eps^2) and rounding error O(1e-16 |loss| / eps); at
  // eps = 1e-5 both sit well below the tolerance for gradients of order 0.01 to 1.
  const double eps = 1e-5;
  const double rel_tol = 1e-6;
  std::mt19937_64 rng(99);
  for (const Tensor tensor : {Tensor::kX, Tensor::kTopkWeights, Tensor::kW13, Tensor::kW2}) {
    for (int64_t r = 0; r < 2; ++r) {
      const std::vector<double>& analytic = gradient_tensor(grads, r, tensor);
      ASSERT_EQ(analytic.size(), input_tensor(p, r, tensor).size()) << tensor_name(tensor) << " rank " << r;
      // Entries much smaller than the tensor's largest are compared on the tensor's scale: their relative
      // error is dominated by rounding, not by a wrong formula.
      const double floor = 1e-2 * max_abs(analytic);
      ASSERT_GT(floor, 0.0) << tensor_name(tensor) << " rank " << r << " gradient is all zero";

      std::vector<size_t> entries;
      if (tensor == Tensor::kTopkWeights) {
        entries.resize(analytic.size());
        std::iota(entries.begin(), entries.end(), size_t{0});
      } else {
        std::uniform_int_distribution<size_t> pick(0, analytic.size() - 1);
        for (int k = 0; k < 24; ++k) entries.push_back(pick(rng));
      }
      int nontrivial = 0;
      for (size_t entry : entries) {
        double& value = input_tensor(p, r, tensor)[entry];
        const double saved = value;
        value = saved + eps;
        const double loss_plus = loss(p);
        value = saved - eps;
        const double loss_minus = loss(p);
        value = saved;
        const double numeric = (loss_plus - loss_minus) / (2 * eps);
        const double expected = analytic[entry];
        EXPECT_NEAR(numeric, expected, rel_tol * std::max(std::abs(expected), floor))
            << tensor_name(tensor) << " rank " << r << " entry " << entry;
        if (std::abs(expected) > floor) ++nontrivial;
      }
      // Guard against a check that passes because the sampled gradients are all zero.
      EXPECT_GE(nontrivial, static_cast<int>(entries.size()) / 4) << tensor_name(tensor) << " rank " << r;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Partition invariance: R ranks compute the same numbers as one rank holding everything.

TEST(ReferenceLayerTest, PartitionInvariance) {
  const std::vector<int64_t> tokens_per_rank_all = {3, 0, 5, 2, 1, 4, 2, 3};
  for (const int64_t num_ranks : {2, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(num_ranks));
    const LayerConfig config = small_config(num_ranks, /*num_experts=*/8, /*top_k=*/3, /*max_tokens=*/6);
    const std::vector<int64_t> tokens_per_rank(tokens_per_rank_all.begin(),
                                               tokens_per_rank_all.begin() + num_ranks);
    Problem p = make_problem(config, tokens_per_rank, /*seed=*/static_cast<uint64_t>(7 + num_ranks));
    p.ranks[0].topk_idx[2] = -1;                       // a masked slot
    p.ranks[2 % num_ranks].topk_idx[0] = p.ranks[2 % num_ranks].topk_idx[1];  // a duplicate expert
    const Problem merged = merge_into_one_rank(p);

    const std::vector<std::vector<double>> out = run_forward(p);
    const std::vector<std::vector<double>> merged_out = run_forward(merged);
    ASSERT_EQ(out.size(), static_cast<size_t>(num_ranks));
    for (int64_t r = 0; r < num_ranks; ++r)
      EXPECT_EQ(out[r].size(), static_cast<size_t>(tokens_per_rank[r] * config.hidden)) << "rank " << r;
    ASSERT_GT(max_abs(merged_out[0]), 0.0);
    // The summation order is the same for every partition, so the results are identical, not just close.
    EXPECT_EQ(max_abs_diff(concatenate(out), without_gaps(p, merged_out[0], config.hidden)), 0.0) << "out";

    const std::vector<RankGradients<double>> grads = run_backward(p);
    const std::vector<RankGradients<double>> merged_grads = run_backward(merged);
    ASSERT_EQ(grads.size(), static_cast<size_t>(num_ranks));
    auto gather = [&](std::vector<double> RankGradients<double>::*member) {
      std::vector<std::vector<double>> parts;
      for (const RankGradients<double>& g : grads) parts.push_back(g.*member);
      return concatenate(parts);
    };
    // Per-token gradients come without the merged rank's gap tokens; the weights' gradients as they are.
    for (const auto& [name, member, width] :
         {std::tuple{"d_x", &RankGradients<double>::d_x, config.hidden},
          std::tuple{"d_topk_weights", &RankGradients<double>::d_topk_weights, config.top_k},
          std::tuple{"d_w13", &RankGradients<double>::d_w13, int64_t{0}},
          std::tuple{"d_w2", &RankGradients<double>::d_w2, int64_t{0}}}) {
      const std::vector<double> expected =
          width > 0 ? without_gaps(p, merged_grads[0].*member, width) : merged_grads[0].*member;
      ASSERT_GT(max_abs(expected), 0.0) << name;
      EXPECT_EQ(max_abs_diff(gather(member), expected), 0.0) << name;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Masked slots contribute nothing, whatever their routing weight.

TEST(ReferenceLayerTest, MaskedSlotsContributeNothing) {
  const LayerConfig config = small_config(/*num_ranks=*/2, /*num_experts=*/4, /*top_k=*/2, /*max_tokens=*/4);
  Problem masked = make_problem(config, {3, 4}, /*seed=*/42);
  // Rank 0 token 1: one slot masked. Rank 1 token 2: both slots masked. Their weights stay nonzero.
  masked.ranks[0].topk_idx[1 * 2 + 1] = -1;
  masked.ranks[1].topk_idx[2 * 2 + 0] = -1;
  masked.ranks[1].topk_idx[2 * 2 + 1] = -1;

  // The same problem with each masked slot routed to a real expert at weight 0.
  Problem zero_weight = masked;
  zero_weight.ranks[0].topk_idx[1 * 2 + 1] = 3;
  zero_weight.ranks[0].topk_weights[1 * 2 + 1] = 0.0;
  zero_weight.ranks[1].topk_idx[2 * 2 + 0] = 0;
  zero_weight.ranks[1].topk_weights[2 * 2 + 0] = 0.0;
  zero_weight.ranks[1].topk_idx[2 * 2 + 1] = 1;
  zero_weight.ranks[1].topk_weights[2 * 2 + 1] = 0.0;

  const std::vector<std::vector<double>> out = run_forward(masked);
  const std::vector<std::vector<double>> zero_weight_out = run_forward(zero_weight);
  const std::vector<RankGradients<double>> grads = run_backward(masked);
  const std::vector<RankGradients<double>> zero_weight_grads = run_backward(zero_weight);
  ASSERT_EQ(out.size(), 2u);
  ASSERT_EQ(grads.size(), 2u);

  for (size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(max_abs_diff(out[r], zero_weight_out[r]), 0.0) << "out";
    EXPECT_EQ(max_abs_diff(grads[r].d_x, zero_weight_grads[r].d_x), 0.0) << "d_x";
    EXPECT_EQ(max_abs_diff(grads[r].d_w13, zero_weight_grads[r].d_w13), 0.0) << "d_w13";
    EXPECT_EQ(max_abs_diff(grads[r].d_w2, zero_weight_grads[r].d_w2), 0.0) << "d_w2";
  }
  EXPECT_EQ(grads[0].d_topk_weights[1 * 2 + 1], 0.0);
  EXPECT_EQ(grads[1].d_topk_weights[2 * 2 + 0], 0.0);
  EXPECT_EQ(grads[1].d_topk_weights[2 * 2 + 1], 0.0);
  // The zero-weight twin does see its experts: <dOut, y> is not 0 there, so the zeros above are masking.
  EXPECT_NE(zero_weight_grads[0].d_topk_weights[1 * 2 + 1], 0.0);
  EXPECT_NE(grads[0].d_topk_weights[1 * 2 + 0], 0.0);

  // A token with every slot masked has no output and no input gradient.
  const auto hidden = static_cast<size_t>(config.hidden);
  for (size_t h = 0; h < hidden; ++h) {
    EXPECT_EQ(out[1][2 * hidden + h], 0.0) << "h " << h;
    EXPECT_EQ(grads[1].d_x[2 * hidden + h], 0.0) << "h " << h;
  }
}

// ---------------------------------------------------------------------------------------------------
// One token against the formulas of docs/MODEL.md written out by hand.

TEST(ReferenceLayerTest, SingleTokenMatchesHandComputation) {
  // Two ranks, one expert each, K = 1. The only token lives on rank 0 and is routed to expert 1, which
  // lives on rank 1: its gradients must land on rank 1 and expert 0 (filled with junk) must stay unused.
  const LayerConfig config = small_config(/*num_ranks=*/2, /*num_experts=*/2, /*top_k=*/1, /*max_tokens=*/2);
  const size_t H = 128;
  const size_t I = 128;
  std::vector<RankInputs<double>> ranks(2);
  ranks[0].num_tokens = 1;
  ranks[0].x.assign(H, 0.0);
  ranks[0].x[0] = 1.0;
  ranks[0].x[1] = 2.0;
  ranks[0].topk_idx = {1};
  const double routing_weight = 2.0;
  ranks[0].topk_weights = {routing_weight};
  ranks[0].w13.assign(2 * I * H, 5.0);
  ranks[0].w2.assign(H * I, -3.0);

  ranks[1].num_tokens = 0;
  ranks[1].w13.assign(2 * I * H, 0.0);
  ranks[1].w13[0 * H + 0] = 0.5;    // gate row 0
  ranks[1].w13[0 * H + 1] = 0.125;  // gate row 0
  ranks[1].w13[I * H + 0] = -1.5;   // up row 0
  ranks[1].w13[I * H + 1] = 1.0;    // up row 0
  ranks[1].w2.assign(H * I, 0.0);
  ranks[1].w2[0 * I + 0] = 0.25;  // y[0] = 0.25 a[0]
  ranks[1].w2[1 * I + 0] = -2.0;  // y[1] = -2 a[0]

  // Forward: g0 = 0.5*1 + 0.125*2 = 0.75, u0 = -1.5*1 + 1*2 = 0.5, all other gate/up values are 0.
  const double g = 0.75;
  const double u = 0.5;
  const double sig = 1.0 / (1.0 + std::exp(-g));
  const double a = g * sig * u;
  std::vector<double> expected_out(H, 0.0);
  expected_out[0] = routing_weight * 0.25 * a;
  expected_out[1] = routing_weight * -2.0 * a;

  std::vector<std::vector<double>> out;
  ASSERT_TRUE(forward(config, ranks, &out).is_ok());
  ASSERT_EQ(out.size(), 2u);
  ASSERT_EQ(out[0].size(), H);
  EXPECT_TRUE(out[1].empty());
  for (size_t h = 0; h < H; ++h) EXPECT_NEAR(out[0][h], expected_out[h], 1e-15) << "out h " << h;

  // Backward with dOut = (1, 3, 0, ...).
  std::vector<std::vector<double>> d_out(2);
  d_out[0].assign(H, 0.0);
  d_out[0][0] = 1.0;
  d_out[0][1] = 3.0;
  const double d_weight = 1.0 * (0.25 * a) + 3.0 * (-2.0 * a);  // <dOut, y>
  const double da = routing_weight * (1.0 * 0.25 + 3.0 * -2.0);  // (w dOut) . W2[:, 0]
  const double dg = da * u * sig * (1.0 + g * (1.0 - sig));
  const double du = da * g * sig;

  std::vector<RankGradients<double>> grads;
  ASSERT_TRUE(backward(config, ranks, d_out, &grads).is_ok());
  ASSERT_EQ(grads.size(), 2u);
  ASSERT_EQ(grads[0].d_topk_weights.size(), 1u);
  EXPECT_NEAR(grads[0].d_topk_weights[0], d_weight, 1e-15);

  std::vector<double> expected_d_x(H, 0.0);
  expected_d_x[0] = dg * 0.5 + du * -1.5;
  expected_d_x[1] = dg * 0.125 + du * 1.0;
  ASSERT_EQ(grads[0].d_x.size(), H);
  for (size_t h = 0; h < H; ++h) EXPECT_NEAR(grads[0].d_x[h], expected_d_x[h], 1e-14) << "d_x h " << h;

  // dW2 = dy^T a: only column 0 (a[0] != 0), rows 0 and 1 (dy != 0).
  std::vector<double> expected_d_w2(H * I, 0.0);
  expected_d_w2[0 * I + 0] = routing_weight * 1.0 * a;
  expected_d_w2[1 * I + 0] = routing_weight * 3.0 * a;
  // dW13 = dh^T x: gate row 0 and up row 0 (the only nonzero dh), columns 0 and 1 (x != 0).
  std::vector<double> expected_d_w13(2 * I * H, 0.0);
  expected_d_w13[0 * H + 0] = dg * 1.0;
  expected_d_w13[0 * H + 1] = dg * 2.0;
  expected_d_w13[I * H + 0] = du * 1.0;
  expected_d_w13[I * H + 1] = du * 2.0;
  EXPECT_LE(max_abs_diff(grads[1].d_w2, expected_d_w2), 1e-14);
  EXPECT_LE(max_abs_diff(grads[1].d_w13, expected_d_w13), 1e-14);
  // Expert 0 received no rows: its gradients are exactly zero.
  EXPECT_EQ(max_abs(grads[0].d_w2), 0.0);
  EXPECT_EQ(max_abs(grads[0].d_w13), 0.0);
  EXPECT_TRUE(grads[1].d_x.empty());
}

// ---------------------------------------------------------------------------------------------------
// The float instantiation (what GPU tests compare against) agrees with the double one.

std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

double relative_error(const std::vector<float>& got, const std::vector<double>& expected) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t k = 0; k < expected.size(); ++k) {
    diff += (static_cast<double>(got[k]) - expected[k]) * (static_cast<double>(got[k]) - expected[k]);
    norm += expected[k] * expected[k];
  }
  return std::sqrt(diff / norm);
}

TEST(ReferenceLayerTest, FloatMatchesDouble) {
  const LayerConfig config = small_config(/*num_ranks=*/2, /*num_experts=*/4, /*top_k=*/2, /*max_tokens=*/4);
  const Problem p = make_problem(config, {4, 3}, /*seed=*/5);
  std::vector<RankInputs<float>> ranks;
  std::vector<std::vector<float>> d_out;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    RankInputs<float> rank;
    rank.num_tokens = p.ranks[r].num_tokens;
    rank.x = to_float(p.ranks[r].x);
    rank.topk_idx = p.ranks[r].topk_idx;
    rank.topk_weights = to_float(p.ranks[r].topk_weights);
    rank.w13 = to_float(p.ranks[r].w13);
    rank.w2 = to_float(p.ranks[r].w2);
    ranks.push_back(std::move(rank));
    d_out.push_back(to_float(p.d_out[r]));
  }
  std::vector<std::vector<float>> out;
  ASSERT_TRUE(forward(config, ranks, &out).is_ok());
  std::vector<RankGradients<float>> grads;
  ASSERT_TRUE(backward(config, ranks, d_out, &grads).is_ok());
  const std::vector<std::vector<double>> expected_out = run_forward(p);
  const std::vector<RankGradients<double>> expected = run_backward(p);
  for (size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_LT(relative_error(out[r], expected_out[r]), 1e-6);
    EXPECT_LT(relative_error(grads[r].d_x, expected[r].d_x), 1e-6);
    EXPECT_LT(relative_error(grads[r].d_topk_weights, expected[r].d_topk_weights), 1e-6);
    EXPECT_LT(relative_error(grads[r].d_w13, expected[r].d_w13), 1e-6);
    EXPECT_LT(relative_error(grads[r].d_w2, expected[r].d_w2), 1e-6);
  }
}

// ---------------------------------------------------------------------------------------------------
// The quantization hooks (the entry points of the FP8 reference) run where layer_math.hpp says.

TEST(ReferenceLayerHooksTest, HooksRunAtTheDocumentedPointsAndTheirRoundingIsUsed) {
  const LayerConfig config = small_config(/*num_ranks=*/2, /*num_experts=*/4, /*top_k=*/2, /*max_tokens=*/4);
  Problem p = make_problem(config, {3, 2}, /*seed=*/21);
  // 9 routed rows (one slot masked, one duplicate); experts 0, 1, 2 get rows, expert 3 none.
  p.ranks[0].topk_idx = {0, -1, 1, 2, 0, 0};
  p.ranks[1].topk_idx = {2, 1, 0, 1};
  const int64_t routed_rows = 9;
  const int64_t experts_with_rows = 3;

  std::vector<int64_t> row_calls(8, 0);
  std::vector<int64_t> wgrad_calls(4, 0);
  int64_t weight_calls = 0;
  detail::QuantizationHooks<double> counting;
  counting.round_row = [&](detail::RowPoint point, std::span<double> row) {
    const auto expected_width = static_cast<size_t>(
        point == detail::RowPoint::kGateUp || point == detail::RowPoint::kGateUpGrad ? 2 * config.intermediate
        : point == detail::RowPoint::kActivation || point == detail::RowPoint::kActivationGrad
            ? config.intermediate
            : config.hidden);
    EXPECT_EQ(row.size(), expected_width) << static_cast<int>(point);
    ++row_calls[static_cast<size_t>(point)];
  };
  counting.round_weight = [&](detail::WeightKind, std::span<double> matrix, int64_t rows, int64_t cols) {
    EXPECT_EQ(static_cast<int64_t>(matrix.size()), rows * cols);
    ++weight_calls;
  };
  counting.round_wgrad_operand = [&](detail::WgradOperand operand, std::span<double> matrix, int64_t channels,
                                     int64_t rows) {
    EXPECT_EQ(static_cast<int64_t>(matrix.size()), channels * rows);
    ++wgrad_calls[static_cast<size_t>(operand)];
  };

  // Hooks that leave values alone change nothing.
  std::vector<std::vector<double>> out;
  ASSERT_TRUE(detail::forward_impl(config, p.ranks, counting, &out).is_ok());
  EXPECT_EQ(max_abs_diff(concatenate(out), concatenate(run_forward(p))), 0.0);
  EXPECT_EQ(weight_calls, 2 * config.num_experts);
  for (const detail::RowPoint point : {detail::RowPoint::kTokenInput, detail::RowPoint::kGateUp,
                                       detail::RowPoint::kActivation, detail::RowPoint::kExpertOutput})
    EXPECT_EQ(row_calls[static_cast<size_t>(point)], routed_rows) << static_cast<int>(point);

  std::fill(row_calls.begin(), row_calls.end(), 0);
  std::vector<RankGradients<double>> grads;
  ASSERT_TRUE(detail::backward_impl(config, p.ranks, p.d_out, counting, &grads).is_ok());
  const std::vector<RankGradients<double>> plain = run_backward(p);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(max_abs_diff(grads[r].d_x, plain[r].d_x), 0.0);
    EXPECT_EQ(max_abs_diff(grads[r].d_w13, plain[r].d_w13), 0.0);
  }
  for (int64_t calls : row_calls) EXPECT_EQ(calls, routed_rows);  // backward recomputes the forward rows
  for (int64_t calls : wgrad_calls) EXPECT_EQ(calls, experts_with_rows);

  // A weight hook acts on copies: doubling w2 doubles out and leaves the caller's weights alone.
  detail::QuantizationHooks<double> doubling;
  doubling.round_weight = [](detail::WeightKind kind, std::span<double> matrix, int64_t, int64_t) {
    if (kind == detail::WeightKind::kW2)
      for (double& v : matrix) v *= 2.0;
  };
  const std::vector<double> w2_before = p.ranks[1].w2;
  std::vector<std::vector<double>> doubled;
  ASSERT_TRUE(detail::forward_impl(config, p.ranks, doubling, &doubled).is_ok());
  std::vector<double> twice_out = concatenate(run_forward(p));
  for (double& v : twice_out) v *= 2.0;
  EXPECT_LE(max_abs_diff(concatenate(doubled), twice_out), 1e-14);
  EXPECT_EQ(p.ranks[1].w2, w2_before);
}

// ---------------------------------------------------------------------------------------------------
// Input validation: every broken rule is reported, naming the rank and the tensor or field.

Problem valid_problem() {
  return make_problem(small_config(/*num_ranks=*/2, /*num_experts=*/4, /*top_k=*/2, /*max_tokens=*/4), {3, 2}, 11);
}

Status check(const Problem& p) { return check_inputs(p.config, p.ranks); }

void expect_invalid(const Status& status, const std::string& fragment) {
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
  EXPECT_NE(status.message().find(fragment), std::string::npos)
      << "message \"" << status.message() << "\" does not contain \"" << fragment << "\"";
}

TEST(ReferenceCheckInputsTest, AcceptsValidInputs) {
  const Problem p = valid_problem();
  EXPECT_TRUE(check(p).is_ok()) << check(p).to_string();
}

TEST(ReferenceCheckInputsTest, RejectsWrongTensorSizes) {
  {
    Problem p = valid_problem();
    p.ranks[1].x.pop_back();
    expect_invalid(check(p), "rank 1: x must have num_tokens * H = 256 elements, got 255");
  }
  {
    Problem p = valid_problem();
    p.ranks[0].w13.push_back(0.0);
    expect_invalid(check(p), "rank 0: w13 ");
  }
  {
    Problem p = valid_problem();
    p.ranks[1].w2.clear();
    expect_invalid(check(p), "rank 1: w2 ");
  }
  {
    Problem p = valid_problem();
    p.ranks[0].topk_idx.pop_back();
    expect_invalid(check(p), "rank 0: topk_idx ");
  }
  {
    Problem p = valid_problem();
    p.ranks[1].topk_weights.push_back(1.0);
    expect_invalid(check(p), "rank 1: topk_weights ");
  }
}

TEST(ReferenceCheckInputsTest, RejectsExpertIdsOutOfRange) {
  {
    Problem p = valid_problem();
    p.ranks[1].topk_idx[1 * 2 + 0] = 4;  // == E
    expect_invalid(check(p), "rank 1: topk_idx[1, 0] = 4");
  }
  {
    Problem p = valid_problem();
    p.ranks[0].topk_idx[2 * 2 + 1] = -2;
    expect_invalid(check(p), "rank 0: topk_idx[2, 1] = -2");
  }
  {
    Problem p = valid_problem();
    p.ranks[0].topk_idx[0] = -1;  // masked is fine
    EXPECT_TRUE(check(p).is_ok()) << check(p).to_string();
  }
}

TEST(ReferenceCheckInputsTest, RejectsBadTokenCounts) {
  {
    Problem p = valid_problem();
    p.ranks[0] = make_problem(p.config, {5, 0}, 3).ranks[0];  // consistent sizes, but T = 5 > 4
    expect_invalid(check(p), "rank 0: num_tokens must be in [0, max_tokens_per_rank = 4], got 5");
  }
  {
    Problem p = valid_problem();
    p.ranks[1].num_tokens = -1;
    expect_invalid(check(p), "rank 1: num_tokens");
  }
}

TEST(ReferenceCheckInputsTest, RejectsWrongRankCountAndBadConfig) {
  {
    Problem p = valid_problem();
    p.ranks.push_back(p.ranks[0]);
    expect_invalid(check(p), "ranks must have num_ranks (R) = 2 entries, got 3");
  }
  {
    Problem p = valid_problem();
    p.config.hidden = 100;
    expect_invalid(check(p), "hidden (H)");
  }
}

TEST(ReferenceCheckInputsTest, ForwardAndBackwardReportErrorsInsteadOfRunning) {
  Problem p = valid_problem();
  p.ranks[1].topk_idx[0] = 9;
  std::vector<std::vector<double>> out;
  expect_invalid(forward(p.config, p.ranks, &out), "rank 1: topk_idx[0, 0] = 9");
  std::vector<RankGradients<double>> grads;
  expect_invalid(backward(p.config, p.ranks, p.d_out, &grads), "rank 1: topk_idx[0, 0] = 9");

  Problem q = valid_problem();
  q.d_out[1].pop_back();
  expect_invalid(backward(q.config, q.ranks, q.d_out, &grads), "rank 1: d_out must have");
  q.d_out.pop_back();
  expect_invalid(backward(q.config, q.ranks, q.d_out, &grads), "d_out must have num_ranks (R) = 2 entries");
  expect_invalid(forward(q.config, q.ranks, static_cast<std::vector<std::vector<double>>*>(nullptr)), "out");
  expect_invalid(backward(valid_problem().config, valid_problem().ranks, valid_problem().d_out,
                          static_cast<std::vector<RankGradients<double>>*>(nullptr)),
                 "grads");
}

}  // namespace
}  // namespace megamoe::reference
