// Fuzz test of the GPU layer (virtual ranks) against the CPU reference.
//
// MEGAMOE_FUZZ_CASES cases (default 40, so the regular suite stays fast; 1000 for a soak run), case i on
// seed MEGAMOE_FUZZ_SEED + i (default first seed 1). A case is drawn from its seed alone (std::mt19937_64
// and no std:: distributions, so the same seed gives the same case with any standard library): a failing
// seed reruns with MEGAMOE_FUZZ_SEED=<seed> MEGAMOE_FUZZ_CASES=1.
//
// A case draws the shape (R 1..8, H and I in {128, 256}, E = R x (1..4), K in 1..min(E, 4),
// max_tokens_per_rank 1..96; the routed rows are capped so that the single-threaded reference stays cheap),
// the tokens of every rank (T = 0 and T = max_tokens_per_rank often), the routing (distinct experts,
// masked slots, one expert twice in a token, all to one expert, a pool that leaves experts empty, all on
// one rank's experts, all masked), the index type (int64 or int32) and the fp32 routing weights. About one
// case in seven is a bad input instead:
//   - an expert id outside [-1, E) in topk_idx (int64 ids that truncate to a valid int32 id included):
//     every rank reports kInvalidArgument naming the rank, token and id; every output of the call is NaN
//     (the backward of the failed forward too);
//   - more expert rows than LayerOptions::expert_row_capacity: every rank reports kCapacityExceeded
//     naming the capacity; every output is NaN;
//   - a host-side refusal (num_tokens out of [0, max_tokens_per_rank], a null or misaligned pointer of
//     the forward or the backward, a backward before any forward): kInvalidArgument naming the field,
//     from the call itself, before anything is enqueued.
// After each of them a valid forward + backward on the same group must match the reference: only a
// timeout makes a layer unusable (layer.hpp), and a refused call must leave nothing behind that a later
// call's barriers would miscount.
//
// Valid calls: outputs are poisoned with NaN first; every rank's out, d_x, d_topk_weights and every
// routed expert's d_w13, d_w2 must be within the layer test's 1e-2 relative error of the reference
// (ep_layer_test.cu), with no NaN; an expert no token chose has gradients exactly 0, and so do a masked
// slot's d_topk_weights and a fully masked token's out and d_x rows; synchronize_and_check() must be OK.
// One exception to the tensor-wide relative error: d_topk_weights of a rank with fewer than 16 routed
// slots, checked entry by entry against its dot product's conditioning scale (ep_layer_problem.hpp,
// DotProductScales).
// Some valid cases run twice and must give the same bits. The forward and backward paths cycle with the
// seed (seed % 4: modular, fused forward, fused backward, both fused).
//
// Every wait is bounded (LayerOptions::wait_timeout_seconds = 10 s): a hang fails, it does not stall.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ep_layer_problem.hpp"
#include "gpu_test_util.hpp"
#include "kernels/hashed_fill.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/reference.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;
using testing::ep_problem::backward_args_of;
using testing::ep_problem::Expected;
using testing::ep_problem::forward_args_of;
using testing::ep_problem::Problem;
using testing::ep_problem::RankTensors;
using testing::ep_problem::relative_error;
using testing::ep_problem::run_reference;
using testing::ep_problem::to_float;
using testing::ep_problem::upload;

constexpr double kTolerance = 1e-2;          // the layer test's bound (ep_layer_test.cu), not loosened
using testing::ep_problem::kMinSlotsForNorm;  // fewer routed slots: d_topk_weights entry by entry
constexpr double kWaitTimeoutSeconds = 10.0;  // a hang becomes a failure
// Routed rows x H x I per case: the single-threaded reference costs about 10 ns per unit (forward,
// backward and weight gradients), so at most about 30 ms per case, plus regenerating the routed experts'
// weights (up to 80 ms for 32 experts at H = I = 256). On a 2-core build machine: 18 ms per case on average.
constexpr int64_t kRowBudget = 3000000;
constexpr size_t kMaxListed = 20;

// ---- a portable random source: the same case from the same seed everywhere ----

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  int64_t range(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(engine_() % static_cast<uint64_t>(hi - lo + 1));
  }
  double unit() { return static_cast<double>(engine_() >> 11) * (1.0 / 9007199254740992.0); }
  bool chance(double p) { return unit() < p; }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(range(0, static_cast<int64_t>(i) - 1))]);
  }

 private:
  std::mt19937_64 engine_;
};

// ---- what a case is ----

enum class Routing { kDistinct, kMasked, kDuplicates, kAllToOne, kPool, kOneRank, kAllMasked };
enum class Kind { kValid, kBadExpertId, kCapacity, kRefusal };
enum class Refusal {
  kTooManyTokens,
  kNegativeTokens,
  kNullWeights,
  kNullTokenTensor,
  kMisalignedForward,
  kBackwardBeforeForward,
  kMisalignedBackward,
  kNullBackward,
};
constexpr int kRefusalKinds = 8;

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kDistinct: return "distinct";
    case Routing::kMasked: return "masked";
    case Routing::kDuplicates: return "duplicates";
    case Routing::kAllToOne: return "all-to-one";
    case Routing::kPool: return "pool";
    case Routing::kOneRank: return "one-rank";
    case Routing::kAllMasked: return "all-masked";
  }
  return "?";
}

const char* refusal_name(Refusal r) {
  switch (r) {
    case Refusal::kTooManyTokens: return "too-many-tokens";
    case Refusal::kNegativeTokens: return "negative-tokens";
    case Refusal::kNullWeights: return "null-weights";
    case Refusal::kNullTokenTensor: return "null-token-tensor";
    case Refusal::kMisalignedForward: return "misaligned-forward";
    case Refusal::kBackwardBeforeForward: return "backward-before-forward";
    case Refusal::kMisalignedBackward: return "misaligned-backward";
    case Refusal::kNullBackward: return "null-backward";
  }
  return "?";
}

