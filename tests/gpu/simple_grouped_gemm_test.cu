// The WMMA grouped GEMM against a double-precision CPU reference built from the same bf16 inputs, in the three
// MoE forms (forward with K-major weights, activation gradients with N-major weights, K-grouped weight
// gradients) plus the epilogue options, ragged shapes, odd leading dimensions and argument errors.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/simple_grouped_gemm.hpp"

namespace megamoe {
namespace {

using kernels::GemmOperand;
using kernels::GroupedGemmArgs;
using kernels::GroupMode;
using kernels::OutputType;
using testing::DeviceBuffer;

constexpr double kTolerance = 1e-2;

struct Case {
  GroupMode mode = GroupMode::kM;
  std::vector<int32_t> sizes;  // rows per group
  int64_t m = 0;               // K-grouped only
  int64_t n = 0;
  int64_t k = 0;  // M-grouped only
  bool a_contiguous_in_j = true;
  int64_t a_ld_extra = 0;
  bool b_contiguous_in_j = false;
  int64_t b_ld_extra = 0;
  int64_t b_group_stride_extra = 0;  // M-grouped only
  OutputType output = OutputType::kBF16;
  int64_t ldc_extra = 0;
  int64_t c_group_stride_extra = 0;  // K-grouped only
  bool accumulate = false;
  bool row_scale = false;
  bool row_destinations = false;
  int max_blocks = 0;
};

bool is_poison_bf16(__nv_bfloat16 v) {
  uint16_t bits = 0;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits == 0xFFFFu;
}
bool is_poison_f32(float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits == 0xFFFFFFFFu;
}

// Random bf16 values (normal), with their exact float values.
void random_bf16(std::mt19937& rng, size_t count, std::vector<__nv_bfloat16>& bf16, std::vector<float>& values) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  bf16.resize(count);
  values.resize(count);
  for (size_t i = 0; i < count; ++i) {
    bf16[i] = __float2bfloat16(normal(rng));
    values[i] = __bfloat162float(bf16[i]);
  }
}

// Runs one case on the GPU and compares with the CPU reference. Every written output is checked; every
// output element the kernel must not touch (ldc padding, dropped destination rows) must stay poisoned.
void run_case(const Case& cs, uint32_t seed) {
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const bool k_mode = cs.mode == GroupMode::kK;
  const int groups = static_cast<int>(cs.sizes.size());
  std::vector<int32_t> offsets(groups + 1, 0);
  for (int g = 0; g < groups; ++g) offsets[g + 1] = offsets[g] + cs.sizes[g];
  const int64_t rows = offsets[groups];
  const int64_t n = cs.n;
  // Logical extents of A (i=m, j=k) and B (i=k, j=n); in K-grouped mode the k extent is the row count.
  const int64_t a_i = k_mode ? cs.m : rows;
  const int64_t a_j = k_mode ? rows : cs.k;
  const int64_t b_i = a_j;
  const int64_t b_j = n;

  // A (one matrix; offsets applied through the row index).
  const int64_t lda = (cs.a_contiguous_in_j ? a_j : a_i) + cs.a_ld_extra;
  const int64_t a_count = (cs.a_contiguous_in_j ? a_i : a_j) * lda;
  std::vector<__nv_bfloat16> a_bf16;
  std::vector<float> a_val;
  random_bf16(rng, static_cast<size_t>(a_count), a_bf16, a_val);
  auto a_at = [&](int64_t i, int64_t j) { return a_val[cs.a_contiguous_in_j ? i * lda + j : j * lda + i]; };

  // B: one matrix per group in M-grouped mode, a single row-indexed one in K-grouped mode.
  const int64_t ldb = (cs.b_contiguous_in_j ? b_j : b_i) + cs.b_ld_extra;
  const int64_t b_matrix = (cs.b_contiguous_in_j ? b_i : b_j) * ldb;
  const int64_t b_group_stride = k_mode ? 0 : b_matrix + cs.b_group_stride_extra;
  const int64_t b_count = k_mode ? b_matrix : b_group_stride * groups;
  std::vector<__nv_bfloat16> b_bf16;
  std::vector<float> b_val;
  random_bf16(rng, static_cast<size_t>(b_count), b_bf16, b_val);
  auto b_at = [&](int g, int64_t i, int64_t j) {
    return b_val[g * b_group_stride + (cs.b_contiguous_in_j ? i * ldb + j : j * ldb + i)];
  };

  // Output layout: C rows (M-grouped: `rows` rows; K-grouped: m rows per group) of ldc elements.
  const int64_t ldc = n + cs.ldc_extra;
  const int64_t c_group_stride = k_mode ? cs.m * ldc + cs.c_group_stride_extra : 0;
  const int64_t c_count = k_mode ? c_group_stride * groups : rows * ldc;
  const bool fp32 = cs.output == OutputType::kFP32;

  std::vector<float> scale;
  if (cs.row_scale) {
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    scale.resize(rows);
    for (auto& s : scale) s = u(rng);
  }
  // Destinations: row r goes to row perm[r] of a separate buffer of rows + 5 rows; every 5th row is dropped.
  const int64_t dst_rows = rows + 5;
  std::vector<int64_t> dst_row(rows, -1);
  if (cs.row_destinations) {
    std::vector<int64_t> perm(dst_rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t r = 0; r < rows; ++r) dst_row[r] = r % 5 == 3 ? -1 : perm[r];
  }

  // Preset C for accumulate (random finite values), else poison.
  std::vector<float> c_preset;
  if (cs.accumulate) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    c_preset.resize(c_count);
    for (auto& v : c_preset) v = normal(rng);
  }

