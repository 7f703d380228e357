// The FP8 backward's one-pass SwiGLU step (kernels/fp8_swiglu_backward.hpp) against its twins, the row-major
// quantizer swiglu_backward_quantize_rows_1x128 and the token-major pair token_major_quantize_swiglu_pair
// (each checked against the CPU rule in its own test): every output byte equal, the untouched ones included
// (all buffers start as 0xFF poison), on layouts with partial, empty and one-row experts and several 128-channel
// blocks of I. And the same step as the epilogue of the dgrad GEMM that makes g (Fp8GemmRows::swiglu_backward)
// against that GEMM's fp32 g followed by the step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/fp8_gemm.hpp"
#include "kernels/fp8_layout.hpp"
#include "kernels/fp8_quantize.hpp"
#include "kernels/fp8_swiglu_backward.hpp"
#include "kernels/fp8_token_major.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

constexpr int kDotParts = 3;

// Every output of the step, poisoned on creation.
struct StepOutputs {
  DeviceBuffer<uint8_t> dh_q, at_q, dht_q;
  DeviceBuffer<float> dh_s, at_s, dht_s, dots;
  DeviceBuffer<float*> dot_rows;
  int64_t pitch;
  int parts;

  StepOutputs(int64_t capacity, int64_t I, int experts, int dot_parts = kDotParts)
      : dh_q(capacity * 2 * I),
        at_q(I * kernels::token_major_columns(capacity, experts)),
        dht_q(2 * I * kernels::token_major_columns(capacity, experts)),
        dh_s(2 * I / 128 * kernels::fp8_scale_pitch(capacity)),
        at_s(kernels::token_major_columns(capacity, experts) / 128 * I),
        dht_s(kernels::token_major_columns(capacity, experts) / 128 * 2 * I),
        dots(capacity * dot_parts),
        dot_rows(capacity),
        pitch(kernels::fp8_scale_pitch(capacity)),
        parts(dot_parts) {
    // Row 5 has no destination: its partials must stay poisoned.
    std::vector<float*> rows(capacity);
    for (int64_t r = 0; r < capacity; ++r) rows[r] = r == 5 ? nullptr : dots.get() + r * dot_parts;
    dot_rows.upload(rows);
  }

  // The kernel's view of them, with or without the dots.
  kernels::SwigluBackwardFp8Outputs view(bool with_dots) const {
    kernels::SwigluBackwardFp8Outputs out;
    out.dh_q = dh_q.get();
    out.dh_s = dh_s.get();
    out.dh_scales_pitch = pitch;
    out.dot_rows = with_dots ? dot_rows.get() : nullptr;
    out.dot_parts = with_dots ? parts : 0;
    out.at_q = at_q.get();
    out.at_s = at_s.get();
    out.dht_q = dht_q.get();
    out.dht_s = dht_s.get();
    return out;
  }
};

// How many bytes of two device buffers of one size differ.
template <typename T>
int64_t differing_bytes(const DeviceBuffer<T>& x, const DeviceBuffer<T>& y) {
  return testing::differing_bytes(x.download(), y.download());
}

// Every output but the dots byte for byte equal (untouched bytes included); with_dots: the dots too.
void expect_same_step_bytes(const StepOutputs& got, const StepOutputs& want, bool with_dots) {
  EXPECT_EQ(differing_bytes(got.dh_q, want.dh_q), 0);
  EXPECT_EQ(differing_bytes(got.dh_s, want.dh_s), 0);
  if (with_dots) EXPECT_EQ(differing_bytes(got.dots, want.dots), 0);
  EXPECT_EQ(differing_bytes(got.at_q, want.at_q), 0);
  EXPECT_EQ(differing_bytes(got.at_s, want.at_s), 0);
  EXPECT_EQ(differing_bytes(got.dht_q, want.dht_q), 0);
  EXPECT_EQ(differing_bytes(got.dht_s, want.dht_s), 0);
}

