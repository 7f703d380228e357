// The FP8 backward's one-pass SwiGLU step (kernels/fp8_swiglu_backward.hpp) against its twins, the row-major
// quantizer swiglu_backward_quantize_rows_1x128 and the token-major pair token_major_quantize_swiglu_pair
// (each checked against the CPU rule in its own test): every output byte equal, the untouched ones included
// (all buffers start as 0xFF poison), on layouts with partial, empty and one-row experts and several 128-channel
// blocks of I.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
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
  DeviceBuffer<float> dh_s;
  DeviceBuffer<kernels::TokenMajorScale> at_s, dht_s;
  DeviceBuffer<float> dots;
  DeviceBuffer<float*> dot_rows;
  int64_t pitch;

  StepOutputs(int64_t capacity, int64_t I, int experts)
      : dh_q(capacity * 2 * I),
        at_q(I * kernels::token_major_columns(capacity, experts)),
        dht_q(2 * I * kernels::token_major_columns(capacity, experts)),
        dh_s(2 * I / 128 * kernels::fp8_scale_pitch(capacity)),
        at_s(kernels::token_major_columns(capacity, experts) / 128 * I),
        dht_s(kernels::token_major_columns(capacity, experts) / 128 * 2 * I),
        dots(capacity * kDotParts),
        dot_rows(capacity),
        pitch(kernels::fp8_scale_pitch(capacity)) {
    // Row 5 has no destination: its partials must stay poisoned.
    std::vector<float*> rows(capacity);
    for (int64_t r = 0; r < capacity; ++r) rows[r] = r == 5 ? nullptr : dots.get() + r * kDotParts;
    dot_rows.upload(rows);
  }

  // The kernel's view of them, with or without the dots.
  kernels::SwigluBackwardFp8Outputs view(bool with_dots) const {
    kernels::SwigluBackwardFp8Outputs out;
    out.dh_q = dh_q.get();
    out.dh_s = dh_s.get();
    out.dh_scales_pitch = pitch;
    out.dot_rows = with_dots ? dot_rows.get() : nullptr;
    out.dot_parts = with_dots ? kDotParts : 0;
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

  EXPECT_EQ(differing_bytes(one.dh_q, twins.dh_q), 0);
  EXPECT_EQ(differing_bytes(one.dh_s, twins.dh_s), 0);
  EXPECT_EQ(differing_bytes(one.dots, twins.dots), 0);
  EXPECT_EQ(differing_bytes(one.at_q, twins.at_q), 0);
  EXPECT_EQ(differing_bytes(one.at_s, twins.at_s), 0);
  EXPECT_EQ(differing_bytes(one.dht_q, twins.dht_q), 0);
  EXPECT_EQ(differing_bytes(one.dht_s, twins.dht_s), 0);

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

}  // namespace
}  // namespace megamoe