struct Case {
  uint64_t seed = 0;
  Kind kind = Kind::kValid;
  Routing routing = Routing::kDistinct;
  IndexType index_type = IndexType::kInt64;
  LayerOptions options;
  Problem p;            // the valid problem: what the reference computes
  bool repeat = false;  // valid: run twice, the same bits
  // kBadExpertId / kCapacity: check the error once after the forward too
  bool check_between = false;
  // kBadExpertId: idx[bad_rank][bad_pos] = bad_id in the failing call
  int bad_rank = -1;
  int64_t bad_pos = -1, bad_id = 0;
  // kCapacity: the failing call's routing (p.idx is it with slots masked until it fits)
  std::vector<std::vector<int64_t>> overflow_idx;
  // kRefusal
  Refusal refusal = Refusal::kTooManyTokens;
  int refusal_rank = 0;
  int refusal_field = 0;         // which pointer
  int64_t refusal_amount = 0;    // tokens or bytes
  std::string label;             // one line, for the failure list
};

int64_t tokens_of(const Problem& p, int r) { return static_cast<int64_t>(p.x[r].size()) / p.config.hidden; }

// Expert rows each rank receives under the routing (one per unmasked slot: a duplicate is two rows).
std::vector<int64_t> rows_per_rank(const LayerConfig& c, const std::vector<std::vector<int64_t>>& idx) {
  std::vector<int64_t> rows(c.num_ranks, 0);
  for (const auto& v : idx)
    for (int64_t e : v)
      if (e >= 0) ++rows[e / c.experts_per_rank()];
  return rows;
}

void set_routed(Problem& p) {
  std::vector<bool> used(p.config.num_experts, false);
  for (const auto& v : p.idx)
    for (int64_t e : v)
      if (e >= 0) used[e] = true;
  p.routed.clear();
  p.probe_expert = -1;
  for (int64_t e = 0; e < p.config.num_experts; ++e)
    if (used[e]) p.routed.push_back(e);
    else if (p.probe_expert < 0) p.probe_expert = e;
}

// K distinct experts of pool (pool.size() >= K), in random order.
std::vector<int64_t> distinct_from(std::vector<int64_t> pool, int64_t K, Rng& rng) {
  for (int64_t j = 0; j < K; ++j)
    std::swap(pool[j], pool[rng.range(j, static_cast<int64_t>(pool.size()) - 1)]);
  pool.resize(K);
  return pool;
}

std::vector<int64_t> with_replacement(const std::vector<int64_t>& pool, int64_t K, Rng& rng) {
  std::vector<int64_t> row(K);
  for (auto& e : row) e = pool[rng.range(0, static_cast<int64_t>(pool.size()) - 1)];
  return row;
}

std::string describe(const Case& k) {
  const LayerConfig& c = k.p.config;
  std::string s;
  switch (k.kind) {
    case Kind::kValid: s = "valid"; break;
    case Kind::kBadExpertId:
      s = "bad-id " + std::to_string(k.bad_id) + " at rank " + std::to_string(k.bad_rank) + " idx[" +
          std::to_string(k.bad_pos) + "]";
      break;
    case Kind::kCapacity: s = "capacity " + std::to_string(k.options.expert_row_capacity); break;
    case Kind::kRefusal:
      s = std::string("refusal ") + refusal_name(k.refusal) + " rank " + std::to_string(k.refusal_rank) + " field " +
          std::to_string(k.refusal_field) + " amount " + std::to_string(k.refusal_amount);
      break;
  }
  s += " | R=" + std::to_string(c.num_ranks) + " H=" + std::to_string(c.hidden) + " I=" +
       std::to_string(c.intermediate) + " E=" + std::to_string(c.num_experts) + " K=" + std::to_string(c.top_k) +
       " maxT=" + std::to_string(c.max_tokens_per_rank) + " T={";
  for (int r = 0; r < c.num_ranks; ++r) s += (r ? "," : "") + std::to_string(tokens_of(k.p, r));
  s += std::string("} ") + routing_name(k.routing) + (k.index_type == IndexType::kInt32 ? " int32" : " int64");
  if (k.kind != Kind::kCapacity && k.options.expert_row_capacity > 0)
    s += " capacity=" + std::to_string(k.options.expert_row_capacity);
  s += k.options.forward_path == ForwardPath::kFused ? " fwd=fused" : " fwd=modular";
  s += k.options.backward_path == BackwardPath::kFused ? " bwd=fused" : " bwd=modular";
  return s;
}

