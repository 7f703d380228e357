#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/fp8_quantize.hpp"
#include "megamoe/fp8.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;
using testing::bits_of;

// The GPU quantiser must agree bit for bit with the CPU emulation, on values spanning many binades
// (so subnormal outputs, saturation at 448 and ties all occur) and on an all-zero group.
TEST(Fp8QuantizeGpuTest, MatchesCpuEmulationBitExactly) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t rows = 333;  // not a multiple of any tile
  const int64_t cols = 768;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_magnitude(-12.0f, 6.0f);
  std::vector<__nv_bfloat16> x_bf16(rows * cols);
  std::vector<float> x_float(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = normal(rng) * std::exp2(log_magnitude(rng));
    x_bf16[i] = __float2bfloat16(v);
    x_float[i] = __bfloat162float(x_bf16[i]);
  }
  for (int64_t c = 0; c < 128; ++c) {  // row 7, group 0: all zero
    x_bf16[7 * cols + c] = __float2bfloat16(0.0f);
    x_float[7 * cols + c] = 0.0f;
  }

  DeviceBuffer<__nv_bfloat16> x(rows * cols);
  DeviceBuffer<uint8_t> q(rows * cols);
  DeviceBuffer<float> scales(rows * cols / 128);
  x.upload(x_bf16);
  ASSERT_TRUE(kernels::quantize_rows_1x128_bf16(x.get(), rows, cols, q.get(), scales.get(), nullptr).is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());

  std::vector<uint8_t> q_ref(rows * cols);
  std::vector<float> scales_ref(rows * cols / 128);
  fp8::quantize_rows_1x128(x_float.data(), rows, cols, q_ref.data(), scales_ref.data());

  const std::vector<uint8_t> q_gpu = q.download();
  const std::vector<float> scales_gpu = scales.download();
  int64_t q_mismatches = 0;
  for (int64_t i = 0; i < rows * cols; ++i) q_mismatches += q_gpu[i] != q_ref[i];
  int64_t scale_mismatches = 0;
  for (size_t g = 0; g < scales_ref.size(); ++g) scale_mismatches += !(scales_gpu[g] == scales_ref[g]);
  EXPECT_EQ(q_mismatches, 0);
  EXPECT_EQ(scale_mismatches, 0);
  EXPECT_EQ(scales_gpu[7 * (cols / 128)], 1.0f);
}

// A [rows, cols] bf16 matrix whose 1x128 groups (row r, group g) and 128x128 blocks hold the special cases
// the quantisation rules name (include/megamoe/fp8.hpp), the rest random over many binades.
std::vector<__nv_bfloat16> special_values(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_magnitude(-20.0f, 10.0f);
  std::vector<__nv_bfloat16> x(rows * cols);
  for (auto& v : x) v = __float2bfloat16(normal(rng) * std::exp2(log_magnitude(rng)));
  auto group = [&](int64_t r, int64_t g, auto value) {
    for (int64_t c = 0; c < 128; ++c) x[r * cols + g * 128 + c] = __float2bfloat16(value(c));
  };
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  group(0, 0, [](int64_t) { return 0.0f; });                                      // all zero: scale 1
  group(1, 0, [&](int64_t) { return nan; });                                      // all NaN: amax 0, scale 1
  group(2, 0, [&](int64_t c) { return c == 5 ? nan : 1.0f + c; });                // one NaN among finite values
  group(3, 0, [&](int64_t c) { return c == 9 ? -inf : 1.0f; });                   // infinity: scale inf
  group(4, 0, [](int64_t c) { return c % 2 ? 448.0f : -448.0f * (c / 127.0f); }); // amax exactly 448: scale 1
  group(5, 0, [](int64_t c) { return std::ldexp(1.0f, -static_cast<int>(c % 24)); });  // 2^0 .. 2^-23: e4m3
                                                                                         // subnormals, zeros
  group(6, 0, [](int64_t c) { return c % 3 ? -0.0f : 0.0f; });                   // signed zeros
  group(7, 1, [](int64_t c) { return 1e30f * (c - 64); });                         // huge magnitudes
  return x;
}