  // ---- CPU reference, in double ----
  // ref[g][i][j] for K-grouped (i < m), ref[r][j] for M-grouped.
  std::vector<double> ref(static_cast<size_t>(k_mode ? groups * cs.m * n : rows * n), 0.0);
  if (k_mode) {
    std::vector<double> bd(static_cast<size_t>(n));
    for (int g = 0; g < groups; ++g) {
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
        for (int64_t j = 0; j < n; ++j) bd[j] = b_at(0, r, j);
        for (int64_t i = 0; i < cs.m; ++i) {
          const double a = a_at(i, r);
          double* out = &ref[(g * cs.m + i) * n];
          for (int64_t j = 0; j < n; ++j) out[j] += a * bd[j];
        }
      }
    }
  } else {
    std::vector<double> bd(static_cast<size_t>(cs.k * n));
    for (int g = 0; g < groups; ++g) {
      for (int64_t kk = 0; kk < cs.k; ++kk)
        for (int64_t j = 0; j < n; ++j) bd[kk * n + j] = b_at(g, kk, j);
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
        double* out = &ref[r * n];
        for (int64_t kk = 0; kk < cs.k; ++kk) {
          const double a = a_at(r, kk);
          const double* brow = &bd[kk * n];
          for (int64_t j = 0; j < n; ++j) out[j] += a * brow[j];
        }
        if (cs.row_scale)
          for (int64_t j = 0; j < n; ++j) out[j] *= scale[r];
      }
    }
  }

  // ---- GPU ----
  DeviceBuffer<int32_t> d_offsets(offsets.size());
  DeviceBuffer<__nv_bfloat16> d_a(a_bf16.size());
  DeviceBuffer<__nv_bfloat16> d_b(b_bf16.size());
  d_offsets.upload(offsets);
  d_a.upload(a_bf16);
  d_b.upload(b_bf16);
  const size_t elem = fp32 ? 4 : 2;
  const bool use_c = !cs.row_destinations;
  DeviceBuffer<unsigned char> d_c(use_c ? static_cast<size_t>(c_count) * elem : 0);
  if (cs.accumulate) {
    std::vector<unsigned char> bytes(c_preset.size() * sizeof(float));
    std::memcpy(bytes.data(), c_preset.data(), bytes.size());
    d_c.upload(bytes);
  }
  DeviceBuffer<float> d_scale(scale.size());
  if (cs.row_scale) d_scale.upload(scale);
  DeviceBuffer<unsigned char> d_dst(cs.row_destinations ? static_cast<size_t>(dst_rows * n) * elem : 0);
  DeviceBuffer<void*> d_dst_ptrs(cs.row_destinations ? static_cast<size_t>(rows) : 0);
  if (cs.row_destinations) {
    std::vector<void*> ptrs(rows);
    for (int64_t r = 0; r < rows; ++r)
      ptrs[r] = dst_row[r] < 0 ? nullptr : static_cast<void*>(d_dst.get() + dst_row[r] * n * elem);
    d_dst_ptrs.upload(ptrs);
  }

  GroupedGemmArgs args;
  args.mode = cs.mode;
  args.num_groups = groups;
  args.group_offsets = d_offsets.get();
  args.m = cs.m;
  args.n = n;
  args.k = cs.k;
  args.a = GemmOperand{d_a.get(), lda, cs.a_contiguous_in_j, 0};
  args.b = GemmOperand{d_b.get(), ldb, cs.b_contiguous_in_j, b_group_stride};
  args.c = use_c ? static_cast<void*>(d_c.get()) : nullptr;
  args.ldc = ldc;
  args.c_group_stride = c_group_stride;
  args.output = cs.output;
  args.accumulate = cs.accumulate;
  args.row_scale = cs.row_scale ? d_scale.get() : nullptr;
  args.row_destinations = cs.row_destinations ? d_dst_ptrs.get() : nullptr;
  const Status status = kernels::simple_grouped_gemm(args, nullptr, cs.max_blocks);
  ASSERT_TRUE(status.is_ok()) << status.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());

  // ---- compare ----
  const std::vector<unsigned char> out_bytes = use_c ? d_c.download() : d_dst.download();
  auto value_at = [&](int64_t index) -> double {
    if (fp32) {
      float v;
      std::memcpy(&v, &out_bytes[index * 4], 4);
      return v;
    }
    __nv_bfloat16 v;
    std::memcpy(&v, &out_bytes[index * 2], 2);
    return __bfloat162float(v);
  };
  auto poisoned_at = [&](int64_t index) {
    if (fp32) {
      float v;
      std::memcpy(&v, &out_bytes[index * 4], 4);
      return is_poison_f32(v);
    }
    __nv_bfloat16 v;
    std::memcpy(&v, &out_bytes[index * 2], 2);
    return is_poison_bf16(v);
  };

  double err2 = 0.0;
  double ref2 = 0.0;
  int64_t nan_count = 0;
  int64_t checked = 0;
  int64_t touched_padding = 0;
  auto check = [&](int64_t index, double expect) {
    const double got = value_at(index);
    if (std::isnan(got)) {
      ++nan_count;
      return;
    }
    err2 += (got - expect) * (got - expect);
    ref2 += expect * expect;
    ++checked;
  };
  if (k_mode) {
    for (int g = 0; g < groups; ++g)
      for (int64_t i = 0; i < cs.m; ++i)
        for (int64_t j = 0; j < ldc; ++j) {
          const int64_t index = g * c_group_stride + i * ldc + j;
          if (j < n) {
            const double base = cs.accumulate ? c_preset[index] : 0.0;
            check(index, base + ref[(g * cs.m + i) * n + j]);
          } else if (cs.accumulate ? value_at(index) != c_preset[index] : !poisoned_at(index)) {
            ++touched_padding;
          }
        }
  } else if (use_c) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < ldc; ++j) {
        if (j < n) {
          check(r * ldc + j, ref[r * n + j]);
        } else if (!poisoned_at(r * ldc + j)) {
          ++touched_padding;
        }
      }
  } else {
    std::vector<bool> target(dst_rows, false);
    for (int64_t r = 0; r < rows; ++r) {
      if (dst_row[r] < 0) continue;
      target[dst_row[r]] = true;
      for (int64_t j = 0; j < n; ++j) check(dst_row[r] * n + j, ref[r * n + j]);
    }
    for (int64_t d = 0; d < dst_rows; ++d)
      if (!target[d])
        for (int64_t j = 0; j < n; ++j) touched_padding += !poisoned_at(d * n + j);
  }
  EXPECT_EQ(nan_count, 0) << "unwritten or NaN outputs";
  EXPECT_EQ(touched_padding, 0) << "elements outside the output were written";
  ASSERT_GT(checked, 0);
  ASSERT_GT(ref2, 0.0);
  const double rel = std::sqrt(err2 / ref2);
  EXPECT_LE(rel, kTolerance) << "relative error " << rel;
}

