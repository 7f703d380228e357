#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "kernels/fp8_quantize.hpp"
#include "megamoe/fp8.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;

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

TEST(Fp8QuantizeGpuTest, RejectsColumnsNotMultipleOf128) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<__nv_bfloat16> x(4 * 100);
  DeviceBuffer<uint8_t> q(4 * 100);
  DeviceBuffer<float> scales(4);
  const Status status = kernels::quantize_rows_1x128_bf16(x.get(), 4, 100, q.get(), scales.get(), nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("multiple of 128"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace megamoe