void check_against_twins(const std::vector<int32_t>& offsets, int64_t capacity, int64_t I) {
  const int experts = static_cast<int>(offsets.size()) - 1;
  const int64_t used = offsets.back();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed) + " I " + std::to_string(I) + " capacity " + std::to_string(capacity));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  // Rows past the experts' are NaN: they must not be read.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> h(capacity * 2 * I), g(capacity * I), w(capacity);
  for (int64_t r = 0; r < capacity; ++r) {
    w[r] = r < used ? std::fabs(normal(rng)) + 0.01f : nan;
    for (int64_t c = 0; c < I; ++c) g[r * I + c] = r < used ? normal(rng) : nan;
    for (int64_t c = 0; c < 2 * I; ++c) h[r * 2 * I + c] = r < used ? normal(rng) : nan;
  }
  DeviceBuffer<float> d_h(h.size()), d_g(g.size()), d_w(w.size());
  DeviceBuffer<int32_t> d_offsets(offsets.size());
  d_h.upload(h);
  d_g.upload(g);
  d_w.upload(w);
  d_offsets.upload(offsets);

  StepOutputs one(capacity, I, experts), twins(capacity, I, experts);
  ASSERT_TRUE(kernels::swiglu_backward_quantize_fp8(d_g.get(), d_h.get(), d_w.get(), I, d_offsets.get(), experts,
                                                    capacity, one.view(true), nullptr)
                  .is_ok());
  ASSERT_TRUE(kernels::swiglu_backward_quantize_rows_1x128(
                  d_g.get(), d_h.get(), d_w.get(), capacity, I, d_offsets.get() + experts, twins.dh_q.get(),
                  twins.dh_s.get(), twins.pitch, nullptr, twins.dot_rows.get(), kDotParts, nullptr)
                  .is_ok());
  ASSERT_TRUE(kernels::token_major_quantize_swiglu_pair(d_g.get(), d_h.get(), d_w.get(), I, d_offsets.get(), experts,
                                                        capacity, twins.at_q.get(), twins.at_s.get(),
                                                        twins.dht_q.get(), twins.dht_s.get(), nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());

  expect_same_step_bytes(one, twins, /*with_dots=*/true);

  // Equal bytes could be two kernels that wrote nothing: every row of the experts has codes (0xFF, the poison,
  // is no code of a finite value) and a finite dot unless it has no destination.
  const std::vector<uint8_t> q = one.dh_q.download();
  const std::vector<float> dots = one.dots.download();
  int64_t unwritten = 0;
  for (int64_t r = 0; r < used; ++r) {
    for (int64_t c = 0; c < 2 * I; ++c) unwritten += q[r * 2 * I + c] == 0xFF;
    if (r != 5) unwritten += !std::isfinite(dots[r * kDotParts]) || dots[r * kDotParts + 1] != 0.0f;
  }
  EXPECT_EQ(unwritten, 0);
  EXPECT_TRUE(std::isnan(dots[5 * kDotParts])) << "row 5 has no destination";
}

TEST(Fp8SwigluBackwardGpuTest, OnePassIsBothTwinsBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  // An expert of a full and a partial group, an empty one, one of 170 rows from mid-group, one of one row;
  // the last 19 rows unused.
  check_against_twins({0, 130, 130, 300, 301}, 320, 384);
  // The layer's I of the Qwen3-30B shape: six 128-channel blocks.
  check_against_twins({0, 130, 130, 300, 301}, 320, 768);
}

TEST(Fp8SwigluBackwardGpuTest, ManyExpertsAndGroups) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> rows(0, 400);
  std::vector<int32_t> offsets = {0};
  for (int e = 0; e < 40; ++e) offsets.push_back(offsets.back() + (e % 7 == 3 ? 0 : rows(rng)));
  check_against_twins(offsets, offsets.back() + 77, 256);
}