uint32_t fresh_seed() { return std::random_device{}(); }

// Group sizes in [0, max_rows], with group 1 empty and group 3 an odd, non-multiple of 128 size.
std::vector<int32_t> random_sizes(uint32_t seed, int groups, int max_rows) {
  std::mt19937 rng(seed ^ 0x9e3779b9u);
  std::uniform_int_distribution<int> u(0, max_rows);
  std::vector<int32_t> sizes(groups);
  for (auto& s : sizes) s = u(rng);
  if (groups > 1) sizes[1] = 0;
  if (groups > 3) sizes[3] = 129 < max_rows ? 129 : max_rows | 1;
  return sizes;
}

// Forward form: y = x · W[e]^T with W[e] [N, K] (B(k, n) = W[n][k], K-major).
TEST(SimpleGroupedGemmTest, MGroupedKMajorWeight) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (OutputType output : {OutputType::kBF16, OutputType::kFP32}) {
    const uint32_t seed = fresh_seed();
    Case cs;
    cs.sizes = random_sizes(seed, 7, 300);
    cs.n = 384;
    cs.k = 256;
    cs.b_contiguous_in_j = false;
    cs.output = output;
    run_case(cs, seed);
  }
}

TEST(SimpleGroupedGemmTest, MGroupedRowScale) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  Case cs;
  cs.sizes = random_sizes(seed, 7, 300);
  cs.n = 256;
  cs.k = 128;
  cs.output = OutputType::kFP32;
  cs.row_scale = true;
  run_case(cs, seed);
}