TEST(Fp8QuantizeGpuTest, SpecialValuesFollowTheCpuRules) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t rows = 200, cols = 384;  // a partial 128-row block at the bottom
  const std::vector<__nv_bfloat16> x_bf16 = special_values(rows, cols, std::random_device{}());
  std::vector<float> x_float(x_bf16.size());
  for (size_t i = 0; i < x_bf16.size(); ++i) x_float[i] = __bfloat162float(x_bf16[i]);
  DeviceBuffer<__nv_bfloat16> x(rows * cols);
  x.upload(x_bf16);
  auto compare = [](const std::vector<uint8_t>& q, const std::vector<uint8_t>& q_ref, const std::vector<float>& s,
                    const std::vector<float>& s_ref, const char* what) {
    int64_t q_bad = 0, s_bad = 0;
    for (size_t i = 0; i < q.size(); ++i) q_bad += q[i] != q_ref[i];
    for (size_t i = 0; i < s.size(); ++i) s_bad += bits_of(s[i]) != bits_of(s_ref[i]);
    EXPECT_EQ(q_bad, 0) << what << ": e4m3 bytes";
    EXPECT_EQ(s_bad, 0) << what << ": scales";
  };
  {  // activations, 1x128 groups, row-major scales
    DeviceBuffer<uint8_t> q(rows * cols);
    DeviceBuffer<float> scales(rows * cols / 128);
    ASSERT_TRUE(kernels::quantize_rows_1x128_bf16(x.get(), rows, cols, q.get(), scales.get(), nullptr).is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint8_t> q_ref(rows * cols);
    std::vector<float> s_ref(rows * cols / 128);
    fp8::quantize_rows_1x128(x_float.data(), rows, cols, q_ref.data(), s_ref.data());
    compare(q.download(), q_ref, scales.download(), s_ref, "1x128");
    EXPECT_EQ(s_ref[0], 1.0f);
    EXPECT_EQ(s_ref[1 * 3], 1.0f);
    EXPECT_TRUE(std::isinf(s_ref[3 * 3]));
    EXPECT_EQ(s_ref[4 * 3], 1.0f);
  }
  {  // weights, 128x128 blocks
    DeviceBuffer<uint8_t> q(rows * cols);
    DeviceBuffer<float> scales(2 * cols / 128);
    ASSERT_TRUE(kernels::quantize_blocks_128x128_bf16(x.get(), rows, cols, q.get(), scales.get(), nullptr).is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint8_t> q_ref(rows * cols);
    std::vector<float> s_ref(2 * cols / 128);
    fp8::quantize_blocks_128x128(x_float.data(), rows, cols, q_ref.data(), s_ref.data());
    compare(q.download(), q_ref, scales.download(), s_ref, "128x128");
  }
}

// The K-block-major layout the FP8 GEMM reads: group (r, kb) at kb * pitch + r; the padding is untouched.
TEST(Fp8QuantizeGpuTest, KBlockMajorScales) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t rows = 77, cols = 512, pitch = 80;
  const std::vector<__nv_bfloat16> x_bf16 = special_values(rows, cols, std::random_device{}());
  std::vector<float> x_float(x_bf16.size());
  for (size_t i = 0; i < x_bf16.size(); ++i) x_float[i] = __bfloat162float(x_bf16[i]);
  DeviceBuffer<__nv_bfloat16> x(rows * cols);
  DeviceBuffer<uint8_t> q(rows * cols);
  DeviceBuffer<float> scales(pitch * cols / 128);  // NaN-poisoned
  x.upload(x_bf16);
  ASSERT_TRUE(kernels::quantize_rows_1x128_bf16(x.get(), rows, cols, q.get(), scales.get(), nullptr, pitch).is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> q_ref(rows * cols);
  std::vector<float> s_ref(rows * cols / 128);
  fp8::quantize_rows_1x128(x_float.data(), rows, cols, q_ref.data(), s_ref.data());
  const std::vector<float> got = scales.download();
  const std::vector<uint8_t> q_got = q.download();
  int64_t bad = 0, written_padding = 0;
  for (int64_t kb = 0; kb < cols / 128; ++kb) {
    for (int64_t r = 0; r < rows; ++r) bad += bits_of(got[kb * pitch + r]) != bits_of(s_ref[r * (cols / 128) + kb]);
    for (int64_t r = rows; r < pitch; ++r) written_padding += !std::isnan(got[kb * pitch + r]);
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(written_padding, 0);
  EXPECT_EQ(0, std::memcmp(q_got.data(), q_ref.data(), q_ref.size()));
  EXPECT_EQ(kernels::quantize_rows_1x128_bf16(x.get(), rows, cols, q.get(), scales.get(), nullptr, rows - 1).code(),
            StatusCode::kInvalidArgument);
}

TEST(Fp8QuantizeGpuTest, RejectsColumnsNotMultipleOf128) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<__nv_bfloat16> x(4 * 100);
  DeviceBuffer<uint8_t> q(4 * 100);
  DeviceBuffer<float> scales(4);
  const Status status = kernels::quantize_rows_1x128_bf16(x.get(), 4, 100, q.get(), scales.get(), nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("multiple of 128"), std::string::npos) << status.message();
}

// GEMM1's h to GEMM2's FP8 operand: a = silu(g) * u quantized per 1x128 group along I, scales K-block-major.
// The GPU's fp32 a comes from its fast sigmoid, so the check is against the exact a (double) within what
// E4M3 rounding allows (half a step: 1/16 of the value, or half the smallest subnormal step of the group's
// scale) plus the scale's own rounding; the scale must be amax / 448 of the exact a to 1e-5, an all-zero
// group must get scale 1 and zero bytes, and rows past rows_used must stay untouched.
TEST(Fp8QuantizeGpuTest, SwigluQuantizeMatchesExactActivation) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t rows = 37, I = 384, used = 30;
  const int64_t pitch = rows + 3;  // not the rows: the K-block-major stride is honoured
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_magnitude(-6.0f, 3.0f);
  std::vector<float> h(static_cast<size_t>(rows * 2 * I));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t kb = 0; kb < I / 128; ++kb) {
      const float mg = std::exp2(log_magnitude(rng)), mu = std::exp2(log_magnitude(rng));  // per group
      for (int64_t c = kb * 128; c < (kb + 1) * 128; ++c) {
        h[r * 2 * I + c] = normal(rng) * mg;
        h[r * 2 * I + I + c] = normal(rng) * mu;
      }
    }
  }
  for (int64_t c = 128; c < 256; ++c) h[5 * 2 * I + c] = 0.0f;  // row 5, group 1: a == 0
  DeviceBuffer<float> dh(h.size());
  DeviceBuffer<uint8_t> aq(static_cast<size_t>(rows * I));  // poisoned: 0xFF
  DeviceBuffer<float> scales(static_cast<size_t>(pitch * (I / 128)));
  DeviceBuffer<int32_t> rows_used(1);
  dh.upload(h);
  rows_used.upload({static_cast<int32_t>(used)});
  ASSERT_TRUE(kernels::swiglu_quantize_rows_1x128(dh.get(), rows, I, rows_used.get(), aq.get(), scales.get(), pitch,
                                                  nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> q = aq.download();
  const std::vector<float> sc = scales.download();
  int64_t bad_scales = 0, bad_values = 0, written_past = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t kb = 0; kb < I / 128; ++kb) {
      const float scale = sc[kb * pitch + r];
      if (r >= used) {
        written_past += !std::isnan(scale);
        for (int64_t c = kb * 128; c < (kb + 1) * 128; ++c) written_past += q[r * I + c] != 0xFF;
        continue;
      }
      double a[128], amax = 0.0;
      for (int c = 0; c < 128; ++c) {
        const double g = h[r * 2 * I + kb * 128 + c];
        const double u = h[r * 2 * I + I + kb * 128 + c];
        a[c] = g / (1.0 + std::exp(-g)) * u;
        amax = std::max(amax, std::fabs(a[c]));
      }
      const double want_scale = amax > 0.0 ? amax / 448.0 : 1.0;
      if (!(std::fabs(scale - want_scale) <= 1e-5 * want_scale)) ++bad_scales;
      for (int c = 0; c < 128; ++c) {
        const double got = static_cast<double>(fp8::e4m3_to_float(q[r * I + kb * 128 + c])) * scale;
        const double bound = std::fabs(a[c]) / 16.0 + scale * std::exp2(-10.0) + 1e-5 * amax;
        if (!(std::fabs(got - a[c]) <= bound)) ++bad_values;
      }
    }
  }
  EXPECT_EQ(bad_scales, 0);
  EXPECT_EQ(bad_values, 0);
  EXPECT_EQ(written_past, 0) << "rows past rows_used were written";
  EXPECT_EQ(sc[1 * pitch + 5], 1.0f) << "an all-zero group has scale 1";
  for (int64_t c = 128; c < 256; ++c) EXPECT_EQ(q[5 * I + c] & 0x7F, 0) << "an all-zero group quantizes to zeros";
  // Without rows_used every row is written.
  ASSERT_TRUE(
      kernels::swiglu_quantize_rows_1x128(dh.get(), rows, I, nullptr, aq.get(), scales.get(), pitch, nullptr).is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> sc_all = scales.download();
  int64_t unwritten = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < I / 128; ++kb) unwritten += std::isnan(sc_all[kb * pitch + r]);
  EXPECT_EQ(unwritten, 0);
  const Status bad = kernels::swiglu_quantize_rows_1x128(dh.get(), rows, 100, nullptr, aq.get(), scales.get(), pitch,
                                                         nullptr);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::swiglu_quantize_rows_1x128(dh.get(), rows, I, nullptr, aq.get(), scales.get(), rows - 1, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
}