TEST(Fp8SwigluBackwardGpuTest, BadArgumentsAreRefused) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  constexpr int64_t kCapacity = 256, I = 128;
  StepOutputs o(kCapacity, I, 2);
  DeviceBuffer<float> g(kCapacity * I), h(kCapacity * 2 * I), w(kCapacity);
  DeviceBuffer<int32_t> offsets(3);
  const kernels::SwigluBackwardFp8Outputs out = o.view(false);
  const auto code = [&](int64_t i, int experts, const kernels::SwigluBackwardFp8Outputs& outs, const float* gp) {
    return kernels::swiglu_backward_quantize_fp8(gp, h.get(), w.get(), i, offsets.get(), experts, kCapacity, outs,
                                                 nullptr)
        .code();
  };
  EXPECT_EQ(code(200, 2, out, g.get()), StatusCode::kInvalidArgument);  // I not a multiple of 128
  EXPECT_EQ(code(I, 0, out, g.get()), StatusCode::kInvalidArgument);    // no experts
  EXPECT_EQ(code(I, 2, out, g.get() + 1), StatusCode::kInvalidArgument);  // g misaligned
  EXPECT_EQ(code(I, 2, out, nullptr), StatusCode::kInvalidArgument);
  kernels::SwigluBackwardFp8Outputs bad = out;
  bad.dh_scales_pitch = kCapacity - 4;
  EXPECT_EQ(code(I, 2, bad, g.get()), StatusCode::kInvalidArgument);
  bad = out;
  bad.dot_rows = o.dot_rows.get();
  bad.dot_parts = 0;
  EXPECT_EQ(code(I, 2, bad, g.get()), StatusCode::kInvalidArgument);
  bad = out;
  bad.dht_q = o.dht_q.get() + 8;
  EXPECT_EQ(code(I, 2, bad, g.get()), StatusCode::kInvalidArgument);
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  // Nothing was launched: every output still holds its poison.
  for (uint8_t b : o.dh_q.download()) ASSERT_EQ(b, 0xFF);
}

// Random E4M3 codes of moderate magnitude (2^-3 .. 2^3 before the scale; no NaN codes) and scales near 1 / 16:
// g then stays of order one over a few K blocks.
std::vector<uint8_t> moderate_codes(int64_t count, std::mt19937& rng) {
  std::uniform_int_distribution<int> sign(0, 1), exponent(4, 10), mantissa(0, 7);
  std::vector<uint8_t> q(count);
  for (auto& b : q) b = static_cast<uint8_t>((sign(rng) << 7) | (exponent(rng) << 3) | mantissa(rng));
  return q;
}
std::vector<float> scales_near(int64_t count, float base, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  std::vector<float> s(count);
  for (auto& v : s) v = base * u(rng);
  return s;
}