// Scatter to a permuted set of rows of another buffer; dropped rows (nullptr) and untargeted rows stay poisoned.
TEST(SimpleGroupedGemmTest, MGroupedRowDestinationsWithScale) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (OutputType output : {OutputType::kBF16, OutputType::kFP32}) {
    const uint32_t seed = fresh_seed();
    Case cs;
    cs.sizes = random_sizes(seed, 7, 300);
    cs.n = 384;
    cs.k = 128;
    cs.output = output;
    cs.row_scale = true;
    cs.row_destinations = true;
    run_case(cs, seed);
  }
}

// Activation-gradient form: dA = dY · W[e] with W[e] [K, N] read N-major.
TEST(SimpleGroupedGemmTest, MGroupedNMajorWeight) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  Case cs;
  cs.sizes = random_sizes(seed, 6, 300);
  cs.n = 256;
  cs.k = 384;
  cs.b_contiguous_in_j = true;
  run_case(cs, seed);
}

// n, k not multiples of the tile, leading dimensions that break 16-byte alignment (scalar loads), ldc padding
// that must stay untouched, and both layouts of A and B.
TEST(SimpleGroupedGemmTest, MGroupedRaggedShapesAndOddLeadingDims) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (int layout = 0; layout < 4; ++layout) {
    const uint32_t seed = fresh_seed();
    SCOPED_TRACE("layout=" + std::to_string(layout));
    Case cs;
    cs.sizes = random_sizes(seed, 5, 200);
    cs.n = 130;
    cs.k = 70;
    cs.a_contiguous_in_j = (layout & 1) != 0;
    cs.a_ld_extra = 5;
    cs.b_contiguous_in_j = (layout & 2) != 0;
    cs.b_ld_extra = 3;
    cs.b_group_stride_extra = 1;
    cs.output = layout % 2 == 0 ? OutputType::kFP32 : OutputType::kBF16;
    cs.ldc_extra = 3;
    run_case(cs, seed);
  }
}

// Hundreds of groups (the device-side tile prefix spans several chunks) on a few persistent blocks.
TEST(SimpleGroupedGemmTest, MGroupedManyGroupsFewBlocks) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  Case cs;
  cs.sizes = random_sizes(seed, 600, 24);
  for (int g = 100; g < 140; ++g) cs.sizes[g] = 0;  // a run of empty groups
  cs.n = 136;
  cs.k = 64;
  cs.max_blocks = 3;
  run_case(cs, seed);
}

// Weight-gradient form: dW[e] = dY_e^T · X_e, a reduction over the rows of each group; A [rows, M] (contiguous
// along m), B [rows, N]; C_g [M, N]. Includes an empty group (C_g = 0) and ragged group sizes.
TEST(SimpleGroupedGemmTest, KGrouped) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (OutputType output : {OutputType::kFP32, OutputType::kBF16}) {
    const uint32_t seed = fresh_seed();
    Case cs;
    cs.mode = GroupMode::kK;
    cs.sizes = random_sizes(seed, 5, 300);
    cs.m = 192;
    cs.n = 256;
    cs.a_contiguous_in_j = false;
    cs.b_contiguous_in_j = true;
    cs.output = output;
    run_case(cs, seed);
  }
}

