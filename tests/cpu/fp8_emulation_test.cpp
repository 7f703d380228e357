#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "megamoe/fp8.hpp"

namespace megamoe::fp8 {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Test oracle built from the format definition, independent of the implementation's bit tricks: every
// finite non-negative E4M3 value as (code, value), codes 0x00..0x7E.
struct Candidate {
  uint8_t code;
  double value;
};

std::vector<Candidate> finite_non_negative_values() {
  std::vector<Candidate> out;
  for (int code = 0; code <= 0x7E; ++code) {
    const int e = code >> 3;
    const int m = code & 7;
    const double v = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    out.push_back({static_cast<uint8_t>(code), v});
  }
  return out;
}

// Nearest finite E4M3 value by exhaustive search; equal distances go to the even code. Anything past 448
// is nearest to 448 itself, which is what satfinite gives.
uint8_t brute_force_e4m3(float value) {
  static const std::vector<Candidate> candidates = finite_non_negative_values();
  const double magnitude = std::fabs(static_cast<double>(value));
  uint8_t best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (const Candidate& c : candidates) {
    const double distance = std::fabs(magnitude - c.value);
    if (distance < best_distance || (distance == best_distance && (c.code & 1) == 0)) {
      best = c.code;
      best_distance = distance;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(value) ? 0x80 : 0x00));
}

bool same_bits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

TEST(Fp8Conversion, KnownValues) {
  const float sub1 = std::ldexp(1.0f, -9);  // smallest subnormal
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(463.99f), 0x7E);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(480.0f), 0x7E);  // would be the NaN pattern without saturation
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7E);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(float_to_e4m3(-448.0f), 0xFE);
  EXPECT_EQ(float_to_e4m3(-1e6f), 0xFE);
  EXPECT_EQ(float_to_e4m3(sub1), 0x01);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);              // exact tie with 0 -> even
  EXPECT_EQ(float_to_e4m3(-std::ldexp(1.0f, -10)), 0x80);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10) * 1.0001f), 0x01);
  EXPECT_EQ(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 0.0f)), 0x00);
  EXPECT_EQ(float_to_e4m3(1.5f * sub1), 0x02);   // tie between subnormals 1 and 2 -> even
  EXPECT_EQ(float_to_e4m3(2.5f * sub1), 0x02);   // tie between subnormals 2 and 3 -> even
  EXPECT_EQ(float_to_e4m3(7.5f * sub1), 0x08);   // tie between subnormal 7 and min normal -> even
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -6)), 0x08);  // min normal
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);   // tie 1.0 / 1.125 -> 1.0 (even)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);   // tie 1.125 / 1.25 -> 1.25 (even)
  EXPECT_EQ(float_to_e4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(float_to_e4m3(1.9375f), 0x40);   // tie 1.875 / 2.0 -> 2.0, carrying into the next binade
  EXPECT_EQ(float_to_e4m3(1.96f), 0x40);
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(float_to_e4m3(kNaN), 0x7F);
  EXPECT_EQ(float_to_e4m3(-kNaN), 0x7F);  // sign of NaN is dropped, as the hardware does
  EXPECT_EQ(float_to_e4m3(kInf), 0x7E);
  EXPECT_EQ(float_to_e4m3(-kInf), 0xFE);
  EXPECT_EQ(round_to_e4m3(1.0625f), 1.0f);
  EXPECT_EQ(round_to_e4m3(1.1875f), 1.25f);
}

TEST(Fp8Conversion, DecodeAllCodes) {
  const std::vector<Candidate> candidates = finite_non_negative_values();
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float decoded = e4m3_to_float(code);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(decoded)) << "code " << c;
      continue;
    }
    const double expected = (c & 0x80 ? -1.0 : 1.0) * candidates[c & 0x7F].value;
    EXPECT_EQ(static_cast<double>(decoded), expected) << "code " << c;
    EXPECT_EQ(std::signbit(decoded), (c & 0x80) != 0) << "code " << c;  // includes -0 for 0x80
    EXPECT_EQ(float_to_e4m3(decoded), code) << "round trip of code " << c;
  }
  for (int c = 1; c <= 0x7E; ++c) {
    EXPECT_LT(e4m3_to_float(static_cast<uint8_t>(c - 1)), e4m3_to_float(static_cast<uint8_t>(c))) << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), kE4M3Max);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
}