Case draw_case(uint64_t seed) {
  Case k;
  k.seed = seed;
  Rng rng(seed);
  Problem& p = k.p;
  p.seed = seed;
  LayerConfig& c = p.config;
  c.num_ranks = rng.range(1, 8);
  c.hidden = rng.chance(0.5) ? 128 : 256;
  c.intermediate = rng.chance(0.5) ? 128 : 256;
  c.num_experts = c.num_ranks * rng.range(1, 4);
  c.top_k = rng.range(1, std::min<int64_t>(c.num_experts, 4));
  const int R = static_cast<int>(c.num_ranks);
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts, K = c.top_k, EL = c.experts_per_rank();
  p.w13_scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(H)));
  p.w2_scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(I)));
  k.options.wait_timeout_seconds = kWaitTimeoutSeconds;

  const double u = rng.unit();
  k.kind = u < 0.85 ? Kind::kValid : u < 0.90 ? Kind::kBadExpertId : u < 0.94 ? Kind::kCapacity : Kind::kRefusal;
  k.index_type = rng.chance(0.5) ? IndexType::kInt32 : IndexType::kInt64;
  k.repeat = k.kind == Kind::kValid && rng.chance(0.25);
  k.check_between = rng.chance(0.5);
  if (k.kind == Kind::kRefusal) {
    k.refusal = static_cast<Refusal>(rng.range(0, kRefusalKinds - 1));
    k.refusal_rank = static_cast<int>(rng.range(0, R - 1));
    k.refusal_field = static_cast<int>(rng.range(0, 5));
    k.refusal_amount = rng.range(1, 7);
  }

  // Tokens, within the reference's budget.
  const int64_t token_budget = std::max<int64_t>(1, kRowBudget / (K * H * I));
  int64_t max_tokens = rng.chance(0.5) ? rng.range(1, 16) : rng.range(1, 96);
  if (rng.chance(0.5)) max_tokens = std::min(max_tokens, std::max<int64_t>(1, token_budget / R));
  if (k.kind == Kind::kCapacity) max_tokens = std::max<int64_t>(max_tokens, 2);
  c.max_tokens_per_rank = max_tokens;
  std::vector<int64_t> T(R);
  for (auto& t : T) {
    const double v = rng.unit();
    t = v < 0.2 ? 0 : v < 0.4 ? max_tokens : rng.range(0, max_tokens);
  }
  for (;;) {
    int64_t sum = 0;
    for (int64_t t : T) sum += t;
    if (sum <= token_budget) break;
    auto biggest = std::max_element(T.begin(), T.end());
    *biggest /= 2;
  }
  if (k.kind == Kind::kBadExpertId && *std::max_element(T.begin(), T.end()) == 0) T[rng.range(0, R - 1)] = 1;
  if (k.kind == Kind::kCapacity) T[0] = std::max<int64_t>(T[0], 2);
  // A refused token pointer is one the call needs (T > 0).
  if (k.kind == Kind::kRefusal && k.refusal != Refusal::kTooManyTokens && k.refusal != Refusal::kNegativeTokens &&
      k.refusal != Refusal::kNullWeights && k.refusal != Refusal::kBackwardBeforeForward)
    T[k.refusal_rank] = std::max<int64_t>(T[k.refusal_rank], 1);

  // Routing.
  const double ru = rng.unit();
  k.routing = ru < 0.20   ? Routing::kDistinct
              : ru < 0.40 ? Routing::kMasked
              : ru < 0.55 ? Routing::kDuplicates
              : ru < 0.65 ? Routing::kAllToOne
              : ru < 0.80 ? Routing::kPool
              : ru < 0.92 ? Routing::kOneRank
                          : Routing::kAllMasked;
  if (k.kind == Kind::kCapacity && k.routing == Routing::kAllMasked) k.routing = Routing::kMasked;
  std::vector<int64_t> all(E);
  for (int64_t e = 0; e < E; ++e) all[e] = e;
  const double mask_p = 0.1 + 0.6 * rng.unit();
  const int64_t target = rng.range(0, E - 1);
  const int64_t variant = rng.range(0, 2);
  std::vector<int64_t> pool = all;
  if (k.routing == Routing::kPool) {
    rng.shuffle(pool);
    pool.resize(rng.range(1, E));
  } else if (k.routing == Routing::kOneRank) {
    const int64_t d = rng.range(0, R - 1);
    pool.clear();
    for (int64_t l = 0; l < EL; ++l) pool.push_back(d * EL + l);
  }
  p.idx.assign(R, {});
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < T[r]; ++t) {
      std::vector<int64_t> row(K, -1);
      switch (k.routing) {
        case Routing::kDistinct: row = distinct_from(all, K, rng); break;
        case Routing::kMasked:
          row = distinct_from(all, K, rng);
          for (auto& e : row)
            if (rng.chance(mask_p)) e = -1;
          if (rng.chance(0.1)) std::fill(row.begin(), row.end(), -1);
          break;
        case Routing::kDuplicates:
          row = with_replacement(all, K, rng);
          if (K >= 2 && rng.chance(0.6)) {
            const int64_t j = rng.range(1, K - 1);
            row[j] = row[rng.range(0, j - 1)];
          }
          for (auto& e : row)
            if (rng.chance(0.1)) e = -1;
          break;
        case Routing::kAllToOne:
          for (int64_t j = 0; j < K; ++j)
            row[j] = variant == 0 ? (j == 0 ? target : -1) : variant == 1 ? target : (rng.chance(0.5) ? target : -1);
          break;
        case Routing::kPool:
        case Routing::kOneRank:
          row = static_cast<int64_t>(pool.size()) >= K && rng.chance(0.7) ? distinct_from(pool, K, rng)
                                                                           : with_replacement(pool, K, rng);
          for (auto& e : row)
            if (rng.chance(0.2)) e = -1;
          break;
        case Routing::kAllMasked: break;
      }
      p.idx[r].insert(p.idx[r].end(), row.begin(), row.end());
    }
  }

  std::vector<int64_t> rows = rows_per_rank(c, p.idx);
  int64_t need = *std::max_element(rows.begin(), rows.end());
  if (k.kind == Kind::kCapacity && need < 2) {  // T[0] >= 2: two rows for expert 0
    p.idx[0][0] = 0;
    p.idx[0][K] = 0;
    rows = rows_per_rank(c, p.idx);
    need = *std::max_element(rows.begin(), rows.end());
  }

  // Weights: signed sometimes, unless a token lists an expert twice (its two rows nearly cancelling would
  // measure bf16 rounding against a tiny sum).
  bool duplicates = false;
  for (const auto& v : p.idx)
    for (size_t t = 0; t < v.size(); t += K)
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = i + 1; j < K; ++j)
          if (v[t + i] >= 0 && v[t + i] == v[t + j]) duplicates = true;
  const bool signed_weights = !duplicates && rng.chance(0.15);
  p.weights.assign(R, {});
  for (int r = 0; r < R; ++r) {
    p.weights[r].resize(T[r] * K);
    for (auto& w : p.weights[r])
      w = static_cast<float>(signed_weights ? 2.0 * rng.unit() - 1.0 : 0.05 + rng.unit());
  }

  // Token values (bf16-exact), as the layer test makes them.
  p.x.assign(R, {});
  p.d_out.assign(R, {});
  for (int r = 0; r < R; ++r) {
    p.x[r].resize(T[r] * H);
    p.d_out[r].resize(T[r] * H);
    for (int64_t i = 0; i < T[r] * H; ++i) {
      p.x[r][i] = kernels::hashed_bf16_value(p.seed_of(3 + 2 * r), static_cast<uint64_t>(i), 1.0f);
      p.d_out[r][i] = kernels::hashed_bf16_value(p.seed_of(4 + 2 * r), static_cast<uint64_t>(i), 1.0f);
    }
  }

  // Capacity.
  if (k.kind == Kind::kCapacity) {
    const int64_t capacity = rng.range(1, need - 1);
    k.options.expert_row_capacity = capacity;
    k.overflow_idx = p.idx;
    // The valid problem: slots masked, in random order, until every rank fits.
    std::vector<std::pair<int, int64_t>> slots;
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < static_cast<int64_t>(p.idx[r].size()); ++i) slots.emplace_back(r, i);
    rng.shuffle(slots);
    for (const auto& [r, i] : slots) {
      const int64_t e = p.idx[r][i];
      if (e >= 0 && rows[e / EL] > capacity) {
        --rows[e / EL];
        p.idx[r][i] = -1;
      }
    }
  } else {
    const int64_t default_capacity = c.num_ranks * c.max_tokens_per_rank * std::min(K, EL);
    if (need > default_capacity) {  // duplicates can need more than the default
      k.options.expert_row_capacity = need + (rng.chance(0.5) ? 0 : rng.range(1, 16));
    } else if (need > 0 && rng.chance(0.15)) {
      k.options.expert_row_capacity = need;  // exactly enough
    }
  }

  if (k.kind == Kind::kBadExpertId) {
    std::vector<int> with_tokens;
    for (int r = 0; r < R; ++r)
      if (T[r] > 0) with_tokens.push_back(r);
    k.bad_rank = with_tokens[rng.range(0, static_cast<int64_t>(with_tokens.size()) - 1)];
    k.bad_pos = rng.range(0, T[k.bad_rank] * K - 1);
    constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max(), kI32Min = std::numeric_limits<int32_t>::min();
    std::vector<int64_t> ids = {E, E + rng.range(1, 1000), -2, -rng.range(2, 1000), kI32Max, kI32Min};
    if (k.index_type == IndexType::kInt64) {
      const int64_t wrap = int64_t{1} << 32;  // truncated to int32, these are valid ids
      ids.insert(ids.end(), {wrap + rng.range(0, E - 1), -wrap + rng.range(0, E - 1), int64_t{1} << 31,
                             std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()});
    }
    k.bad_id = ids[rng.range(0, static_cast<int64_t>(ids.size()) - 1)];
  }
  set_routed(p);
  // The paths cycle with the seed (not drawn, so a seed's case is the same on either path): modular,
  // fused forward, fused backward, both fused.
  k.options.forward_path = (seed & 1) != 0 ? ForwardPath::kFused : ForwardPath::kModular;
  k.options.backward_path = (seed & 2) != 0 ? BackwardPath::kFused : BackwardPath::kModular;
  k.label = describe(k);
  return k;
}