// The FP8 backward's step between its dgrads: dh = SwiGLU'(w g) from the fp32 h, quantized 1x128 along 2I
// (gate and up groups apart), a, and <g, a> into the row's first partial. Checked against the exact
// arithmetic (double, exact sigmoid) within E4M3 rounding for dh, to 1e-5 for the rest; rows past rows_used
// and rows without a partials pointer are left alone.
TEST(Fp8QuantizeGpuTest, SwigluBackwardQuantizeMatchesExactArithmetic) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t rows = 29, I = 256, used = 25, parts = 3;
  const int64_t pitch = rows + 3;
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_magnitude(-5.0f, 3.0f), weight(0.05f, 1.0f);
  std::vector<float> g(static_cast<size_t>(rows * I)), h(static_cast<size_t>(rows * 2 * I)), w(rows);
  for (int64_t r = 0; r < rows; ++r) {
    w[r] = weight(rng);
    const float mg = std::exp2(log_magnitude(rng)), mh = std::exp2(log_magnitude(rng));
    for (int64_t c = 0; c < I; ++c) g[r * I + c] = normal(rng) * mg;
    for (int64_t c = 0; c < 2 * I; ++c) h[r * 2 * I + c] = normal(rng) * mh;
  }
  DeviceBuffer<float> dg(g.size()), dh_in(h.size()), dw(w.size()), dh_s(static_cast<size_t>(pitch * (2 * I / 128)));
  DeviceBuffer<float> a_out(g.size()), partials(static_cast<size_t>(rows * parts));
  DeviceBuffer<uint8_t> dh_q(h.size());
  DeviceBuffer<int32_t> rows_used(1);
  dg.upload(g);
  dh_in.upload(h);
  dw.upload(w);
  rows_used.upload({static_cast<int32_t>(used)});
  std::vector<float*> dot_rows(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) dot_rows[r] = r == 3 ? nullptr : partials.get() + r * parts;
  DeviceBuffer<float*> d_dot_rows(dot_rows.size());
  d_dot_rows.upload(dot_rows);
  ASSERT_TRUE(kernels::swiglu_backward_quantize_rows_1x128(dg.get(), dh_in.get(), dw.get(), rows, I, rows_used.get(),
                                                           dh_q.get(), dh_s.get(), pitch, a_out.get(),
                                                           d_dot_rows.get(), static_cast<int>(parts), nullptr)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> q = dh_q.download();
  const std::vector<float> sc = dh_s.download(), got_a = a_out.download(), got_dots = partials.download();
  int64_t bad_scales = 0, bad_values = 0, bad_a = 0, bad_dots = 0, written_past = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (r >= used) {
      for (int64_t c = 0; c < 2 * I; ++c) written_past += q[r * 2 * I + c] != 0xFF;
      for (int64_t c = 0; c < I; ++c) written_past += !std::isnan(got_a[r * I + c]);
      for (int64_t kb = 0; kb < 2 * I / 128; ++kb) written_past += !std::isnan(sc[kb * pitch + r]);
      for (int64_t p = 0; p < parts; ++p) written_past += !std::isnan(got_dots[r * parts + p]);
      continue;
    }
    std::vector<double> dh(static_cast<size_t>(2 * I));
    double dot = 0, dot_mag = 0;
    for (int64_t c = 0; c < I; ++c) {
      const double gg = h[r * 2 * I + c], uu = h[r * 2 * I + I + c], s = 1.0 / (1.0 + std::exp(-gg));
      const double da = static_cast<double>(w[r]) * g[r * I + c], a = gg * s * uu;
      dh[c] = da * uu * s * (1.0 + gg * (1.0 - s));
      dh[I + c] = da * gg * s;
      dot += g[r * I + c] * a;
      dot_mag += std::fabs(g[r * I + c] * a);
      if (!(std::fabs(got_a[r * I + c] - a) <= 1e-5 * std::fabs(a) + 1e-30)) ++bad_a;
    }
    for (int64_t kb = 0; kb < 2 * I / 128; ++kb) {
      double amax = 0;
      for (int c = 0; c < 128; ++c) amax = std::max(amax, std::fabs(dh[kb * 128 + c]));
      const double want_scale = amax > 0 ? amax / 448.0 : 1.0;
      const float scale = sc[kb * pitch + r];
      if (!(std::fabs(scale - want_scale) <= 1e-5 * want_scale)) ++bad_scales;
      for (int c = 0; c < 128; ++c) {
        const double v = dh[kb * 128 + c];
        const double got = static_cast<double>(fp8::e4m3_to_float(q[r * 2 * I + kb * 128 + c])) * scale;
        if (!(std::fabs(got - v) <= std::fabs(v) / 16.0 + scale * std::exp2(-10.0) + 1e-5 * amax)) ++bad_values;
      }
    }
    if (r == 3) {
      for (int64_t p = 0; p < parts; ++p) written_past += !std::isnan(got_dots[r * parts + p]);
    } else {
      // The fast sigmoid's few-ulp error per term, plus fp32 summation over I terms (at most I * 2^-23 of the
      // magnitudes).
      if (!(std::fabs(got_dots[r * parts] - dot) <= (1e-5 + static_cast<double>(I) * std::exp2(-23.0)) * dot_mag + 1e-30))
        ++bad_dots;
      for (int64_t p = 1; p < parts; ++p) bad_dots += got_dots[r * parts + p] != 0.0f;
    }
  }
  EXPECT_EQ(bad_scales, 0);
  EXPECT_EQ(bad_values, 0);
  EXPECT_EQ(bad_a, 0);
  EXPECT_EQ(bad_dots, 0);
  EXPECT_EQ(written_past, 0) << "rows past rows_used, or without a partials pointer, were written";
  EXPECT_EQ(kernels::swiglu_backward_quantize_rows_1x128(dg.get(), dh_in.get(), dw.get(), rows, I, nullptr, dh_q.get(),
                                                         dh_s.get(), pitch, a_out.get(), d_dot_rows.get(), 0, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
}

// Expert weights quantized in 128 x 128 blocks and transposed on the GPU must be bit for bit the CPU
// quantization of the transposed matrices (values and scales), for every expert.
TEST(Fp8QuantizeGpuTest, TransposedBlocksAreTheTransposeQuantized) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int64_t E = 3, N = 256, K = 384;
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_magnitude(-8.0f, 4.0f);
  std::vector<__nv_bfloat16> w(static_cast<size_t>(E * N * K));
  std::vector<float> w_float(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = __float2bfloat16(normal(rng) * std::exp2(log_magnitude(rng)));
    w_float[i] = __bfloat162float(w[i]);
  }
  DeviceBuffer<__nv_bfloat16> dw(w.size());
  DeviceBuffer<uint8_t> q(w.size()), qt(w.size());
  const int64_t blocks = E * (N / 128) * (K / 128);
  DeviceBuffer<float> s(blocks), st(blocks);
  dw.upload(w);
  ASSERT_TRUE(kernels::quantize_blocks_128x128_bf16(dw.get(), E * N, K, q.get(), s.get(), nullptr).is_ok());
  ASSERT_TRUE(kernels::transpose_blocks_128x128_e4m3(q.get(), s.get(), E, N, K, qt.get(), st.get(), nullptr).is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> got_q = qt.download();
  const std::vector<float> got_s = st.download();
  int64_t q_mismatches = 0, s_mismatches = 0;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<float> wt(static_cast<size_t>(K * N));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) wt[k * N + n] = w_float[(e * N + n) * K + k];
    std::vector<uint8_t> want_q(wt.size());
    std::vector<float> want_s(static_cast<size_t>((K / 128) * (N / 128)));
    fp8::quantize_blocks_128x128(wt.data(), K, N, want_q.data(), want_s.data());
    for (size_t i = 0; i < want_q.size(); ++i) q_mismatches += got_q[e * K * N + i] != want_q[i];
    for (size_t i = 0; i < want_s.size(); ++i) s_mismatches += !(got_s[e * want_s.size() + i] == want_s[i]);
  }
  EXPECT_EQ(q_mismatches, 0);
  EXPECT_EQ(s_mismatches, 0);
  EXPECT_EQ(kernels::transpose_blocks_128x128_e4m3(q.get(), s.get(), E, N, 200, qt.get(), st.get(), nullptr).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace megamoe