// Every rounding boundary: each representable value, the midpoint to its neighbour, and one float ulp on
// either side of both. This is where an off-by-one in rounding would show.
TEST(Fp8Conversion, MatchesBruteForceAtEveryBoundary) {
  const std::vector<Candidate> candidates = finite_non_negative_values();
  std::vector<float> probes;
  auto add_with_neighbours = [&](float v) {
    probes.push_back(v);
    probes.push_back(std::nextafter(v, 0.0f));
    probes.push_back(std::nextafter(v, kInf));
  };
  for (size_t i = 0; i < candidates.size(); ++i) {
    add_with_neighbours(static_cast<float>(candidates[i].value));
    const double next = i + 1 < candidates.size() ? candidates[i + 1].value : 480.0;  // 480: saturation edge
    add_with_neighbours(static_cast<float>((candidates[i].value + next) / 2.0));  // exact in float
  }
  add_with_neighbours(480.0f);
  add_with_neighbours(496.0f);
  add_with_neighbours(512.0f);
  for (float p : probes) {
    EXPECT_EQ(float_to_e4m3(p), brute_force_e4m3(p)) << "value " << p;
    EXPECT_EQ(float_to_e4m3(-p), brute_force_e4m3(-p)) << "value " << -p;
  }
}

TEST(Fp8Conversion, MatchesBruteForceOnRandomFloats) {
  std::mt19937 rng(1234);
  // Exponents from well below the smallest subnormal's half to past the saturation point, all mantissas.
  std::uniform_int_distribution<int> exponent(-14, 10);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFFFFFFu);
  for (int i = 0; i < 300000; ++i) {
    const uint32_t mantissa_and_sign = bits(rng) & 0x807FFFFFu;
    const uint32_t biased = static_cast<uint32_t>(exponent(rng) + 127) << 23;
    const float v = std::bit_cast<float>(mantissa_and_sign | biased);
    ASSERT_EQ(float_to_e4m3(v), brute_force_e4m3(v)) << "value " << v;
  }
  // Fully random bit patterns too (float subnormals, huge values, inf, NaN).
  for (int i = 0; i < 100000; ++i) {
    const float v = std::bit_cast<float>(bits(rng));
    const uint8_t expected = std::isnan(v) ? uint8_t{0x7F} : brute_force_e4m3(v);
    ASSERT_EQ(float_to_e4m3(v), expected) << "bits " << std::bit_cast<uint32_t>(v);
  }
}

TEST(Fp8Scale, FromAmax) {
  EXPECT_EQ(scale_from_amax(448.0f), 1.0f);
  EXPECT_EQ(scale_from_amax(3.0f), 3.0f / 448.0f);
  EXPECT_EQ(scale_from_amax(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(scale_from_amax(kNaN)));
  EXPECT_EQ(scale_from_amax(kInf), kInf);
}

// The power-of-two rule against its definition in doubles: the smallest 2^k (k >= -126) with 448 2^k >= amax.
TEST(Fp8Scale, PowerOfTwoFromAmax) {
  const auto by_definition = [](float amax) {
    int k = -126;
    while (448.0 * std::ldexp(1.0, k) < static_cast<double>(amax)) ++k;
    return static_cast<float>(std::ldexp(1.0, k));
  };
  EXPECT_EQ(power_of_two_scale_from_amax(448.0f), 1.0f);
  EXPECT_EQ(power_of_two_scale_from_amax(std::nextafter(448.0f, 1000.0f)), 2.0f);
  EXPECT_EQ(power_of_two_scale_from_amax(224.0f), 0.5f);
  EXPECT_EQ(power_of_two_scale_from_amax(std::nextafter(224.0f, 1000.0f)), 1.0f);
  EXPECT_EQ(power_of_two_scale_from_amax(3.0f), 1.0f / 128.0f);  // 448 / 128 = 3.5 >= 3 > 1.75
  EXPECT_EQ(power_of_two_scale_from_amax(0.0f), 1.0f);
  EXPECT_EQ(power_of_two_scale_from_amax(std::numeric_limits<float>::denorm_min()), std::ldexp(1.0f, -126));
  EXPECT_EQ(power_of_two_scale_from_amax(std::numeric_limits<float>::max()), std::ldexp(1.0f, 120));
  EXPECT_TRUE(std::isnan(power_of_two_scale_from_amax(kNaN)));
  EXPECT_EQ(power_of_two_scale_from_amax(kInf), kInf);
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits(1u, 0x7f7fffffu);  // every positive finite float
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::bit_cast<float>(bits(rng));
    const float scale = power_of_two_scale_from_amax(amax);
    ASSERT_EQ(scale, by_definition(amax)) << "amax bits " << std::bit_cast<uint32_t>(amax);
    ASSERT_GE(scale, scale_from_amax(amax)) << "never finer than amax / 448";
  }
}

