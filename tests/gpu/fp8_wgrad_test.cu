// The FP8 weight-gradient GEMM (kernels/fp8_wgrad.hpp) on token-major operands made by
// kernels/fp8_token_major.hpp, against its contract computed in double from the same E4M3 codes and
// power-of-two scales:
// experts with a full and a partial K block, an empty expert (zeros), one of a single row; in 128- and in
// 192-column tiles; the accumulating form bitwise the stored result added to what D held.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/fp8_token_major.hpp"
#include "kernels/fp8_wgrad.hpp"
#include "megamoe/fp8.hpp"

namespace megamoe {
namespace {

using testing::bf16_rounded;
using testing::DeviceBuffer;

constexpr double kFrobeniusTol = 1e-2;
constexpr double kMagTol = 1.0 / 512;  // of the sum of the terms' magnitudes, per element

// The token-major E4M3 copies (and scales) of the routed rows a [capacity, M] and b [capacity, N], as the
// layer's backward makes them: the weight-gradient GEMM's operands.
struct TokenMajorOperands {
  DeviceBuffer<uint8_t> qa, qb;
  DeviceBuffer<kernels::TokenMajorScale> sa, sb;
  TokenMajorOperands(const std::vector<float>& a_rows, int64_t M, const std::vector<float>& b_rows, int64_t N,
                     const DeviceBuffer<int32_t>& offsets, int experts, int64_t capacity)
      : qa(M * kernels::token_major_columns(capacity, experts)),
        qb(N * kernels::token_major_columns(capacity, experts)),
        sa(kernels::token_major_columns(capacity, experts) / 128 * M),
        sb(kernels::token_major_columns(capacity, experts) / 128 * N) {
    const int64_t columns = kernels::token_major_columns(capacity, experts);
    DeviceBuffer<float> d_a(a_rows.size()), d_b(b_rows.size());
    d_a.upload(a_rows);
    d_b.upload(b_rows);
    // Columns outside the experts' segments are never read: zeroed so that a contract can sum every column
    // of a segment without caring about the poison around it.
    EXPECT_EQ(cudaMemset(qa.get(), 0, M * columns), cudaSuccess);
    EXPECT_EQ(cudaMemset(qb.get(), 0, N * columns), cudaSuccess);
    EXPECT_TRUE(kernels::token_major_quantize_fp32(d_a.get(), M, offsets.get(), experts, capacity, qa.get(),
                                                   sa.get(), nullptr)
                    .is_ok());
    EXPECT_TRUE(kernels::token_major_quantize_fp32(d_b.get(), N, offsets.get(), experts, capacity, qb.get(),
                                                   sb.get(), nullptr)
                    .is_ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
};

// Values normal(0, 1) times 2^u, u uniform in [-4, 4): magnitudes over 8 octaves, drawn from `seed`.
struct LogScaledValues {
  std::mt19937 rng;
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::uniform_real_distribution<float> log_magnitude{-4.0f, 4.0f};
  explicit LogScaledValues(uint32_t seed) : rng(seed) {}
  float operator()() { return normal(rng) * std::exp2(log_magnitude(rng)); }
};

TEST(Fp8WgradGemmGpuTest, MatchesTheContractOnTokenMajorOperands) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  LogScaledValues values(seed);
  const std::vector<int32_t> offsets = {0, 130, 130, 300, 301};
  const int experts = 4;
  const int64_t capacity = 320, M = 256, N = 384;
  const int64_t columns = kernels::token_major_columns(capacity, experts);
  std::vector<float> a_rows(capacity * M), b_rows(capacity * N);
  for (float& v : a_rows) v = values();
  for (float& v : b_rows) v = values();

  DeviceBuffer<int32_t> d_offsets(offsets.size());
  d_offsets.upload(offsets);
  TokenMajorOperands ops(a_rows, M, b_rows, N, d_offsets, experts, capacity);
  ASSERT_FALSE(::testing::Test::HasFailure()) << "building the token-major operands failed";
  auto &qa = ops.qa, &qb = ops.qb;
  auto &sa = ops.sa, &sb = ops.sb;
  const std::vector<uint8_t> ha = qa.download(), hb = qb.download();
  const std::vector<kernels::TokenMajorScale> hsa = sa.download(), hsb = sb.download();
  for (const int tile_columns : {128, 192}) {
    SCOPED_TRACE("tile columns " + std::to_string(tile_columns));
    DeviceBuffer<float> d(experts * M * N);  // poisoned (NaN): every element must be written
    ASSERT_TRUE(kernels::fp8_wgrad_gemm(qa.get(), sa.get(), M, qb.get(), sb.get(), N, d_offsets.get(), experts,
                                        capacity, d.get(), false, nullptr, 0, false, 1, tile_columns)
                    .is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> got = d.download();
    double num = 0.0, den = 0.0;
    int64_t bad = 0, nan = 0;
    std::string first_bad;
    for (int e = 0; e < experts; ++e) {
      const int64_t n_e = offsets[e + 1] - offsets[e];
      const int64_t start = kernels::token_major_start(offsets[e], e);
      const int64_t blocks = (n_e + 127) / 128;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double want = 0.0, mag = 0.0;
          for (int64_t kb = 0; kb < blocks; ++kb) {
            const int64_t col0 = start + 128 * kb;
            const double scale = static_cast<double>(kernels::token_major_scale_value(hsa[(col0 / 128) * M + m])) *
                                 kernels::token_major_scale_value(hsb[(col0 / 128) * N + n]);
            double block = 0.0, block_mag = 0.0;
            for (int64_t k = 0; k < 128; ++k) {
              const double term = static_cast<double>(fp8::e4m3_to_float(ha[m * columns + col0 + k])) *
                                  fp8::e4m3_to_float(hb[n * columns + col0 + k]);
              block += term;
              block_mag += std::fabs(term);
            }
            want += scale * block;
            mag += std::fabs(scale) * block_mag;
          }
          const double g = got[(e * M + m) * N + n];
          if (std::isnan(g)) {
            ++nan;
            continue;
          }
          if (n_e == 0) {
            bad += g != 0.0;
            continue;
          }
          num += (g - want) * (g - want);
          den += want * want;
          if (!(std::fabs(g - want) <= kMagTol * mag) && bad++ == 0)
            first_bad = "expert " + std::to_string(e) + " (" + std::to_string(m) + ", " + std::to_string(n) +
                        "): got " + std::to_string(g) + " want " + std::to_string(want);
        }
    }
    const double rel = std::sqrt(num / den);
    std::printf("[fp8_wgrad_test] rel err %.3e\n", rel);
    EXPECT_EQ(nan, 0) << "unwritten outputs";
    EXPECT_EQ(bad, 0) << first_bad;
    EXPECT_LE(rel, kFrobeniusTol);

    // Accumulating: what D held plus the same result, one fp32 add each.
    std::vector<float> before(got.size());
    for (size_t i = 0; i < before.size(); ++i) before[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    DeviceBuffer<float> d_acc(before.size());
    d_acc.upload(before);
    ASSERT_TRUE(kernels::fp8_wgrad_gemm(qa.get(), sa.get(), M, qb.get(), sb.get(), N, d_offsets.get(), experts,
                                        capacity, d_acc.get(), true, nullptr, 0, false, 1, tile_columns)
                    .is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> accumulated = d_acc.download();
    int64_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += accumulated[i] != before[i] + got[i];
    EXPECT_EQ(differ, 0) << "accumulate must be the stored result added to D";
  }
}

// A weight-gradient problem of six experts of 0 to 6 K blocks (odd and even counts: the overlapped loop's
// pairs and its tail), M = 512 (two m-tile pairs) and N = 256 (two n-tiles), on which another form of the GEMM
// must give bitwise the D of the plain loop in single CTAs, stored and accumulated.
struct BitwiseFormProblem {
  const std::vector<int32_t> offsets = {0, 300, 300, 1000, 1513, 1641, 1642};  // 3, 0, 6, 5, 1, 1 blocks
  static constexpr int kExperts = 6;
  static constexpr int64_t kCapacity = 1700, kM = 512, kN = 256;
  DeviceBuffer<int32_t> d_offsets{offsets.size()};
  std::unique_ptr<TokenMajorOperands> ops;
  std::vector<float> start = std::vector<float>(kExperts * kM * kN);

  // Rows of values from `value` (called once per element, A's rows first).
  template <class Value>
  explicit BitwiseFormProblem(Value&& value) {
    std::vector<float> a_rows(kCapacity * kM), b_rows(kCapacity * kN);
    for (float& v : a_rows) v = value();
    for (float& v : b_rows) v = value();
    d_offsets.upload(offsets);
    ops = std::make_unique<TokenMajorOperands>(a_rows, kM, b_rows, kN, d_offsets, kExperts, kCapacity);
    for (size_t i = 0; i < start.size(); ++i) start[i] = 0.125f * static_cast<float>(i % 9) - 0.5f;
  }

  // The plain loop's D against other(D, accumulate) (a GEMM call into D on these operands, [kExperts, kM, kN]).
  // Poisoned unless accumulating: the plain D with NaN, the other with a finite pattern, so that an output either
  // form leaves unwritten is counted (NaN) or differs.
  template <class Other>
  void expect_plain_bits(int max_ctas, bool accumulate, const char* what, Other&& other) const {
    DeviceBuffer<float> plain(start.size()), got_d(start.size());
    if (accumulate) {
      plain.upload(start);
      got_d.upload(start);
    } else {
      MEGAMOE_ASSERT_CUDA(cudaMemset(got_d.get(), 0xFE, start.size() * sizeof(float)));
    }
    ASSERT_TRUE(kernels::fp8_wgrad_gemm(ops->qa.get(), ops->sa.get(), kM, ops->qb.get(), ops->sb.get(), kN,
                                        d_offsets.get(), kExperts, kCapacity, plain.get(), accumulate, nullptr,
                                        max_ctas, false, 1)
                    .is_ok());
    const Status status = other(got_d.get(), accumulate);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> want = plain.download(), got = got_d.download();
    int64_t differ = 0, unwritten = 0;
    std::string first;
    for (size_t i = 0; i < want.size(); ++i) {
      unwritten += std::isnan(got[i]) || std::isnan(want[i]);
      if (std::memcmp(&want[i], &got[i], sizeof(float)) != 0 && differ++ == 0)
        first = "element " + std::to_string(i) + ": " + std::to_string(got[i]) + " against " +
                std::to_string(want[i]);
    }
    EXPECT_EQ(unwritten, 0) << "unwritten outputs";
    EXPECT_EQ(differ, 0) << what << " differs from the plain loop in single CTAs, first at " << first;
  }
};

// The overlapped promotion (each K block promoted while the next one's wgmma run), the 2-CTA cluster pairs
// (B multicast) and the 192-column tiles (N = 256: the second one 64 columns wide) against the plain loop in
// single CTAs: bitwise the same D, stored and accumulated.
TEST(Fp8WgradGemmGpuTest, OverlappedPromotionAndClusterPairsAreBitwiseThePlainLoop) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const BitwiseFormProblem pr([&] { return normal(rng); });
  ASSERT_FALSE(::testing::Test::HasFailure()) << "building the token-major operands failed";
  const TokenMajorOperands& ops = *pr.ops;
  using P = BitwiseFormProblem;
  struct Form {
    bool overlap;
    int cluster;
    int tile_columns;
  };
  // max_ctas 2, 3 and 6: CTAs (and one or three clusters) that take several tiles each, each starting where the
  // previous one left the ring.
  for (const int max_ctas : {0, 2, 3, 6})
  for (const bool accumulate : {false, true})
  for (const Form form : {Form{false, 2, 128}, Form{true, 1, 128}, Form{true, 2, 128}, Form{false, 1, 192}}) {
    SCOPED_TRACE(std::string(accumulate ? "accumulating" : "storing") + ", max_ctas " + std::to_string(max_ctas) +
                 (form.overlap ? ", overlapped" : ", plain") + ", cluster " + std::to_string(form.cluster) +
                 ", tile columns " + std::to_string(form.tile_columns));
    pr.expect_plain_bits(max_ctas, accumulate, "the form", [&](float* d, bool acc) {
      return kernels::fp8_wgrad_gemm(ops.qa.get(), ops.sa.get(), P::kM, ops.qb.get(), ops.sb.get(), P::kN,
                                     pr.d_offsets.get(), P::kExperts, P::kCapacity, d, acc, nullptr, max_ctas,
                                     form.overlap, form.cluster, form.tile_columns);
    });
  }
}

// The single-CTA loop forms besides the cluster pairs: the plain and the overlapped loop in 128-column tiles,
// and 192-column tiles (the forms a transposed or a bf16 D runs in).
struct SingleCtaForm {
  bool overlap;
  int tile_columns;
};
constexpr SingleCtaForm kSingleCtaForms[] = {{false, 128}, {true, 128}, {false, 192}};

std::string form_trace(bool accumulate, int max_ctas, const SingleCtaForm& form) {
  return std::string(accumulate ? "accumulating" : "storing") + ", max_ctas " + std::to_string(max_ctas) +
         (form.overlap ? ", overlapped" : ", plain") + ", tile columns " + std::to_string(form.tile_columns);
}

// transpose_d: the operands swapped and D stored transposed (D^T = B^T A, the form the layer's dW13 takes) is
// the plain D, bitwise (each product a scale pair's and each K block's partial the same, summed in the same
// order), stored and accumulated, in 128-column tiles (plain and overlapped loop) and 192-column ones (N' =
// 512: the last 192-column tile 128 wide), with CTAs that take one or several tiles.
TEST(Fp8WgradGemmGpuTest, TransposedOutputOfSwappedOperandsIsThePlainOutput) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const BitwiseFormProblem pr(LogScaledValues{seed});
  ASSERT_FALSE(::testing::Test::HasFailure()) << "building the token-major operands failed";
  const TokenMajorOperands& ops = *pr.ops;
  using P = BitwiseFormProblem;
  for (const int max_ctas : {0, 3})
  for (const bool accumulate : {false, true})
  for (const SingleCtaForm form : kSingleCtaForms) {
    SCOPED_TRACE(form_trace(accumulate, max_ctas, form));
    pr.expect_plain_bits(max_ctas, accumulate, "the transposed form", [&](float* d, bool acc) {
      return kernels::fp8_wgrad_gemm(ops.qb.get(), ops.sb.get(), P::kN, ops.qa.get(), ops.sa.get(), P::kM,
                                     pr.d_offsets.get(), P::kExperts, P::kCapacity, d, acc, nullptr, max_ctas,
                                     form.overlap, 1, form.tile_columns, /*transpose_d=*/true);
    });
  }
}

// A bf16 D: each value the fp32 D of the same form rounded once (to nearest even), and with accumulate the
// fp32 sum of the bf16 value D held and the fp32 gradient, rounded once; in every single-CTA form (128- and
// 192-column tiles, plain and overlapped loop, D plain and transposed), with CTAs that take one or several
// tiles. Poisoned bf16 outputs (NaN) count as unwritten.
TEST(Fp8WgradGemmGpuTest, Bf16OutputIsTheFp32OutputRoundedOnce) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const BitwiseFormProblem pr(LogScaledValues{seed});
  ASSERT_FALSE(::testing::Test::HasFailure()) << "building the token-major operands failed";
  const TokenMajorOperands& ops = *pr.ops;
  using P = BitwiseFormProblem;
  const size_t count = pr.start.size();
  // What a bf16 D holds before an accumulating call: the fp32 pattern rounded.
  std::vector<__nv_bfloat16> start16(count);
  for (size_t i = 0; i < count; ++i) start16[i] = __float2bfloat16_rn(pr.start[i]);
  for (const int max_ctas : {0, 3})
  for (const bool accumulate : {false, true})
  for (const bool transpose : {false, true})
  for (const SingleCtaForm form : kSingleCtaForms) {
    SCOPED_TRACE(form_trace(accumulate, max_ctas, form) + (transpose ? ", D transposed" : ""));
    // The transposed form computes D^T = B^T A from the swapped operands, into the same [kExperts, kM, kN].
    const auto call = [&](auto* d, bool acc) {
      return transpose
                 ? kernels::fp8_wgrad_gemm(ops.qb.get(), ops.sb.get(), P::kN, ops.qa.get(), ops.sa.get(), P::kM,
                                           pr.d_offsets.get(), P::kExperts, P::kCapacity, d, acc, nullptr, max_ctas,
                                           form.overlap, 1, form.tile_columns, /*transpose_d=*/true)
                 : kernels::fp8_wgrad_gemm(ops.qa.get(), ops.sa.get(), P::kM, ops.qb.get(), ops.sb.get(), P::kN,
                                           pr.d_offsets.get(), P::kExperts, P::kCapacity, d, acc, nullptr, max_ctas,
                                           form.overlap, 1, form.tile_columns);
    };
    DeviceBuffer<float> d32(count);  // poisoned (NaN)
    DeviceBuffer<__nv_bfloat16> d16(count);
    if (accumulate) {
      d16.upload(start16);
    } else {
      d16.poison();
    }
    ASSERT_TRUE(call(d32.get(), false).is_ok());
    const Status status = call(d16.get(), accumulate);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> fp32 = d32.download();
    const std::vector<__nv_bfloat16> got = d16.download();
    int64_t differ = 0, unwritten = 0, nonzero = 0;
    std::string first;
    for (size_t i = 0; i < count; ++i) {
      const float g = __bfloat162float(got[i]);
      const float want = bf16_rounded(accumulate ? fp32[i] + __bfloat162float(start16[i]) : fp32[i]);
      unwritten += std::isnan(g) || std::isnan(fp32[i]);
      nonzero += g != 0.0f;
      if (std::memcmp(&want, &g, sizeof(float)) != 0 && differ++ == 0)
        first = "element " + std::to_string(i) + ": " + std::to_string(g) + " against " + std::to_string(want);
    }
    EXPECT_EQ(unwritten, 0) << "unwritten outputs";
    EXPECT_GT(nonzero, 0) << "no gradient reached the bf16 D";
    EXPECT_EQ(differ, 0) << "the bf16 D differs from the fp32 one rounded, first at " << first;
  }
  // A bf16 D runs in single CTAs.
  DeviceBuffer<__nv_bfloat16> d16(count);
  EXPECT_EQ(kernels::fp8_wgrad_gemm(ops.qa.get(), ops.sa.get(), P::kM, ops.qb.get(), ops.sb.get(), P::kN,
                                    pr.d_offsets.get(), P::kExperts, P::kCapacity, d16.get(), false, nullptr, 0,
                                    false, 2)
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(Fp8WgradGemmGpuTest, BadArgumentsAreRefused) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<uint8_t> q(256 * 1024);
  DeviceBuffer<kernels::TokenMajorScale> s(1024);
  DeviceBuffer<float> d(256 * 256);
  DeviceBuffer<int32_t> offsets(3);
  const auto call = [&](int64_t M, int64_t N, int experts, const uint8_t* qa) {
    return kernels::fp8_wgrad_gemm(qa, s.get(), M, q.get(), s.get(), N, offsets.get(), experts, 128, d.get(), false,
                                   nullptr)
        .code();
  };
  EXPECT_EQ(call(100, 128, 2, q.get()), StatusCode::kInvalidArgument);
  EXPECT_EQ(call(128, 200, 2, q.get()), StatusCode::kInvalidArgument);
  EXPECT_EQ(call(128, 128, 0, q.get()), StatusCode::kInvalidArgument);
  EXPECT_EQ(call(128, 128, 2, q.get() + 1), StatusCode::kInvalidArgument);
  EXPECT_EQ(call(128, 128, 2, nullptr), StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::fp8_wgrad_gemm(q.get(), s.get(), 128, q.get(), s.get(), 128, offsets.get(), 2, 128, d.get() + 1,
                                    false, nullptr)
                .code(),
            StatusCode::kInvalidArgument);  // D must be 16-byte aligned (the epilogue stores 16 bytes at a time)
  // The launch form: max_ctas (0 or at least one cluster), cluster pairs (an even number of m-tiles), and only 1
  // and 2 as cluster sizes.
  const auto form = [&](int64_t M, int max_ctas, int cluster) {
    return kernels::fp8_wgrad_gemm(q.get(), s.get(), M, q.get(), s.get(), 128, offsets.get(), 2, 128, d.get(), false,
                                   nullptr, max_ctas, false, cluster)
        .code();
  };
  EXPECT_EQ(form(128, -1, 1), StatusCode::kInvalidArgument);
  EXPECT_EQ(form(256, 1, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(form(128, 0, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(form(256, 0, 3), StatusCode::kInvalidArgument);
  EXPECT_EQ(form(256, 0, 0), StatusCode::kInvalidArgument);
  // Tiles of 128 or 192 columns, the 192-column ones with the plain loop in single CTAs.
  const auto tiles = [&](int tile_columns, bool overlap, int cluster) {
    return kernels::fp8_wgrad_gemm(q.get(), s.get(), 256, q.get(), s.get(), 128, offsets.get(), 2, 128, d.get(), false,
                                   nullptr, 0, overlap, cluster, tile_columns)
        .code();
  };
  EXPECT_EQ(tiles(64, false, 1), StatusCode::kInvalidArgument);
  EXPECT_EQ(tiles(256, false, 1), StatusCode::kInvalidArgument);
  EXPECT_EQ(tiles(192, true, 1), StatusCode::kInvalidArgument);
  EXPECT_EQ(tiles(192, false, 2), StatusCode::kInvalidArgument);
  // A transposed D: single CTAs only (and 192 columns with the plain loop, as above).
  const auto transposed = [&](int tile_columns, bool overlap, int cluster) {
    return kernels::fp8_wgrad_gemm(q.get(), s.get(), 256, q.get(), s.get(), 128, offsets.get(), 2, 128, d.get(), false,
                                   nullptr, 0, overlap, cluster, tile_columns, /*transpose_d=*/true)
        .code();
  };
  EXPECT_EQ(transposed(128, false, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(transposed(128, true, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(transposed(192, true, 1), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace megamoe
