// The device's E4M3 arithmetic (src/device/fp8_codes.cuh) against the IEEE division and the CPU emulation: the
// quotients by a group's reciprocal must be the divisions' bits, the codes the conversion of those, and the
// decoded values the CPU's.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "device/fp8_codes.cuh"
#include "gpu/gpu_test_util.hpp"
#include "megamoe/fp8.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

uint32_t fresh_seed(const char* what) {
  const uint32_t seed = std::random_device{}();
  std::printf("[fp8_codes_test] %s: random seed %u\n", what, seed);
  return seed;
}

// What the tests count: disagreements, and the first one's operands.
struct Disagreements {
  unsigned long long count;
  float value, scale;
};

__device__ void record(Disagreements* out, float value, float scale) {
  if (atomicAdd(&out->count, 1ull) == 0) {
    out->value = value;
    out->scale = scale;
  }
}

// One thread: four values by one scale, through group_quotients and e4m3_words_of, against one IEEE division
// and one conversion per value. Codes must be the same bytes; quotients the same bits (any NaN equals any NaN:
// the conversion makes every NaN 0x7F) wherever the division's is at least 2^-11 in magnitude or NaN (below,
// the last bits of a denormal quotient may differ; its code is +-0 either way, which the codes check).
__device__ void check_group(const float (&v)[4], float scale, Disagreements* quotients, Disagreements* codes) {
  float q[4];
  device::group_quotients(v, scale, q);
  uint32_t words[1];
  device::e4m3_words_of(v, scale, words);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float expected = __fdiv_rn(v[k], scale);
    const bool same = __float_as_uint(q[k]) == __float_as_uint(expected) || (isnan(q[k]) && isnan(expected));
    if (!same && !(fabsf(expected) < 0x1p-11f)) record(quotients, v[k], scale);
    const uint32_t code = __nv_cvt_float_to_fp8(expected, __NV_SATFINITE, __NV_E4M3);
    if (((words[0] >> (8 * k)) & 0xffu) != code) record(codes, v[k], scale);
  }
}

// Every 23-bit significand of the value, with the sign of blockIdx.z, for scale blockIdx.y / exponents and the
// value's exponent the scale's plus exponents[blockIdx.y % exponents]. The rounding of a quotient of normal
// numbers depends on the two significands only, so this covers every value for these scales, in the binades
// of quotient that the exponent offsets pick. Values beyond 449 scales are outside the contract (a group's
// values are at most its amax = 448 scales) and skipped.
__global__ void every_significand_kernel(const float* scales, const int* exponents, int num_exponents,
                                         Disagreements* quotients, Disagreements* codes) {
  const float scale = scales[blockIdx.y / num_exponents];
  const int exponent = static_cast<int>((__float_as_uint(scale) >> 23) & 0xffu) + exponents[blockIdx.y % num_exponents];
  if (exponent < 1 || exponent > 254) return;
  const uint32_t sign = blockIdx.z != 0 ? 0x80000000u : 0u;
  const uint32_t first = 4u * (blockIdx.x * blockDim.x + threadIdx.x);
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[k] = __uint_as_float(sign | (static_cast<uint32_t>(exponent) << 23) | ((first + k) & 0x7fffffu));
    if (fabsf(v[k]) > 449.0f * scale) v[k] = 0.0f;
  }
  check_group(v, scale, quotients, codes);
}

// Every pair of significands: thread values 1.m (four per thread, m over all 2^23) against every scale 1.s, both
// in [1, 2). Between 2^-64 and 2^64 scales the rounding of a quotient of normal numbers depends on the two
// significands only, so this covers the whole claim for values of at least 2^-11 scales. About 2^46 quotients.
__global__ void every_pair_kernel(unsigned long long* disagreements) {
  const uint32_t first = 4u * (blockIdx.x * blockDim.x + threadIdx.x);
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = __uint_as_float(0x3f800000u | ((first + k) & 0x7fffffu));
  unsigned long long found = 0;
  for (uint32_t m = 0; m < (1u << 23); ++m) {
    const float scale = __uint_as_float(0x3f800000u | m);
    const float reciprocal = device::refined_reciprocal(scale);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      found += __float_as_uint(device::quotient_by_reciprocal(v[k], scale, reciprocal)) !=
               __float_as_uint(__fdiv_rn(v[k], scale));
  }
  if (found != 0) atomicAdd(disagreements, found);
}