// The dgrad g = A B^T (A: the d_out rows in expert order, B: W2's transposed copy, N = I, K = H) with the
// SwiGLU step in its epilogue, against the GEMM's fp32 g and the step after it: every output's bytes equal but
// the routing-weight partials, whose sum (parts in order) is the step's part 0 within fp32 rounding.
void check_dgrad_epilogue(const std::vector<int32_t>& offsets, int64_t capacity, int64_t I, int64_t H) {
  const int experts = static_cast<int>(offsets.size()) - 1;
  const int64_t used = offsets.back();
  const int parts = static_cast<int>(I / 128);
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed) + " I " + std::to_string(I) + " H " + std::to_string(H) +
               " capacity " + std::to_string(capacity) + " experts " + std::to_string(experts));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Rows past the experts' are NaN in h and w: they must not be read.
  std::vector<float> h(capacity * 2 * I), w(capacity);
  for (int64_t r = 0; r < capacity; ++r) {
    w[r] = r < used ? std::fabs(normal(rng)) + 0.01f : nan;
    for (int64_t c = 0; c < 2 * I; ++c) h[r * 2 * I + c] = r < used ? normal(rng) : nan;
  }
  const int64_t pitch = kernels::fp8_scale_pitch(capacity);
  const std::vector<uint8_t> qa = moderate_codes(capacity * H, rng), qb = moderate_codes(experts * I * H, rng);
  const std::vector<float> sa = scales_near(H / 128 * pitch, 1.0f / 16, rng),
                           sb = scales_near(experts * (I / 128) * (H / 128), 1.0f / 16, rng);
  DeviceBuffer<uint8_t> d_qa(qa.size()), d_qb(qb.size());
  DeviceBuffer<float> d_sa(sa.size()), d_sb(sb.size()), d_h(h.size()), d_w(w.size()), g(capacity * I);
  DeviceBuffer<int32_t> d_offsets(offsets.size());
  d_qa.upload(qa);
  d_qb.upload(qb);
  d_sa.upload(sa);
  d_sb.upload(sb);
  d_h.upload(h);
  d_w.upload(w);
  d_offsets.upload(offsets);

  // The twin: g in fp32, then the separate step.
  StepOutputs twin(capacity, I, experts, parts);
  kernels::Fp8GemmTuning tuning;
  tuning.overlap_promotion = true;
  kernels::Fp8GemmRows plain;
  plain.d_fp32 = g.get();
  const Status st =
      kernels::fp8_grouped_gemm_nt(d_qa.get(), d_sa.get(), d_qb.get(), d_sb.get(), nullptr, d_offsets.get(), experts,
                                   capacity, static_cast<int>(I), static_cast<int>(H), nullptr, tuning, plain);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  const Status step_status = kernels::swiglu_backward_quantize_fp8(g.get(), d_h.get(), d_w.get(), I, d_offsets.get(),
                                                                   experts, capacity, twin.view(true), nullptr);
  ASSERT_TRUE(step_status.is_ok()) << step_status.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> g_host = g.download(), twin_dots = twin.dots.download();

  // The dots' bar: fp32 rounding of a sum of I products, relative to the sum of their magnitudes.
  std::vector<double> magnitude(used, 0.0);
  for (int64_t r = 0; r < used; ++r)
    for (int64_t c = 0; c < I; ++c) {
      const double gate = h[r * 2 * I + c], up = h[r * 2 * I + I + c];
      magnitude[r] += std::fabs(g_host[r * I + c] * gate / (1.0 + std::exp(-gate)) * up);
    }

  // max_ctas 3: each CTA runs many tiles, so the channel maxima's buffers and the staging boxes are reused.
  for (const int max_ctas : {0, 3}) {
    SCOPED_TRACE("max_ctas " + std::to_string(max_ctas));
    StepOutputs fused(capacity, I, experts, parts);
    kernels::Fp8SwigluBackward step;
    step.h = d_h.get();
    step.row_weight = d_w.get();
    step.out = fused.view(true);
    kernels::Fp8GemmRows rows;
    rows.swiglu_backward = &step;
    kernels::Fp8GemmTuning capped;
    capped.max_ctas = max_ctas;  // the plain loop asked: the epilogue runs the overlapped one anyway
    const Status fused_status =
        kernels::fp8_grouped_gemm_nt(d_qa.get(), d_sa.get(), d_qb.get(), d_sb.get(), nullptr, d_offsets.get(), experts,
                                     capacity, static_cast<int>(I), static_cast<int>(H), nullptr, capped, rows);
    ASSERT_TRUE(fused_status.is_ok()) << fused_status.to_string();
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    expect_same_step_bytes(fused, twin, /*with_dots=*/false);  // the dots below, against their sums

    const std::vector<float> dots = fused.dots.download();
    int64_t off_bar = 0, poisoned_written = 0, unwritten = 0;
    double worst = 0.0;
    for (int64_t r = 0; r < capacity; ++r) {
      if (r >= used || r == 5) {  // no row of an expert, or no destination: every part keeps its poison
        for (int part = 0; part < parts; ++part) poisoned_written += !std::isnan(dots[r * parts + part]);
        continue;
      }
      float sum = 0.0f;
      for (int part = 0; part < parts; ++part) {
        unwritten += !std::isfinite(dots[r * parts + part]);
        sum += dots[r * parts + part];
      }
      const double err = std::fabs(static_cast<double>(sum) - twin_dots[r * parts]);
      worst = std::max(worst, err / (magnitude[r] + 1e-30));
      off_bar += err > 1e-5 * magnitude[r] + 1e-30;
    }
    EXPECT_EQ(unwritten, 0);
    EXPECT_EQ(poisoned_written, 0);
    EXPECT_EQ(off_bar, 0) << "worst |sum - twin| / sum |g a|: " << worst;
  }
}