// ---- running a case ----

// What an error message must name: prefix + number as a whole number ("id 8" must not match "id 80"),
// and plain words.
struct Cause {
  std::vector<std::pair<std::string, int64_t>> numbers;
  std::vector<std::string> words;
};

bool has_number(const std::string& message, const std::string& prefix, int64_t v) {
  const std::string w = prefix + std::to_string(v);
  for (size_t at = message.find(w); at != std::string::npos; at = message.find(w, at + 1)) {
    const size_t end = at + w.size();
    if (end == message.size() || !std::isdigit(static_cast<unsigned char>(message[end]))) return true;
  }
  return false;
}

struct Snapshot {  // every output of every rank, downloaded
  std::vector<std::vector<float>> out, d_x, d_weights, d_w13, d_w2;
};

struct Failures {
  std::vector<std::string> lines;
  int64_t count = 0;
  bool case_failed = false;
  const Case* current = nullptr;
  void add(const std::string& what) {
    ++count;
    case_failed = true;
    if (lines.size() < 1000) lines.push_back("seed " + std::to_string(current->seed) + " [" + current->label + "]: " + what);
  }
};

class CaseRun {
 public:
  CaseRun(const Case& k, Failures& f) : k_(k), f_(f), R_(static_cast<int>(k.p.config.num_ranks)) {}
  CaseRun(const CaseRun&) = delete;
  CaseRun& operator=(const CaseRun&) = delete;
  // A call that failed half-way may still run (ranks wait out their timeout): let it end before the
  // tensors and the group go.
  ~CaseRun() {
    if (group_) (void)cudaDeviceSynchronize();
  }