TEST(SimpleGroupedGemmTest, KGroupedAccumulate) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  Case cs;
  cs.mode = GroupMode::kK;
  cs.sizes = random_sizes(seed, 5, 300);
  cs.m = 192;
  cs.n = 256;
  cs.a_contiguous_in_j = false;
  cs.b_contiguous_in_j = true;
  cs.output = OutputType::kFP32;
  cs.accumulate = true;
  cs.max_blocks = 4;
  run_case(cs, seed);
}

// Ragged m and n, odd leading dimensions and C_g stride, the other operand layouts.
TEST(SimpleGroupedGemmTest, KGroupedRaggedShapesAndOddLeadingDims) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (int layout = 0; layout < 4; ++layout) {
    const uint32_t seed = fresh_seed();
    SCOPED_TRACE("layout=" + std::to_string(layout));
    Case cs;
    cs.mode = GroupMode::kK;
    cs.sizes = random_sizes(seed, 4, 150);
    cs.m = 70;
    cs.n = 140;
    cs.a_contiguous_in_j = (layout & 1) != 0;
    cs.a_ld_extra = 3;
    cs.b_contiguous_in_j = (layout & 2) != 0;
    cs.b_ld_extra = 1;
    cs.output = OutputType::kFP32;
    cs.ldc_extra = 5;
    cs.c_group_stride_extra = 7;
    run_case(cs, seed);
  }
}

TEST(SimpleGroupedGemmTest, ArgumentErrors) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<int32_t> offsets(3);
  offsets.upload({0, 16, 32});
  DeviceBuffer<__nv_bfloat16> a(32 * 64);
  DeviceBuffer<__nv_bfloat16> b(2 * 64 * 64);
  DeviceBuffer<float> c(2 * 64 * 64);
  DeviceBuffer<float> scale(32);
  DeviceBuffer<void*> destinations(32);

  GroupedGemmArgs base;
  base.mode = GroupMode::kM;
  base.num_groups = 2;
  base.group_offsets = offsets.get();
  base.n = 64;
  base.k = 64;
  base.a = GemmOperand{a.get(), 64, true, 0};
  base.b = GemmOperand{b.get(), 64, false, 64 * 64};
  base.c = c.get();
  base.ldc = 64;
  base.output = OutputType::kFP32;
  auto expect_invalid = [](const GroupedGemmArgs& args, const char* what) {
    const Status status = kernels::simple_grouped_gemm(args, nullptr);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << what << ": " << status.to_string();
  };

  {
    GroupedGemmArgs args = base;
    args.output = OutputType::kBF16;
    args.accumulate = true;
    expect_invalid(args, "bf16 + accumulate");
  }
  {
    GroupedGemmArgs args = base;
    args.mode = GroupMode::kK;
    args.m = 64;
    args.a = GemmOperand{a.get(), 64, false, 0};
    args.b = GemmOperand{b.get(), 64, true, 0};
    args.c_group_stride = 64 * 64;
    args.row_scale = scale.get();
    expect_invalid(args, "row_scale in K-grouped mode");
    args.row_scale = nullptr;
    args.row_destinations = destinations.get();
    expect_invalid(args, "row_destinations in K-grouped mode");
  }
  {
    GroupedGemmArgs args = base;
    args.n = -1;
    expect_invalid(args, "negative n");
  }
  {
    GroupedGemmArgs args = base;
    args.k = -5;
    expect_invalid(args, "negative k");
  }
  {
    GroupedGemmArgs args = base;
    args.num_groups = -1;
    expect_invalid(args, "negative num_groups");
  }
  {
    GroupedGemmArgs args = base;
    args.group_offsets = nullptr;
    expect_invalid(args, "null offsets");
  }
  {
    GroupedGemmArgs args = base;
    args.a.ptr = nullptr;
    expect_invalid(args, "null A");
  }
  {
    GroupedGemmArgs args = base;
    args.c = nullptr;
    expect_invalid(args, "null C");
  }
  {
    GroupedGemmArgs args = base;
    args.a.ld = 32;  // below K
    expect_invalid(args, "lda below K");
  }
  {
    GroupedGemmArgs args = base;
    args.ldc = 63;
    expect_invalid(args, "ldc below N");
  }
  {
    const Status status = kernels::simple_grouped_gemm(base, nullptr, -1);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << "negative max_blocks";
  }
  // The valid base runs (and nothing was launched by the rejected calls).
  const Status ok = kernels::simple_grouped_gemm(base, nullptr);
  EXPECT_TRUE(ok.is_ok()) << ok.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace megamoe