TEST(Fp8Scale, RowsLayout) {
  constexpr int64_t rows = 3, cols = 256;
  std::vector<float> x(rows * cols);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (float& v : x) v = unit(rng);
  // A distinct amax per group, at a distinct position, with either sign.
  const float amax[rows][2] = {{3.0f, 0.25f}, {17.5f, 1.5f}, {2.0f, 1000.0f}};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < 2; ++g) {
      x[r * cols + g * kGroup + (r * 37 + g * 11) % kGroup] = ((r + g) % 2 ? -1.0f : 1.0f) * amax[r][g];
    }
  }
  // Keep the other elements below every amax.
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < 2; ++g) {
      for (int64_t i = 0; i < kGroup; ++i) {
        float& v = x[r * cols + g * kGroup + i];
        if (std::fabs(v) != amax[r][g]) v *= amax[r][g] * 0.5f;
      }
    }
  }
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scales(rows * 2, -1.0f);
  quantize_rows_1x128(x.data(), rows, cols, q.data(), scales.data());
  std::vector<float> back(rows * cols);
  dequantize_rows_1x128(q.data(), scales.data(), rows, cols, back.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < 2; ++g) {
      EXPECT_EQ(scales[r * 2 + g], amax[r][g] / 448.0f) << r << "," << g;
      const int64_t at = r * cols + g * kGroup + (r * 37 + g * 11) % kGroup;
      EXPECT_EQ(q[at] & 0x7F, 0x7E);
      EXPECT_NEAR(back[at], x[at], amax[r][g] * 1e-6f);
    }
  }
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (std::fabs(x[i] / scales[(i / cols) * 2 + (i % cols) / kGroup]) >= std::ldexp(1.0f, -6)) {
      EXPECT_LE(std::fabs(back[i] - x[i]), std::fabs(x[i]) * (0.0625f + 1e-6f)) << i;
    }
  }
}

TEST(Fp8Scale, BlocksLayoutWithPartialRowBlock) {
  constexpr int64_t rows = 200, cols = 256;
  // Rows past 200 hold a huge value: a block amax that read them would show it.
  std::vector<float> w(256 * cols, 1e6f);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> magnitude(1.0f / 64.0f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  const float amax[2][2] = {{5.0f, 0.125f}, {40.0f, 2.5f}};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      // Strictly below the block amax, and at most 64x below it, so every element is an E4M3 normal.
      w[r * cols + c] = (negative(rng) ? -1.0f : 1.0f) * magnitude(rng) * 0.99f * amax[r / kGroup][c / kGroup];
    }
  }
  w[5 * cols + 3] = amax[0][0];
  w[127 * cols + 255] = -amax[0][1];
  w[199 * cols + 0] = amax[1][0];   // last valid row of the partial block
  w[130 * cols + 200] = -amax[1][1];
  // Padded like w, so that writing past the last row shows up as a changed sentinel, not a heap overrun.
  std::vector<uint8_t> q(256 * cols, 0xAA);
  std::vector<float> scales(4, -1.0f);
  quantize_blocks_128x128(w.data(), rows, cols, q.data(), scales.data());
  for (int64_t rb = 0; rb < 2; ++rb) {
    for (int64_t cb = 0; cb < 2; ++cb) EXPECT_EQ(scales[rb * 2 + cb], amax[rb][cb] / 448.0f) << rb << cb;
  }
  for (int64_t i = rows * cols; i < 256 * cols; ++i) ASSERT_EQ(q[i], 0xAA) << "wrote past the last row at " << i;
  std::vector<float> back(rows * cols);
  dequantize_blocks_128x128(q.data(), scales.data(), rows, cols, back.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_LE(std::fabs(back[i] - w[i]), std::fabs(w[i]) * (0.0625f + 1e-6f)) << i;
  }
  EXPECT_NEAR(back[199 * cols], amax[1][0], amax[1][0] * 1e-6f);
}