  bool create_group() {
    const Status s = VirtualRankGroup::create(k_.p.config, k_.options, &group_);
    if (!s.is_ok()) {
      f_.add("VirtualRankGroup::create: " + s.to_string());
      return false;
    }
    t_ = upload(k_.p);
    idx32_.resize(R_);
    for (int r = 0; r < R_; ++r) {
      idx32_[r] = DeviceBuffer<int32_t>(k_.p.idx[r].size());
      upload_idx(r, k_.p.idx[r]);
    }
    return true;
  }

  void upload_idx(int r, const std::vector<int64_t>& idx) {
    if (k_.index_type == IndexType::kInt64) {
      t_[r].idx.upload(idx);
    } else {
      std::vector<int32_t> v(idx.size());
      for (size_t i = 0; i < idx.size(); ++i) v[i] = static_cast<int32_t>(idx[i]);  // bad ids fit in int32 here
      idx32_[r].upload(v);
    }
  }

  ForwardArgs forward_args(int r) const {
    ForwardArgs f = forward_args_of(t_[r], tokens_of(k_.p, r));
    if (k_.index_type == IndexType::kInt32) f.topk_idx = idx32_[r].get();
    f.topk_idx_type = k_.index_type;
    return f;
  }

  BackwardArgs backward_args(int r) const { return backward_args_of(t_[r]); }

  ExpertParallelLayer& layer(int r) { return group_->layer(r); }

  // Every output of every rank set to the byte (0xFF: NaN; 0: zeros, so that a NaN must be written).
  bool fill_outputs(int byte) {
    for (int r = 0; r < R_; ++r) {
      const RankTensors& t = t_[r];
      if (!clear(t.out.get(), t.out.size() * sizeof(__nv_bfloat16), byte) ||
          !clear(t.d_x.get(), t.d_x.size() * sizeof(__nv_bfloat16), byte) ||
          !clear(t.d_weights.get(), t.d_weights.size() * sizeof(float), byte) ||
          !clear(t.d_w13.get(), t.d_w13.size() * sizeof(float), byte) ||
          !clear(t.d_w2.get(), t.d_w2.size() * sizeof(float), byte))
        return false;
    }
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) f_.add(std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(e));
    return e == cudaSuccess;
  }

  bool forward_all(const char* stage) {
    for (int r = 0; r < R_; ++r) {
      const Status s = layer(r).forward(forward_args(r));
      if (!s.is_ok()) {
        f_.add(std::string(stage) + ": forward of rank " + std::to_string(r) + " refused a valid call: " + s.to_string());
        return false;
      }
    }
    return true;
  }

  bool backward_all(const char* stage) {
    for (int r = 0; r < R_; ++r) {
      const Status s = layer(r).backward(backward_args(r));
      if (!s.is_ok()) {
        f_.add(std::string(stage) + ": backward of rank " + std::to_string(r) + " refused a valid call: " +
               s.to_string());
        return false;
      }
    }
    return true;
  }

  Snapshot download() const {
    Snapshot s;
    for (int r = 0; r < R_; ++r) {
      s.out.push_back(to_float(t_[r].out.download()));
      s.d_x.push_back(to_float(t_[r].d_x.download()));
      s.d_weights.push_back(t_[r].d_weights.download());
      s.d_w13.push_back(t_[r].d_w13.download());
      s.d_w2.push_back(t_[r].d_w2.download());
    }
    return s;
  }

  // A valid forward + backward on every rank, checked against the reference. `between` runs after the
  // forwards (a refused backward). Returns false when the call itself failed.
  bool valid_call(const Expected& e, const char* stage, Snapshot* got, double* worst,
                  const std::function<void()>& between = {}) {
    if (!fill_outputs(0xFF)) return false;
    if (!forward_all(stage)) return false;
    if (between) between();
    if (!backward_all(stage)) return false;
    const Status s = group_->synchronize_and_check();
    if (!s.is_ok()) {
      f_.add(std::string(stage) + ": synchronize_and_check after a valid call: " + s.to_string());
      return false;
    }
    *got = download();
    compare(e, *got, stage, worst);
    return true;
  }

  // Every rank reports the error: its code, and a message that names the cause.
  void expect_error_everywhere(StatusCode code, const Cause& cause, const char* stage) {
    for (int r = 0; r < R_; ++r) {
      const Status s = layer(r).synchronize_and_check();
      const std::string where = std::string(stage) + ": rank " + std::to_string(r) + " ";
      if (s.code() != code) {
        f_.add(where + "reported '" + s.to_string() + "', expected code '" + status_code_name(code) + "'");
        continue;
      }
      if (s.message().empty()) f_.add(where + "reported an empty message");
      for (const std::string& w : cause.words)
        if (s.message().find(w) == std::string::npos) f_.add(where + "message '" + s.message() + "' lacks '" + w + "'");
      for (const auto& [prefix, v] : cause.numbers)
        if (!has_number(s.message(), prefix, v))
          f_.add(where + "message '" + s.message() + "' lacks '" + prefix + std::to_string(v) + "'");
    }
  }

  // Every output of every rank must be NaN (they were zero before the call).
  void expect_all_nan(bool gradients, const char* stage) {
    const Snapshot s = download();
    for (int r = 0; r < R_; ++r) {
      const std::string where = std::string(stage) + ": rank " + std::to_string(r) + " ";
      check_nan(s.out[r], where + "out");
      if (!gradients) continue;
      check_nan(s.d_x[r], where + "d_x");
      check_nan(s.d_weights[r], where + "d_topk_weights");
      check_nan(s.d_w13[r], where + "d_w13");
      check_nan(s.d_w2[r], where + "d_w2");
    }
  }

  void compare(const Expected& e, const Snapshot& got, const char* stage, double* worst);

 private:
  bool clear(void* p, size_t bytes, int byte) {
    if (bytes == 0) return true;
    const cudaError_t err = cudaMemset(p, byte, bytes);
    if (err != cudaSuccess) f_.add(std::string("cudaMemset: ") + cudaGetErrorString(err));
    return err == cudaSuccess;
  }

  void check_nan(const std::vector<float>& v, const std::string& what) {
    int64_t numbers = 0;
    for (float x : v)
      if (!std::isnan(x)) ++numbers;
    if (numbers > 0)
      f_.add(what + ": " + std::to_string(numbers) + " of " + std::to_string(v.size()) +
             " values are numbers after a failed call (must all be NaN)");
  }

  const Case& k_;
  Failures& f_;
  int R_;
  std::unique_ptr<VirtualRankGroup> group_;
  std::vector<RankTensors> t_;
  std::vector<DeviceBuffer<int32_t>> idx32_;
  testing::ep_problem::DotProductScales dot_scales_{k_.p};
};

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3e", v);
  return buf;
}

