// The weight gradients' token-major FP8 operands (kernels/fp8_token_major.hpp) against the CPU emulation of
// include/megamoe/fp8.hpp, bit for bit: every channel's groups of 128 routed rows per expert (the last one
// partial, zero-padded), in the documented columns, with K-block-major power-of-two scales; nothing else
// written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/fp8_gather_rows.hpp"
#include "kernels/fp8_layout.hpp"
#include "kernels/fp8_quantize.hpp"
#include "kernels/fp8_token_major.hpp"
#include "megamoe/fp8.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;
using testing::bits_of;
using testing::differing_bytes;

// Rows over many binades (subnormal codes, ties and the 448 edge all occur).
float random_value(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_magnitude(-10.0f, 6.0f);
  return normal(rng) * std::exp2(log_magnitude(rng));
}

// Checks the GPU's copy against the rule, given the routed rows' values as the kernel reads them
// (value(r, c) for row r of the expert-major rows). Every column outside the experts' segments, and every
// scale of a K block no expert has, must still hold the 0xFF poison.
template <class Value>
void expect_token_major(const std::vector<int32_t>& offsets, int64_t capacity, int64_t channels, const Value& value,
                        const std::vector<uint8_t>& got_q, const std::vector<kernels::TokenMajorScale>& got_s) {
  const int experts = static_cast<int>(offsets.size()) - 1;
  const int64_t columns = kernels::token_major_columns(capacity, experts);
  std::vector<bool> written_column(columns, false);
  int64_t code_mismatches = 0, scale_mismatches = 0, poison_lost = 0;
  for (int e = 0; e < experts; ++e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - offsets[e];
    const int64_t start = kernels::token_major_start(begin, e);
    ASSERT_EQ(start % 128, 0);
    for (int64_t g = 0; g * 128 < n; ++g) {
      for (int64_t k = 0; k < 128; ++k) written_column[start + 128 * g + k] = true;
      for (int64_t c = 0; c < channels; ++c) {
        float group[128];
        for (int64_t k = 0; k < 128; ++k) group[k] = 128 * g + k < n ? value(begin + 128 * g + k, c) : 0.0f;
        // The rule written out: a NaN-ignoring amax, its power-of-two scale, exact quotients.
        float amax = 0.0f;
        for (const float v : group) amax = std::fabs(v) > amax ? std::fabs(v) : amax;
        const float scale = fp8::power_of_two_scale_from_amax(amax);
        for (int64_t k = 0; k < 128; ++k)
          code_mismatches += got_q[c * columns + start + 128 * g + k] != fp8::float_to_e4m3(group[k] / scale);
        // Kept as the upper half of its fp32 bits, which hold all of it.
        const int64_t at = ((start / 128) + g) * channels + c;
        scale_mismatches += (bits_of(scale) & 0xFFFFu) != 0 || got_s[at] != (bits_of(scale) >> 16);
      }
    }
  }
  for (int64_t col = 0; col < columns; ++col) {
    if (written_column[col]) continue;
    for (int64_t c = 0; c < channels; ++c) poison_lost += got_q[c * columns + col] != 0xFF;
    if (col % 128 == 0)
      for (int64_t c = 0; c < channels; ++c) poison_lost += got_s[(col / 128) * channels + c] != 0xFFFFu;
  }
  EXPECT_EQ(code_mismatches, 0);
  EXPECT_EQ(scale_mismatches, 0);
  EXPECT_EQ(poison_lost, 0) << "the kernel wrote outside the experts' segments";
}

// Four experts: one with a full and a partial group (130 rows), an empty one, one of 170 rows starting
// mid-group, one of a single row; capacity 320 (the last 19 rows unused, NaN to show they are not read).
const std::vector<int32_t> kOffsets = {0, 130, 130, 300, 301};
constexpr int64_t kCapacity = 320;
constexpr int64_t kChannels = 256;