// Groups as the quantizers make them: four values, the scale from their amax.
__global__ void groups_kernel(const float* values, int64_t groups, Disagreements* quotients, Disagreements* codes) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[k] = values[4 * g + k];
    amax = fmaxf(amax, fabsf(v[k]));
  }
  check_group(v, device::scale_from_amax(amax), quotients, codes);
}

__global__ void decode_kernel(const uint32_t* words, int count, float* values) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= count) return;
  float v[4];
  device::e4m3x4_values(words[i], v);
  for (int k = 0; k < 4; ++k) values[4 * i + k] = v[k];
}

void expect_none(const Disagreements& d, const char* what) {
  EXPECT_EQ(d.count, 0ull) << what << ": first at value " << std::hexfloat << d.value << " scale " << d.scale
                           << std::defaultfloat;
}

// After a checking kernel: no quotient and no code disagreed (found[0] and found[1]).
void expect_no_disagreements(const DeviceBuffer<Disagreements>& found) {
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<Disagreements> result = found.download();
  expect_none(result[0], "quotients");
  expect_none(result[1], "codes");
}

TEST(Fp8CodesGpuTest, QuotientsByReciprocalAreIeeeDivisionsForEverySignificand) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  // Scales across the reciprocal's range: its ends, powers of two, the extreme significands, amax / 448 of
  // round numbers, and random ones.
  // The ends' neighbours outside (0x1.fffffep-65, 0x1.000002p64) take the division.
  std::vector<float> scales = {1.0f,           0x1p-64f,        0x1p64f,        0x1.fffffep-65f,
                               0x1.fffffep63f, 0x1.000002p-64f, 0x1.000002p64f, 1.5f,
                               0x1.fffffep0f,  0x1.000002p0f,   1.0f / 448.0f,  3.0f / 448.0f,
                               1e-8f / 448.0f, 0x1.555556p-2f,  0x1.99999ap-4f, 0x1.249248p-3f};
  std::mt19937 rng(fresh_seed("every significand"));
  std::uniform_int_distribution<uint32_t> significand(0, 0x7fffff);
  std::uniform_int_distribution<int> exponent(-64, 63);
  while (scales.size() < 64)
    scales.push_back(std::ldexp(std::bit_cast<float>(0x3f800000u | significand(rng)), exponent(rng)));
  // Quotients in [2^(e-1), 2^(e+1)) for each offset e: up to 448, around 1, around the smallest E4M3
  // subnormal 2^-9 and the rounding boundary 2^-10 below it, and below 2^-11 (codes +-0).
  const std::vector<int> exponents = {8, 1, -8, -9, -10, -11, -20};
  DeviceBuffer<float> scales_d(scales.size());
  scales_d.upload(scales);
  DeviceBuffer<int> exponents_d(exponents.size());
  exponents_d.upload(exponents);
  DeviceBuffer<Disagreements> found(2);
  MEGAMOE_ASSERT_CUDA(cudaMemset(found.get(), 0, 2 * sizeof(Disagreements)));
  constexpr int kThreads = 256;
  const dim3 grid((1u << 23) / 4 / kThreads, static_cast<unsigned>(scales.size() * exponents.size()), 2);
  every_significand_kernel<<<grid, kThreads>>>(scales_d.get(), exponents_d.get(), static_cast<int>(exponents.size()),
                                               found.get(), found.get() + 1);
  expect_no_disagreements(found);
}

// Opt-in (MEGAMOE_FP8_EXHAUSTIVE=1; about a minute on an H200): no quotient of any pair of significands differs.
TEST(Fp8CodesGpuTest, QuotientsByReciprocalAreIeeeDivisionsForEveryPairOfSignificands) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  if (std::getenv("MEGAMOE_FP8_EXHAUSTIVE") == nullptr) GTEST_SKIP() << "set MEGAMOE_FP8_EXHAUSTIVE=1 to run";
  DeviceBuffer<unsigned long long> found(1);
  MEGAMOE_ASSERT_CUDA(cudaMemset(found.get(), 0, sizeof(unsigned long long)));
  every_pair_kernel<<<(1u << 23) / 4 / 256, 256>>>(found.get());
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(found.download()[0], 0ull);
}