void CaseRun::compare(const Expected& e, const Snapshot& got, const char* stage, double* worst) {
  const Problem& p = k_.p;
  const LayerConfig& c = p.config;
  const int64_t H = c.hidden, K = c.top_k, EL = c.experts_per_rank();
  auto check = [&](const std::vector<float>& g, const std::vector<float>& w, const std::string& what) {
    int64_t nans = 0;
    const double err = relative_error(g, w, &nans);
    if (nans > 0) f_.add(what + ": " + std::to_string(nans) + " NaN");
    if (!(err <= kTolerance)) f_.add(what + ": relative error " + fmt(err) + " > " + fmt(kTolerance));
    if (err > *worst) *worst = err;
  };
  for (int r = 0; r < R_; ++r) {
    const std::string where = std::string(stage) + ": rank " + std::to_string(r) + " ";
    const int64_t T = tokens_of(p, r);
    const std::vector<int64_t>& idx = p.idx[r];
    check(got.out[r], e.out[r], where + "out");
    check(got.d_x[r], e.d_x[r], where + "d_x");
    // A fully masked token: out and d_x rows exactly 0.
    for (int64_t t = 0; t < T; ++t) {
      bool masked = true;
      for (int64_t j = 0; j < K; ++j) masked = masked && idx[t * K + j] < 0;
      if (!masked) continue;
      for (int64_t h = 0; h < H; ++h) {
        if (got.out[r][t * H + h] != 0.0f || got.d_x[r][t * H + h] != 0.0f) {
          f_.add(where + "token " + std::to_string(t) + " is fully masked but its out / d_x row is not 0");
          break;
        }
      }
    }
    // d_topk_weights: a masked slot exactly 0; the routed ones as a tensor, or one by one when few.
    int64_t routed_slots = 0, nans = 0;
    for (int64_t i = 0; i < T * K; ++i) {
      if (std::isnan(got.d_weights[r][i])) ++nans;
      if (idx[i] >= 0) {
        ++routed_slots;
      } else if (got.d_weights[r][i] != 0.0f) {
        f_.add(where + "d_topk_weights[" + std::to_string(i / K) + ", " + std::to_string(i % K) +
               "] of a masked slot is " + fmt(got.d_weights[r][i]) + ", not 0");
      }
    }
    if (routed_slots >= kMinSlotsForNorm) {
      check(got.d_weights[r], e.d_weights[r], where + "d_topk_weights");
    } else {
      if (nans > 0) f_.add(where + "d_topk_weights: " + std::to_string(nans) + " NaN");
      for (const std::string& entry : dot_scales_.entries_beyond_scale(r, got.d_weights[r], e.d_weights[r], kTolerance))
        f_.add(where + "d_topk_weights" + entry);
    }
    // Weight gradients of every local expert: the routed ones against the reference, the others 0.
    const int64_t n13 = 2 * c.intermediate * H, n2 = H * c.intermediate;
    for (int64_t l = 0; l < EL; ++l) {
      const int64_t expert = r * EL + l;
      const std::vector<float> g13(got.d_w13[r].begin() + l * n13, got.d_w13[r].begin() + (l + 1) * n13);
      const std::vector<float> g2(got.d_w2[r].begin() + l * n2, got.d_w2[r].begin() + (l + 1) * n2);
      const std::string name = std::string(stage) + ": expert " + std::to_string(expert) + " ";
      auto found = e.d_w13.find(expert);
      if (found != e.d_w13.end()) {
        check(g13, found->second, name + "d_w13");
        check(g2, e.d_w2.at(expert), name + "d_w2");
      } else {
        const bool zero13 = std::all_of(g13.begin(), g13.end(), [](float v) { return v == 0.0f; });
        const bool zero2 = std::all_of(g2.begin(), g2.end(), [](float v) { return v == 0.0f; });
        if (!zero13 || !zero2) f_.add(name + "has no routed row but its d_w13 / d_w2 are not all 0");
      }
    }
  }
}

template <typename T>
T* shifted(T* p, int64_t bytes) {  // a pointer `bytes` past p, whatever its alignment (never dereferenced)
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes));
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  for (size_t r = 0; r < a.size(); ++r)
    if (a[r].size() != b[r].size() || std::memcmp(a[r].data(), b[r].data(), a[r].size() * sizeof(float)) != 0)
      return false;
  return true;
}