// q must be e4m3(v / scale) with a true fp32 division: multiplying by a rounded 1/scale lands on the other
// side of a rounding boundary for some inputs. Such inputs are searched for here (values placed just at
// E4M3 midpoints times the scale), so the test is sure to contain cases that tell the two apart.
TEST(Fp8Scale, QuantizeUsesTrueDivision) {
  const std::vector<Candidate> candidates = finite_non_negative_values();
  std::vector<float> x(kGroup, 0.0f);
  float amax = 0.0f;
  int discriminating = 0;
  for (int attempt = 0; attempt < 1000 && discriminating < kGroup - 1; ++attempt) {
    amax = 1.0f + static_cast<float>(attempt) * 0.0137f;
    const float scale = amax / 448.0f;
    discriminating = 0;
    for (size_t i = 8; i + 1 < candidates.size() && discriminating < kGroup - 1; ++i) {
      const float midpoint = static_cast<float>((candidates[i].value + candidates[i + 1].value) / 2.0);
      for (float v = std::nextafter(midpoint * scale, 0.0f), end = std::nextafter(midpoint * scale, kInf);
           v <= std::nextafter(end, kInf); v = std::nextafter(v, kInf)) {
        if (float_to_e4m3(v / scale) != float_to_e4m3(v * (1.0f / scale)) && v < amax) {
          x[static_cast<size_t>(++discriminating)] = v;
          break;
        }
      }
    }
    if (discriminating >= 8) break;
  }
  ASSERT_GE(discriminating, 8) << "no inputs found where division and reciprocal multiply differ";
  x[0] = amax;
  std::vector<uint8_t> q(kGroup);
  float scale = 0.0f;
  quantize_rows_1x128(x.data(), 1, kGroup, q.data(), &scale);
  ASSERT_EQ(scale, amax / 448.0f);
  for (int64_t i = 0; i < kGroup; ++i) EXPECT_EQ(q[i], float_to_e4m3(x[i] / scale)) << i << ": " << x[i];
}

TEST(Fp8Scale, ZeroGroupHasUnitScale) {
  constexpr int64_t rows = 2, cols = 256;
  std::vector<float> x(rows * cols, 0.0f);
  x[1 * cols + 200] = -0.0f;
  for (int64_t i = 0; i < kGroup; ++i) x[i] = 1.0f + static_cast<float>(i);  // group (0,0) nonzero only
  std::vector<uint8_t> q(rows * cols, 0xAA);
  std::vector<float> scales(rows * 2, -1.0f);
  quantize_rows_1x128(x.data(), rows, cols, q.data(), scales.data());
  EXPECT_EQ(scales[0], 128.0f / 448.0f);
  EXPECT_EQ(scales[1], 1.0f);
  EXPECT_EQ(scales[2], 1.0f);
  EXPECT_EQ(scales[3], 1.0f);
  for (int64_t i = kGroup; i < rows * cols; ++i) EXPECT_EQ(q[i] & 0x7F, 0) << i;
  EXPECT_EQ(q[1 * cols + 200], 0x80);

  std::vector<float> w(130 * cols, 0.0f);
  std::vector<uint8_t> wq(130 * cols, 0xAA);
  std::vector<float> wscales(4, -1.0f);
  quantize_blocks_128x128(w.data(), 130, cols, wq.data(), wscales.data());
  for (float s : wscales) EXPECT_EQ(s, 1.0f);
  for (uint8_t v : wq) EXPECT_EQ(v, 0);
}