// Groups built from the values the quantizers meet: zeros of either sign, denormals, NaN, infinities, the
// largest floats, and random magnitudes over the whole exponent range (so scales outside the reciprocal's
// range, which divide, occur too: denormal groups, infinite ones, amax beyond 448 * 2^64).
TEST(Fp8CodesGpuTest, GroupsOfSpecialAndRandomValuesGiveTheDivisionsCodes) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> special = {0.0f,     -0.0f,    0x1p-149f, -0x1p-149f, 0x1.fffffcp-127f, 0x1p-126f,
                                      nan,      -nan,     inf,       -inf,       0x1.fffffep127f, -0x1.fffffep127f,
                                      448.0f,   -448.0f,  0x1p-10f,  0x1p-9f,    0x1.8p-10f,      1.0f};
  std::mt19937 rng(fresh_seed("groups"));
  std::uniform_int_distribution<size_t> pick(0, special.size() - 1);
  std::uniform_int_distribution<uint32_t> any_finite(0, 0x7f7fffffu);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 7), binade(-140, 120);
  const int64_t groups = int64_t{1} << 22;
  std::vector<float> values(4 * groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int mode = kind(rng);
    const int e = binade(rng);
    for (int k = 0; k < 4; ++k) {
      float v;
      switch (mode) {
        case 0: v = special[pick(rng)]; break;  // specials only
        case 1: v = std::bit_cast<float>(any_finite(rng) | (k % 2 != 0 ? 0x80000000u : 0u)); break;
        case 2: v = k == 0 ? special[pick(rng)] : std::ldexp(unit(rng), e); break;  // one special in a group
        default: v = std::ldexp(unit(rng), e + (k == 3 ? binade(rng) / 8 : 0)); break;  // one binade, one outlier
      }
      values[4 * g + k] = v;
    }
  }
  DeviceBuffer<float> values_d(values.size());
  values_d.upload(values);
  DeviceBuffer<Disagreements> found(2);
  MEGAMOE_ASSERT_CUDA(cudaMemset(found.get(), 0, 2 * sizeof(Disagreements)));
  groups_kernel<<<static_cast<unsigned>((groups + 255) / 256), 256>>>(values_d.get(), groups, found.get(),
                                                                       found.get() + 1);
  expect_no_disagreements(found);
}

// Every code in every byte position decodes to the CPU's value (NaN codes to NaN).
TEST(Fp8CodesGpuTest, EveryCodeDecodesToTheCpuValue) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  std::vector<uint32_t> words(256);
  for (uint32_t i = 0; i < 256; ++i)
    words[i] = i | (((i + 61) & 0xffu) << 8) | (((i + 127) & 0xffu) << 16) | (((i + 200) & 0xffu) << 24);
  DeviceBuffer<uint32_t> words_d(words.size());
  words_d.upload(words);
  DeviceBuffer<float> values(4 * words.size());
  decode_kernel<<<1, 256>>>(words_d.get(), static_cast<int>(words.size()), values.get());
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> got = values.download();
  int bad = 0;
  for (size_t i = 0; i < words.size(); ++i) {
    for (int k = 0; k < 4; ++k) {
      const float expected = fp8::e4m3_to_float(static_cast<uint8_t>(words[i] >> (8 * k)));
      const float actual = got[4 * i + k];
      const bool same = std::isnan(expected) ? std::isnan(actual)
                                             : std::bit_cast<uint32_t>(actual) == std::bit_cast<uint32_t>(expected);
      if (!same && bad++ < 5)
        ADD_FAILURE() << "code 0x" << std::hex << ((words[i] >> (8 * k)) & 0xffu) << std::dec << " in byte " << k
                      << ": " << actual << " against " << expected;
    }
  }
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace megamoe