// The forward arguments of the refusal (kinds that are refused by forward()).
ForwardArgs refused_forward(const Case& k, ForwardArgs f, std::string* field) {
  const int64_t m = k.refusal_amount;  // 1..7
  switch (k.refusal) {
    case Refusal::kTooManyTokens:
      f.num_tokens = m == 7 ? std::numeric_limits<int64_t>::max() : k.p.config.max_tokens_per_rank + m * m * 13 - 12;
      *field = "num_tokens";
      break;
    case Refusal::kNegativeTokens:
      f.num_tokens = m == 7 ? std::numeric_limits<int64_t>::min() : -m;
      *field = "num_tokens";
      break;
    case Refusal::kNullWeights:
      if (k.refusal_field % 2 == 0) {
        f.w13 = nullptr;
        *field = "w13";
      } else {
        f.w2 = nullptr;
        *field = "w2";
      }
      break;
    case Refusal::kNullTokenTensor:
      switch (k.refusal_field % 4) {
        case 0: f.x = nullptr; *field = "x"; break;
        case 1: f.topk_idx = nullptr; *field = "topk_idx"; break;
        case 2: f.topk_weights = nullptr; *field = "topk_weights"; break;
        default: f.out = nullptr; *field = "out"; break;
      }
      break;
    case Refusal::kMisalignedForward:
      switch (k.refusal_field) {
        case 0: f.x = shifted(f.x, 2 * m); *field = "x"; break;
        case 1: f.out = shifted(f.out, 2 * m); *field = "out"; break;
        case 2: f.w13 = shifted(f.w13, 2 * m); *field = "w13"; break;
        case 3: f.w2 = shifted(f.w2, 2 * m); *field = "w2"; break;
        case 4: f.topk_weights = shifted(f.topk_weights, 1 + m % 3); *field = "topk_weights"; break;
        default: {
          const int64_t element = k.index_type == IndexType::kInt64 ? 8 : 4;
          f.topk_idx = shifted(static_cast<const char*>(f.topk_idx), 1 + (m - 1) % (element - 1));
          *field = "topk_idx";
          break;
        }
      }
      break;
    default: break;
  }
  return f;
}

BackwardArgs refused_backward(const Case& k, BackwardArgs b, std::string* field) {
  const int64_t m = k.refusal_amount;  // 1..7
  if (k.refusal == Refusal::kMisalignedBackward) {
    switch (k.refusal_field) {
      case 0: b.d_out = shifted(b.d_out, 2 * m); *field = "d_out"; break;
      case 1: b.d_x = shifted(b.d_x, 2 * m); *field = "d_x"; break;
      case 2: b.d_w13 = shifted(b.d_w13, 4 * (1 + m % 3)); *field = "d_w13"; break;
      case 3: b.d_w2 = shifted(b.d_w2, 4 * (1 + m % 3)); *field = "d_w2"; break;
      default: b.d_topk_weights = shifted(b.d_topk_weights, 1 + m % 3); *field = "d_topk_weights"; break;
    }
  } else if (k.refusal == Refusal::kNullBackward) {
    switch (k.refusal_field) {
      case 0: b.d_w13 = nullptr; *field = "d_w13"; break;
      case 1: b.d_w2 = nullptr; *field = "d_w2"; break;
      case 2: b.d_out = nullptr; *field = "d_out"; break;
      case 3: b.d_x = nullptr; *field = "d_x"; break;
      default: b.d_topk_weights = nullptr; *field = "d_topk_weights"; break;
    }
  }
  return b;
}

// The message names the field as a word of its own ("x", not the x of "expert").
bool names_word(const std::string& message, const std::string& word) {
  auto ident = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t at = message.find(word); at != std::string::npos; at = message.find(word, at + 1)) {
    const bool left = at == 0 || !ident(message[at - 1]);
    const bool right = at + word.size() == message.size() || !ident(message[at + word.size()]);
    if (left && right) return true;
  }
  return false;
}

void expect_refused(const Status& s, const std::string& field, const char* call, Failures& f) {
  if (s.code() != StatusCode::kInvalidArgument) {
    f.add(std::string(call) + " returned '" + s.to_string() + "', expected a refusal (invalid argument)");
    return;
  }
  if (s.message().empty()) f.add(std::string(call) + " refused with an empty message");
  else if (!names_word(s.message(), field))
    f.add(std::string(call) + " refusal '" + s.message() + "' does not name '" + field + "'");
}