TEST(Fp8SwigluBackwardGpuTest, DgradEpilogueIsTheStepBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  // Partial, empty and one-row experts; the last 19 rows unused; tiles that hold fewer rows than one
  // warpgroup's.
  check_dgrad_epilogue({0, 130, 130, 300, 301}, 320, 384, 256);
  check_dgrad_epilogue({0, 130, 130, 300, 301}, 320, 768, 512);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> rows(0, 400);
  std::vector<int32_t> offsets = {0};
  for (int e = 0; e < 40; ++e) offsets.push_back(offsets.back() + (e % 7 == 3 ? 0 : rows(rng)));
  check_dgrad_epilogue(offsets, offsets.back() + 77, 256, 256);
}

TEST(Fp8SwigluBackwardGpuTest, DgradEpilogueRefusesWhatItCannotDo) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  constexpr int64_t kCapacity = 256, I = 256, H = 128;
  StepOutputs o(kCapacity, I, 2, static_cast<int>(I / 128));
  DeviceBuffer<uint8_t> qa(kCapacity * H), qb(2 * I * H);
  DeviceBuffer<float> sa(kernels::fp8_scale_pitch(kCapacity) * (H / 128)), sb(2 * (I / 128)), h(kCapacity * 2 * I),
      w(kCapacity), d32(kCapacity * I);
  DeviceBuffer<int32_t> offsets(3);
  const auto code = [&](const kernels::Fp8SwigluBackward& step, kernels::Fp8GemmRows rows, int cluster,
                        int64_t i) {
    rows.swiglu_backward = &step;
    kernels::Fp8GemmTuning tuning;
    tuning.cluster_size = cluster;
    return kernels::fp8_grouped_gemm_nt(qa.get(), sa.get(), qb.get(), sb.get(), nullptr, offsets.get(), 2, kCapacity,
                                        static_cast<int>(i), static_cast<int>(H), nullptr, tuning, rows)
        .code();
  };
  kernels::Fp8SwigluBackward good;
  good.h = h.get();
  good.row_weight = w.get();
  good.out = o.view(true);
  kernels::Fp8SwigluBackward bad = good;
  bad.out.dot_parts = 3;  // not I / 128
  EXPECT_EQ(code(bad, {}, 1, I), StatusCode::kInvalidArgument);
  bad = good;
  bad.h = nullptr;
  EXPECT_EQ(code(bad, {}, 1, I), StatusCode::kInvalidArgument);
  bad = good;
  bad.out.at_q = o.at_q.get() + 4;
  EXPECT_EQ(code(bad, {}, 1, I), StatusCode::kInvalidArgument);
  bad = good;
  bad.out.dh_scales_pitch = kCapacity - 4;
  EXPECT_EQ(code(bad, {}, 1, I), StatusCode::kInvalidArgument);
  kernels::Fp8GemmRows with_d32;
  with_d32.d_fp32 = d32.get();
  EXPECT_EQ(code(good, with_d32, 1, I), StatusCode::kInvalidArgument);  // no other output
  EXPECT_EQ(code(good, {}, 2, I), StatusCode::kInvalidArgument);        // one CTA
  EXPECT_EQ(code(good, {}, 1, 200), StatusCode::kInvalidArgument);      // I not a multiple of 128
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  for (uint8_t b : o.dh_q.download()) ASSERT_EQ(b, 0xFF);
}

}  // namespace
}  // namespace megamoe