TEST(Fp8Scale, NaNAndInfInGroups) {
  constexpr int64_t cols = 384;
  std::vector<float> x(cols, 1.0f);
  x[3] = kNaN;        // group 0: NaN is ignored by amax, stays NaN alone
  x[10] = 2.0f;
  x[128 + 5] = kInf;  // group 1: infinite scale, whole group dequantizes to NaN
  std::vector<uint8_t> q(cols);
  std::vector<float> scales(3);
  quantize_rows_1x128(x.data(), 1, cols, q.data(), scales.data());
  EXPECT_EQ(scales[0], 2.0f / 448.0f);
  EXPECT_EQ(q[3], 0x7F);
  EXPECT_EQ(q[10], 0x7E);
  EXPECT_EQ(scales[1], kInf);
  EXPECT_EQ(scales[2], 1.0f / 448.0f);
  std::vector<float> back(cols);
  dequantize_rows_1x128(q.data(), scales.data(), 1, cols, back.data());
  EXPECT_TRUE(std::isnan(back[3]));
  EXPECT_FALSE(std::isnan(back[4]));
  for (int64_t i = 128; i < 256; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;
  for (int64_t i = 256; i < cols; ++i) EXPECT_NEAR(back[i], 1.0f, 1e-6f);
}

TEST(Fp8Scale, RejectsColsNotMultipleOf128) {
  std::vector<float> x(200 * 2, 1.0f);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(4);
  EXPECT_THROW(quantize_rows_1x128(x.data(), 2, 200, q.data(), s.data()), std::invalid_argument);
  EXPECT_THROW(dequantize_rows_1x128(q.data(), s.data(), 2, 200, x.data()), std::invalid_argument);
  EXPECT_THROW(quantize_blocks_128x128(x.data(), 2, 200, q.data(), s.data()), std::invalid_argument);
  EXPECT_THROW(dequantize_blocks_128x128(q.data(), s.data(), 2, 200, x.data()), std::invalid_argument);
  EXPECT_THROW(fake_quantize_rows_1x128(x.data(), 2, 200), std::invalid_argument);
  EXPECT_THROW(fake_quantize_blocks_128x128(x.data(), 2, 200), std::invalid_argument);
  EXPECT_THROW(fake_quantize_rows_1x128(x.data(), -1, 128), std::invalid_argument);
}

std::vector<float> random_tensor(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<float> x(n);
  // Wide dynamic range so that subnormal E4M3 codes and flushes to zero occur inside groups.
  for (float& v : x) v = std::ldexp(normal(rng), exponent(rng));
  x[7] = -0.0f;
  x[300] = kNaN;
  x[1000] = kInf;
  return x;
}

TEST(Fp8FakeQuantize, RowsEqualsQuantizeThenDequantize) {
  constexpr int64_t rows = 5, cols = 384;
  const std::vector<float> x = random_tensor(rows * cols, 3);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scales(rows * 3);
  quantize_rows_1x128(x.data(), rows, cols, q.data(), scales.data());
  std::vector<float> expected(rows * cols);
  dequantize_rows_1x128(q.data(), scales.data(), rows, cols, expected.data());
  std::vector<float> fake = x;
  fake_quantize_rows_1x128(fake.data(), rows, cols);
  int changed = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_TRUE(same_bits(fake[i], expected[i])) << i << ": " << fake[i] << " vs " << expected[i];
    changed += same_bits(fake[i], x[i]) ? 0 : 1;
  }
  EXPECT_GT(changed, rows * cols / 2);  // it did quantize
}

TEST(Fp8FakeQuantize, BlocksEqualsQuantizeThenDequantize) {
  constexpr int64_t rows = 300, cols = 384;
  const std::vector<float> w = random_tensor(rows * cols, 5);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scales(3 * 3);
  quantize_blocks_128x128(w.data(), rows, cols, q.data(), scales.data());
  std::vector<float> expected(rows * cols);
  dequantize_blocks_128x128(q.data(), scales.data(), rows, cols, expected.data());
  std::vector<float> fake = w;
  fake_quantize_blocks_128x128(fake.data(), rows, cols);
  int changed = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_TRUE(same_bits(fake[i], expected[i])) << i << ": " << fake[i] << " vs " << expected[i];
    changed += same_bits(fake[i], w[i]) ? 0 : 1;
  }
  EXPECT_GT(changed, rows * cols / 2);
}

}  // namespace
}  // namespace megamoe::fp8