TEST(Fp8TokenMajorGpuTest, Fp32RowsMatchTheCpuRuleBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::vector<float> rows(kCapacity * kChannels, std::numeric_limits<float>::quiet_NaN());
  for (int64_t r = 0; r < kOffsets.back(); ++r)
    for (int64_t c = 0; c < kChannels; ++c) rows[r * kChannels + c] = random_value(rng);
  for (int64_t r = 0; r < 130; ++r) rows[r * kChannels + 5] = 0.0f;  // an all-zero channel: scale 1
  rows[140 * kChannels + 9] = std::numeric_limits<float>::quiet_NaN();  // ignored by its group's amax
  rows[200 * kChannels + 17] = std::numeric_limits<float>::infinity();  // its group's scale is infinite
  const int experts = static_cast<int>(kOffsets.size()) - 1;
  const int64_t columns = kernels::token_major_columns(kCapacity, experts);
  DeviceBuffer<float> d_rows(rows.size());
  DeviceBuffer<int32_t> d_offsets(kOffsets.size());
  DeviceBuffer<uint8_t> qt(kChannels * columns);
  DeviceBuffer<kernels::TokenMajorScale> st(columns / 128 * kChannels);
  d_rows.upload(rows);
  d_offsets.upload(kOffsets);
  ASSERT_TRUE(kernels::token_major_quantize_fp32(d_rows.get(), kChannels, d_offsets.get(), experts, kCapacity,
                                                 qt.get(), st.get(), nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  expect_token_major(kOffsets, kCapacity, kChannels, [&](int64_t r, int64_t c) { return rows[r * kChannels + c]; },
                     qt.download(), st.download());
}

// Dispatched E4M3 rows as the layer receives them: kSourceRows random rows quantized 1 x 128, a source row and
// a routing weight per routed row (rows 7 and 150 with indices out of range: they read as zeros), on the host
// and uploaded.
struct DispatchedE4m3Rows {
  static constexpr int64_t kSourceRows = 200;
  std::vector<uint8_t> q;
  std::vector<float> s, row_weight;
  std::vector<int32_t> row_src;
  DeviceBuffer<uint8_t> d_q;
  DeviceBuffer<float> d_s, d_weight;
  DeviceBuffer<int32_t> d_src, d_offsets;

  DispatchedE4m3Rows(int64_t channels, std::mt19937& rng)
      : q(kSourceRows * channels), s(kSourceRows * (channels / 128)), row_weight(kCapacity),
        row_src(kCapacity), d_q(q.size()), d_s(s.size()), d_weight(kCapacity), d_src(kCapacity),
        d_offsets(kOffsets.size()) {
    std::vector<float> source(kSourceRows * channels);
    for (float& v : source) v = random_value(rng);
    fp8::quantize_rows_1x128(source.data(), kSourceRows, channels, q.data(), s.data());
    std::uniform_int_distribution<int32_t> pick(0, kSourceRows - 1);
    std::uniform_real_distribution<float> weight(0.01f, 1.0f);
    for (int64_t r = 0; r < kCapacity; ++r) {
      row_src[r] = pick(rng);
      row_weight[r] = weight(rng);
    }
    row_src[7] = -1;
    row_src[150] = kSourceRows;
    d_q.upload(q);
    d_s.upload(s);
    d_weight.upload(row_weight);
    d_src.upload(row_src);
    d_offsets.upload(kOffsets);
  }
  bool valid(int64_t r) const { return row_src[r] >= 0 && row_src[r] < kSourceRows; }
};

// Dispatched E4M3 rows gathered by index (one index out of range: zeros), dequantized, and with the routing
// weight (dy = w dOut) or without (x); 256 channels (one run of slabs a block) and 768 (two, the second partial).
void check_gathered_e4m3_rows(int64_t channels) {
  SCOPED_TRACE("channels " + std::to_string(channels));
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const DispatchedE4m3Rows in(channels, rng);
  constexpr int64_t kSourceRows = DispatchedE4m3Rows::kSourceRows;
  const std::vector<uint8_t>& q = in.q;
  const std::vector<float>& s = in.s;
  const std::vector<float>& row_weight = in.row_weight;
  const std::vector<int32_t>& row_src = in.row_src;
  const DeviceBuffer<uint8_t>& d_q = in.d_q;
  const DeviceBuffer<float>& d_s = in.d_s;
  const DeviceBuffer<float>& d_weight = in.d_weight;
  const DeviceBuffer<int32_t>& d_src = in.d_src;
  const DeviceBuffer<int32_t>& d_offsets = in.d_offsets;
  const int experts = static_cast<int>(kOffsets.size()) - 1;
  const int64_t columns = kernels::token_major_columns(kCapacity, experts);
  for (const bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "with the routing weight" : "without a weight");
    DeviceBuffer<uint8_t> qt(channels * columns);
    DeviceBuffer<kernels::TokenMajorScale> st(columns / 128 * channels);
    ASSERT_TRUE(kernels::token_major_quantize_e4m3(d_q.get(), d_s.get(), kSourceRows, d_src.get(),
                                                   weighted ? d_weight.get() : nullptr, channels, d_offsets.get(),
                                                   experts, kCapacity, qt.get(), st.get(), nullptr)
                    .is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto value = [&](int64_t r, int64_t c) {
      const int32_t src = row_src[r];
      if (src < 0 || src >= kSourceRows) return 0.0f;
      float v = fp8::e4m3_to_float(q[src * channels + c]) * s[src * (channels / 128) + c / 128];
      if (weighted) v *= row_weight[r];
      return v;
    };
    expect_token_major(kOffsets, kCapacity, channels, value, qt.download(), st.download());
  }
}

// The gathering form (token_major_quantize_e4m3_gathering): its token-major copy bit for bit the plain form's,
// its rows in expert order bit for bit gather_rows_e4m3's (the rows of an index out of range: zero codes and a
// zero scale, where the gather clamps), and nothing written past the routed rows (poison kept), with and
// without the routing weight; 256 and 768 channels.
void check_gathering_form(int64_t channels) {
  SCOPED_TRACE("channels " + std::to_string(channels));
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const DispatchedE4m3Rows in(channels, rng);
  constexpr int64_t kSourceRows = DispatchedE4m3Rows::kSourceRows;
  const std::vector<uint8_t>& q = in.q;
  const std::vector<float>& s = in.s;
  const std::vector<int32_t>& row_src = in.row_src;
  const DeviceBuffer<uint8_t>& d_q = in.d_q;
  const DeviceBuffer<float>& d_s = in.d_s;
  const DeviceBuffer<float>& d_weight = in.d_weight;
  const DeviceBuffer<int32_t>& d_src = in.d_src;
  const DeviceBuffer<int32_t>& d_offsets = in.d_offsets;
  const int experts = static_cast<int>(kOffsets.size()) - 1;
  const int64_t columns = kernels::token_major_columns(kCapacity, experts);
  const int64_t pitch = kernels::fp8_scale_pitch(kCapacity), blocks = channels / 128;
  const int64_t used = kOffsets.back();
  for (const bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "with the routing weight" : "without a weight");
    const float* w = weighted ? d_weight.get() : nullptr;
    DeviceBuffer<uint8_t> qt(channels * columns), qt_twin(channels * columns), rows_q(kCapacity * channels);
    DeviceBuffer<kernels::TokenMajorScale> st(columns / 128 * channels), st_twin(columns / 128 * channels);
    DeviceBuffer<float> rows_s(blocks * pitch);
    const Status status = kernels::token_major_quantize_e4m3_gathering(
        d_q.get(), d_s.get(), kSourceRows, d_src.get(), w, channels, d_offsets.get(), experts, kCapacity, qt.get(),
        st.get(), rows_q.get(), rows_s.get(), pitch, nullptr);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    ASSERT_TRUE(kernels::token_major_quantize_e4m3(d_q.get(), d_s.get(), kSourceRows, d_src.get(), w, channels,
                                                   d_offsets.get(), experts, kCapacity, qt_twin.get(), st_twin.get(),
                                                   nullptr)
                    .is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(differing_bytes(qt.download(), qt_twin.download()), 0);
    EXPECT_EQ(differing_bytes(st.download(), st_twin.download()), 0);
    const std::vector<uint8_t> got_q = rows_q.download();
    const std::vector<float> got_s = rows_s.download();
    int64_t bad_q = 0, bad_s = 0, poison_lost = 0;
    for (int64_t r = 0; r < kCapacity; ++r) {
      const bool routed = r < used, valid = in.valid(r);
      for (int64_t c = 0; c < channels; ++c) {
        const uint8_t v = got_q[r * channels + c];
        if (!routed) poison_lost += v != 0xFF;
        else bad_q += v != (valid ? q[row_src[r] * channels + c] : 0);
      }
      for (int64_t kb = 0; kb < blocks; ++kb) {
        const uint32_t v = bits_of(got_s[kb * pitch + r]);
        if (!routed) poison_lost += v != 0xFFFFFFFFu;
        else bad_s += v != (valid ? bits_of(s[row_src[r] * blocks + kb]) : 0u);
      }
    }
    for (int64_t kb = 0; kb < blocks; ++kb)
      for (int64_t r = kCapacity; r < pitch; ++r) poison_lost += bits_of(got_s[kb * pitch + r]) != 0xFFFFFFFFu;
    EXPECT_EQ(bad_q, 0);
    EXPECT_EQ(bad_s, 0);
    EXPECT_EQ(poison_lost, 0) << "the copy wrote past the routed rows";
    // The valid rows are gather_rows_e4m3's bytes (the twin the layer ran before).
    DeviceBuffer<uint8_t> gathered_q(kCapacity * channels);
    DeviceBuffer<float> gathered_s(blocks * pitch);
    ASSERT_TRUE(kernels::gather_rows_e4m3(d_q.get(), d_s.get(), kSourceRows, d_src.get(), channels,
                                          d_offsets.get() + experts, kCapacity, gathered_q.get(), gathered_s.get(),
                                          pitch, nullptr)
                    .is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<uint8_t> twin_q = gathered_q.download();
    const std::vector<float> twin_s = gathered_s.download();
    int64_t differ = 0;
    for (int64_t r = 0; r < used; ++r) {
      if (!in.valid(r)) continue;
      differ += std::memcmp(&got_q[r * channels], &twin_q[r * channels], channels) != 0;
      for (int64_t kb = 0; kb < blocks; ++kb)
        differ += bits_of(got_s[kb * pitch + r]) != bits_of(twin_s[kb * pitch + r]);
    }
    EXPECT_EQ(differ, 0) << "rows or scales unlike gather_rows_e4m3's";
  }
}

TEST(Fp8TokenMajorGpuTest, GatheringFormIsTheGatherAndTheTokenMajorCopyBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  check_gathering_form(kChannels);
  check_gathering_form(768);
}

TEST(Fp8TokenMajorGpuTest, GatheredE4m3RowsMatchTheCpuRuleBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  check_gathered_e4m3_rows(kChannels);
  check_gathered_e4m3_rows(768);
}

// Random GEMM1 outputs h [capacity, 2I], dgrads g [capacity, I] and routing weights over the experts of
// kOffsets, on the host and uploaded (the seed is printed).
struct SwigluRowsProblem {
  int64_t I;
  int experts = static_cast<int>(kOffsets.size()) - 1;
  std::vector<float> h, g, w;
  DeviceBuffer<float> d_h, d_g, d_w;
  DeviceBuffer<int32_t> d_offsets;

  explicit SwigluRowsProblem(int64_t I)
      : I(I), h(kCapacity * 2 * I), g(kCapacity * I), w(kCapacity), d_h(h.size()), d_g(g.size()), d_w(w.size()),
        d_offsets(kOffsets.size()) {
    const uint32_t seed = std::random_device{}();
    std::printf("[fp8_token_major_test] seed %u\n", seed);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    for (float& v : h) v = normal(rng);
    for (float& v : g) v = normal(rng);
    for (float& v : w) v = std::fabs(normal(rng)) + 0.01f;
    d_h.upload(h);
    d_g.upload(g);
    d_w.upload(w);
    d_offsets.upload(kOffsets);
  }

  // The fp32 activation a [capacity, I] the SwiGLU-backward quantizer writes (a_out) for these rows.
  DeviceBuffer<float> activation() const {
    DeviceBuffer<float> a_out(kCapacity * I);
    DeviceBuffer<uint8_t> dh_q(kCapacity * 2 * I);
    DeviceBuffer<float> dh_s(2 * I / 128 * kCapacity);
    EXPECT_TRUE(kernels::swiglu_backward_quantize_rows_1x128(d_g.get(), d_h.get(), d_w.get(), kCapacity, I, nullptr,
                                                             dh_q.get(), dh_s.get(), kCapacity, a_out.get(), nullptr, 0,
                                                             nullptr)
                    .is_ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before dh_q and dh_s go
    return a_out;
  }
};

// The activation recomputed from h is bit for bit the fp32 a the SwiGLU-backward quantizer writes (a_out),
// taken through the fp32-rows path.
TEST(Fp8TokenMajorGpuTest, SwigluRowsAreTheActivationBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  constexpr int64_t I = 256;
  const SwigluRowsProblem in(I);
  const int64_t columns = kernels::token_major_columns(kCapacity, in.experts);
  const DeviceBuffer<float> a_out = in.activation();
  DeviceBuffer<uint8_t> via_rows(I * columns), via_h(I * columns);
  DeviceBuffer<kernels::TokenMajorScale> s_rows(columns / 128 * I), s_h(columns / 128 * I);
  ASSERT_TRUE(kernels::token_major_quantize_fp32(a_out.get(), I, in.d_offsets.get(), in.experts, kCapacity,
                                                 via_rows.get(), s_rows.get(), nullptr)
                  .is_ok());
  ASSERT_TRUE(kernels::token_major_quantize_swiglu(in.d_h.get(), I, in.d_offsets.get(), in.experts, kCapacity,
                                                   via_h.get(), s_h.get(), nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(differing_bytes(via_rows.download(), via_h.download()) + differing_bytes(s_rows.download(), s_h.download()),
            0);
}

// dh = SwiGLU'(w g) recomputed per routed row, against exact arithmetic in double: the GPU's fast sigmoid may
// move an element to its other E4M3 neighbour, nothing more.
TEST(Fp8TokenMajorGpuTest, SwigluGradRowsQuantizeTheSwigluBackward) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  constexpr int64_t I = 128;
  const SwigluRowsProblem in(I);
  const int experts = in.experts;
  const std::vector<float>& h = in.h;
  const std::vector<float>& g = in.g;
  const std::vector<float>& w = in.w;
  const int64_t columns = kernels::token_major_columns(kCapacity, experts);
  DeviceBuffer<uint8_t> qt(2 * I * columns);
  DeviceBuffer<kernels::TokenMajorScale> st(columns / 128 * 2 * I);
  ASSERT_TRUE(kernels::token_major_quantize_swiglu_grad(in.d_g.get(), in.d_h.get(), in.d_w.get(), I,
                                                        in.d_offsets.get(), experts, kCapacity, qt.get(), st.get(),
                                                        nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> q = qt.download();
  const std::vector<kernels::TokenMajorScale> s = st.download();
  double num = 0.0, den = 0.0;
  int64_t bad = 0;
  for (int e = 0; e < experts; ++e) {
    const int64_t start = kernels::token_major_start(kOffsets[e], e);
    for (int64_t r = kOffsets[e]; r < kOffsets[e + 1]; ++r) {
      const int64_t col = start + (r - kOffsets[e]);
      for (int64_t c = 0; c < 2 * I; ++c) {
        const int64_t j = c % I;
        const double gate = h[r * 2 * I + j], up = h[r * 2 * I + I + j];
        const double da = static_cast<double>(w[r]) * g[r * I + j];
        const double sg = 1.0 / (1.0 + std::exp(-gate));
        const double want = c < I ? da * up * sg * (1.0 + gate * (1.0 - sg)) : da * gate * sg;
        const double scale = kernels::token_major_scale_value(s[(col / 128) * 2 * I + c]);
        const double got = fp8::e4m3_to_float(q[c * columns + col]) * scale;
        num += (got - want) * (got - want);
        den += want * want;
        bad += !(std::fabs(got - want) <= 0.13 * std::fabs(want) + scale / 512.0);
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LE(std::sqrt(num / den), 0.05);
}

// Both SwiGLU copies from one read of g and h: a^T is the rule applied to the activation the SwiGLU-backward
// quantizer writes (a_out), and both copies are bit for bit what the two single quantizers write (dh^T's
// values are checked against exact arithmetic above). I = 384 is a whole and a partial run of channel slabs.
TEST(Fp8TokenMajorGpuTest, SwigluPairIsBothSwigluCopiesBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  constexpr int64_t I = 384;
  const SwigluRowsProblem in(I);
  const int64_t columns = kernels::token_major_columns(kCapacity, in.experts);
  const DeviceBuffer<float> a_out = in.activation();
  DeviceBuffer<uint8_t> at_pair(I * columns), at_single(I * columns);
  DeviceBuffer<uint8_t> dht_pair(2 * I * columns), dht_single(2 * I * columns);
  DeviceBuffer<kernels::TokenMajorScale> ats_pair(columns / 128 * I), ats_single(columns / 128 * I);
  DeviceBuffer<kernels::TokenMajorScale> dhts_pair(columns / 128 * 2 * I), dhts_single(columns / 128 * 2 * I);
  ASSERT_TRUE(kernels::token_major_quantize_swiglu_pair(in.d_g.get(), in.d_h.get(), in.d_w.get(), I,
                                                        in.d_offsets.get(), in.experts, kCapacity, at_pair.get(),
                                                        ats_pair.get(), dht_pair.get(), dhts_pair.get(), nullptr)
                  .is_ok());
  ASSERT_TRUE(kernels::token_major_quantize_swiglu(in.d_h.get(), I, in.d_offsets.get(), in.experts, kCapacity,
                                                   at_single.get(), ats_single.get(), nullptr)
                  .is_ok());
  ASSERT_TRUE(kernels::token_major_quantize_swiglu_grad(in.d_g.get(), in.d_h.get(), in.d_w.get(), I,
                                                        in.d_offsets.get(), in.experts, kCapacity, dht_single.get(),
                                                        dhts_single.get(), nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> a = a_out.download();
  expect_token_major(kOffsets, kCapacity, I, [&](int64_t r, int64_t c) { return a[r * I + c]; }, at_pair.download(),
                     ats_pair.download());
  EXPECT_EQ(differing_bytes(at_pair.download(), at_single.download()), 0);
  EXPECT_EQ(differing_bytes(ats_pair.download(), ats_single.download()), 0);
  EXPECT_EQ(differing_bytes(dht_pair.download(), dht_single.download()), 0);
  EXPECT_EQ(differing_bytes(dhts_pair.download(), dhts_single.download()), 0);
}

TEST(Fp8TokenMajorGpuTest, BadArgumentsAreRefused) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<float> rows(kCapacity * kChannels);
  DeviceBuffer<int32_t> offsets(kOffsets.size());
  DeviceBuffer<uint8_t> qt(kChannels * kernels::token_major_columns(kCapacity, 4) + 16);
  DeviceBuffer<kernels::TokenMajorScale> st(kChannels * kernels::token_major_columns(kCapacity, 4) / 128);
  EXPECT_EQ(kernels::token_major_quantize_fp32(rows.get(), 200, offsets.get(), 4, kCapacity, qt.get(), st.get(),
                                               nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::token_major_quantize_fp32(rows.get(), kChannels, offsets.get(), 0, kCapacity, qt.get(), st.get(),
                                               nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::token_major_quantize_fp32(rows.get(), kChannels, offsets.get(), 4, kCapacity, qt.get() + 1,
                                               st.get(), nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::token_major_quantize_e4m3(nullptr, nullptr, 10, nullptr, nullptr, kChannels, offsets.get(), 4,
                                               kCapacity, qt.get(), st.get(), nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  {  // the codes read 8 bytes at a time: q 8-byte aligned
    DeviceBuffer<uint8_t> q(10 * kChannels + 8);
    DeviceBuffer<float> scales(10 * kChannels / 128);
    DeviceBuffer<int32_t> row_src(kCapacity);
    EXPECT_EQ(kernels::token_major_quantize_e4m3(q.get() + 4, scales.get(), 10, row_src.get(), nullptr, kChannels,
                                                 offsets.get(), 4, kCapacity, qt.get(), st.get(), nullptr)
                  .code(),
              StatusCode::kInvalidArgument);
  }
  {  // the gathering form: its rows' scale pitch and alignment
    DeviceBuffer<uint8_t> q(10 * kChannels + 8), rows_q(kCapacity * kChannels + 8);
    DeviceBuffer<float> scales(10 * kChannels / 128), rows_s(kChannels / 128 * kernels::fp8_scale_pitch(kCapacity));
    DeviceBuffer<int32_t> row_src(kCapacity);
    const auto call = [&](int64_t pitch, uint8_t* out_q) {
      return kernels::token_major_quantize_e4m3_gathering(q.get(), scales.get(), 10, row_src.get(), nullptr, kChannels,
                                                          offsets.get(), 4, kCapacity, qt.get(), st.get(), out_q,
                                                          rows_s.get(), pitch, nullptr)
          .code();
    };
    EXPECT_EQ(call(kCapacity - 1, rows_q.get()), StatusCode::kInvalidArgument);
    EXPECT_EQ(call(kCapacity, rows_q.get() + 4), StatusCode::kInvalidArgument);
    EXPECT_EQ(call(kCapacity, nullptr), StatusCode::kInvalidArgument);
    const auto inputs = [&](const uint8_t* in_q, const float* in_s, float* out_s) {
      return kernels::token_major_quantize_e4m3_gathering(in_q, in_s, 10, row_src.get(), nullptr, kChannels,
                                                          offsets.get(), 4, kCapacity, qt.get(), st.get(),
                                                          rows_q.get(), out_s, kCapacity, nullptr)
          .code();
    };
    EXPECT_EQ(inputs(q.get() + 4, scales.get(), rows_s.get()), StatusCode::kInvalidArgument);  // q 8-byte aligned
    EXPECT_EQ(inputs(q.get(), nullptr, rows_s.get()), StatusCode::kInvalidArgument);
    EXPECT_EQ(inputs(q.get(), scales.get(), nullptr), StatusCode::kInvalidArgument);
    EXPECT_EQ(inputs(q.get(), scales.get(), rows_s.get()), StatusCode::kOk);  // the call itself is well formed
  }
  EXPECT_EQ(kernels::token_major_quantize_swiglu_pair(rows.get(), rows.get(), rows.get(), 128, offsets.get(), 4,
                                                      kCapacity, qt.get(), st.get(), qt.get() + 1, st.get(), nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace megamoe
