// gather_rows_e4m3 (kernels/fp8_gather_rows.hpp) against a CPU gather: bytes and scales bit for bit, indices
// outside the source clamped, rows from *rows_used on and the scales' padding untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/gpu_test_util.hpp"
#include "kernels/fp8_gather_rows.hpp"
#include "kernels/fp8_layout.hpp"

namespace megamoe {
namespace {

using testing::DeviceBuffer;
using testing::bits_of;

void check_gather(int64_t source_rows, int64_t cols, int64_t capacity, int32_t rows_used) {
  SCOPED_TRACE("source_rows " + std::to_string(source_rows) + " cols " + std::to_string(cols) + " capacity " +
               std::to_string(capacity) + " rows_used " + std::to_string(rows_used));
  const uint32_t seed = std::random_device{}();
  std::printf("[fp8_gather_rows_test] random seed %u\n", seed);
  std::mt19937 rng(seed);
  const int64_t groups = cols / 128, pitch = kernels::fp8_scale_pitch(capacity);
  std::vector<uint8_t> q(static_cast<size_t>(source_rows * cols));
  std::vector<float> scales(static_cast<size_t>(source_rows * groups));
  for (auto& b : q) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(1e-3f, 10.0f);
  for (auto& s : scales) s = scale(rng);
  std::uniform_int_distribution<int32_t> pick(-3, static_cast<int32_t>(source_rows + 2));  // a few out of range
  std::vector<int32_t> row_src(static_cast<size_t>(capacity));
  for (auto& r : row_src) r = pick(rng);
  DeviceBuffer<uint8_t> dq(q.size()), out_q(static_cast<size_t>(capacity * cols));  // outputs poisoned (0xFF)
  DeviceBuffer<float> ds(scales.size()), out_s(static_cast<size_t>(groups * pitch));
  DeviceBuffer<int32_t> drows(row_src.size()), dused(1);
  dq.upload(q);
  ds.upload(scales);
  drows.upload(row_src);
  dused.upload({rows_used});
  const Status st = kernels::gather_rows_e4m3(dq.get(), ds.get(), source_rows, drows.get(), cols, dused.get(), capacity,
                                              out_q.get(), out_s.get(), pitch, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<uint8_t> got_q = out_q.download();
  const std::vector<float> got_s = out_s.download();
  const int64_t rows = std::min<int64_t>(std::max(rows_used, 0), capacity);
  int64_t bad_q = 0, bad_s = 0, touched = 0;
  for (int64_t r = 0; r < capacity; ++r) {
    const int64_t src = std::min<int64_t>(std::max<int64_t>(row_src[r], 0), source_rows - 1);
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t v = got_q[r * cols + c];
      if (r < rows) bad_q += v != q[src * cols + c];
      else touched += v != 0xFF;
    }
    for (int64_t kb = 0; kb < groups; ++kb) {
      const uint32_t v = bits_of(got_s[kb * pitch + r]);
      if (r < rows) bad_s += v != bits_of(scales[src * groups + kb]);
      else touched += v != 0xFFFFFFFFu;
    }
  }
  for (int64_t kb = 0; kb < groups; ++kb)
    for (int64_t r = capacity; r < pitch; ++r) touched += bits_of(got_s[kb * pitch + r]) != 0xFFFFFFFFu;
  EXPECT_EQ(bad_q, 0) << "bytes differ from the source rows";
  EXPECT_EQ(bad_s, 0) << "scales differ from the source rows'";
  EXPECT_EQ(touched, 0) << "rows past rows_used or the scales' padding were written";
}

TEST(Fp8GatherRowsGpuTest, CopiesRowsAndScalesInExpertOrder) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  check_gather(300, 384, 1001, 937);  // some rows unused, a pitch with padding
  check_gather(64, 4096, 515, 515);   // every row, 32 scale groups
  check_gather(1, 128, 7, 100);       // one source row; rows_used past capacity is clamped
  check_gather(50, 256, 40, -5);      // rows_used negative: nothing written
}

TEST(Fp8GatherRowsGpuTest, RejectsBadArguments) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<uint8_t> q(256 * 4), out(256 * 4);
  DeviceBuffer<float> s(8), os(8);
  DeviceBuffer<int32_t> rows(4), used(1);
  EXPECT_FALSE(kernels::gather_rows_e4m3(q.get(), s.get(), 4, rows.get(), 200, used.get(), 4, out.get(), os.get(), 4,
                                         nullptr).is_ok());  // cols not a multiple of 128
  EXPECT_FALSE(kernels::gather_rows_e4m3(q.get(), s.get(), 4, rows.get(), 256, used.get(), 4, out.get(), os.get(), 3,
                                         nullptr).is_ok());  // pitch below capacity
  EXPECT_FALSE(kernels::gather_rows_e4m3(q.get(), s.get(), 0, rows.get(), 256, used.get(), 4, out.get(), os.get(), 4,
                                         nullptr).is_ok());  // no source rows
  EXPECT_FALSE(kernels::gather_rows_e4m3(q.get() + 1, s.get(), 4, rows.get(), 256, used.get(), 4, out.get(), os.get(),
                                         4, nullptr).is_ok());  // misaligned
  EXPECT_FALSE(kernels::gather_rows_e4m3(q.get(), s.get(), 4, nullptr, 256, used.get(), 4, out.get(), os.get(), 4,
                                         nullptr).is_ok());  // null
  EXPECT_TRUE(kernels::gather_rows_e4m3(nullptr, nullptr, 0, nullptr, 256, nullptr, 0, nullptr, nullptr, 0,
                                        nullptr).is_ok());  // capacity 0: nothing to do
}

}  // namespace
}  // namespace megamoe