void run_case(const Case& k, Failures& f, double* reference_seconds, double* worst) {
  CaseRun run(k, f);
  if (!run.create_group()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const Expected e = run_reference(k.p);
  *reference_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int R = static_cast<int>(k.p.config.num_ranks);
  Snapshot first, second;

  switch (k.kind) {
    case Kind::kValid:
      if (!run.valid_call(e, "valid call", &first, worst)) return;
      if (k.repeat) {
        if (!run.valid_call(e, "repeated call", &second, worst)) return;
        if (!same_bits(first.out, second.out) || !same_bits(first.d_x, second.d_x) ||
            !same_bits(first.d_weights, second.d_weights) || !same_bits(first.d_w13, second.d_w13) ||
            !same_bits(first.d_w2, second.d_w2))
          f.add("a repeated call gave different bits");
      }
      return;

    case Kind::kBadExpertId:
    case Kind::kCapacity: {
      const bool bad_id = k.kind == Kind::kBadExpertId;
      const char* stage = bad_id ? "bad expert id" : "capacity exceeded";
      if (bad_id) {
        std::vector<int64_t> idx = k.p.idx[k.bad_rank];
        idx[k.bad_pos] = k.bad_id;
        run.upload_idx(k.bad_rank, idx);
      } else {
        for (int r = 0; r < R; ++r) run.upload_idx(r, k.overflow_idx[r]);
      }
      const StatusCode code = bad_id ? StatusCode::kInvalidArgument : StatusCode::kCapacityExceeded;
      Cause cause;
      if (bad_id) {
        cause.numbers = {{"expert id ", k.bad_id}, {"token ", k.bad_pos / k.p.config.top_k}, {"rank ", k.bad_rank}};
      } else {
        cause.numbers = {{"capacity is ", k.options.expert_row_capacity}};
      }
      if (!run.fill_outputs(0)) return;
      if (!run.forward_all(stage)) return;
      if (k.check_between) {
        run.expect_error_everywhere(code, cause, bad_id ? "bad expert id, forward" : "capacity exceeded, forward");
        run.expect_all_nan(false, stage);
      }
      if (!run.backward_all(stage)) return;
      if (k.check_between) {
        run.expect_error_everywhere(StatusCode::kInvalidArgument, Cause{{}, {"forward that failed"}},
                                    bad_id ? "bad expert id, backward" : "capacity exceeded, backward");
      } else {
        run.expect_error_everywhere(code, cause, stage);
      }
      run.expect_all_nan(true, stage);
      for (int r = 0; r < R; ++r) run.upload_idx(r, k.p.idx[r]);
      run.valid_call(e, bad_id ? "valid call after a bad expert id" : "valid call after capacity exceeded", &first,
                     worst);
      return;
    }

    case Kind::kRefusal: {
      const int rr = k.refusal_rank;
      std::string field;
      switch (k.refusal) {
        case Refusal::kBackwardBeforeForward:
          expect_refused(run.layer(rr).backward(run.backward_args(rr)), "forward", "backward before any forward", f);
          run.valid_call(e, "valid call after a refused backward", &first, worst);
          return;
        case Refusal::kMisalignedBackward:
        case Refusal::kNullBackward:
          run.valid_call(e, "valid call around a refused backward", &first, worst, [&] {
            const BackwardArgs b = refused_backward(k, run.backward_args(rr), &field);
            expect_refused(run.layer(rr).backward(b), field, "backward", f);
          });
          return;
        default: {
          const ForwardArgs fa = refused_forward(k, run.forward_args(rr), &field);
          expect_refused(run.layer(rr).forward(fa), field, "forward", f);
          run.valid_call(e, "valid call after a refused forward", &first, worst);
          return;
        }
      }
    }
  }
}

bool read_env(const char* name, uint64_t fallback, uint64_t* value, std::string* error) {
  const char* text = std::getenv(name);
  *value = fallback;
  if (text == nullptr || *text == '\0') return true;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || !std::isdigit(static_cast<unsigned char>(text[0])) || *end != '\0') {
    *error = std::string(name) + " must be a non-negative integer, got '" + text + "'";
    return false;
  }
  *value = v;
  return true;
}

TEST(EpLayerFuzzTest, RandomCasesMatchReference) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  uint64_t cases = 0, first_seed = 0;
  std::string error;
  ASSERT_TRUE(read_env("MEGAMOE_FUZZ_CASES", 40, &cases, &error)) << error;
  ASSERT_TRUE(read_env("MEGAMOE_FUZZ_SEED", 1, &first_seed, &error)) << error;
  ASSERT_GE(cases, 1u) << "MEGAMOE_FUZZ_CASES must be at least 1";

  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  Failures f;
  int64_t per_kind[4] = {0, 0, 0, 0};
  int64_t failed_cases = 0;
  double reference_seconds = 0, worst = 0;
  for (uint64_t i = 0; i < cases; ++i) {
    const Case k = draw_case(first_seed + i);
    f.current = &k;
    f.case_failed = false;
    SCOPED_TRACE("fuzz seed " + std::to_string(k.seed) + " [" + k.label + "]");
    ++per_kind[static_cast<int>(k.kind)];
    run_case(k, f, &reference_seconds, &worst);
    if (f.case_failed) ++failed_cases;
    f.current = nullptr;
    if ((i + 1) % 100 == 0) {
      std::printf("[ fuzz ] %llu / %llu cases, %lld failing, %.1f s\n", static_cast<unsigned long long>(i + 1),
                  static_cast<unsigned long long>(cases), static_cast<long long>(failed_cases), seconds());
      std::fflush(stdout);
    }
  }
  std::printf(
      "[ fuzz ] %llu cases, seeds %llu..%llu: %lld valid, %lld bad input (%lld bad id, %lld capacity, %lld "
      "refused); %lld failing cases, %lld mismatches; worst relative error %.3e; %.1f s (reference %.1f s)\n",
      static_cast<unsigned long long>(cases), static_cast<unsigned long long>(first_seed),
      static_cast<unsigned long long>(first_seed + cases - 1), static_cast<long long>(per_kind[0]),
      static_cast<long long>(per_kind[1] + per_kind[2] + per_kind[3]), static_cast<long long>(per_kind[1]),
      static_cast<long long>(per_kind[2]), static_cast<long long>(per_kind[3]), static_cast<long long>(failed_cases),
      static_cast<long long>(f.count), worst, seconds(), reference_seconds);
  std::fflush(stdout);
  if (f.count > 0) {
    std::string list;
    for (size_t i = 0; i < std::min(kMaxListed, f.lines.size()); ++i) list += "\n  " + f.lines[i];
    ADD_FAILURE() << f.count << " mismatches in " << failed_cases << " of " << cases
                  << " cases (rerun one with MEGAMOE_FUZZ_SEED=<seed> MEGAMOE_FUZZ_CASES=1); the first "
                  << std::min(kMaxListed, f.lines.size()) << ":" << list;
  }
}

}  // namespace
}  // namespace megamoe
