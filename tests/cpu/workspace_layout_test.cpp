// The symmetric workspace's layout (src/comm/ep_workspace.hpp): every buffer inside the slice, aligned, and
// apart from the others; the blockwise FP8 buffers sized for their tensors, and taking no room in a bf16
// layer; the bf16 backward's buffers taking no room in an FP8 layer (it has no backward yet).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/ep_workspace.hpp"

namespace megamoe::ep {
namespace {

Shape shape(bool fp8) {
  Shape s{};
  s.hidden = 384;
  s.intermediate = 256;
  s.num_experts = 8;
  s.experts_per_rank = 4;
  s.top_k = 2;
  s.num_ranks = 2;
  s.rank = 0;
  s.max_tokens = 37;
  s.row_capacity = 2 * 37 * 2 + 5;
  s.dot_parts = 1;
  s.recompute_h = 0;
  s.fp8 = fp8 ? 1 : 0;
  return s;
}

struct Buffer {
  const char* name;
  int64_t offset, bytes;
};

// The FP8 buffers with the bytes their tensors need.
std::vector<Buffer> fp8_buffers(const WorkspaceLayout& l, const Shape& s) {
  const int64_t H = s.hidden, I = s.intermediate, R = s.num_ranks, T = s.max_tokens, C = s.row_capacity;
  const int64_t EL = s.experts_per_rank, cols = kernels::token_major_columns(C, EL);
  return {{"x_q", l.x_q, T * H},
          {"x_s", l.x_s, 4 * T * (H / 128)},
          {"recv_xq", l.recv_xq, R * T * H},
          {"recv_xs", l.recv_xs, 4 * R * T * (H / 128)},
          {"rows_q", l.rows_q, C * H},
          {"rows_s", l.rows_s, 4 * (H / 128) * kernels::fp8_scale_pitch(C)},
          {"h_f32", l.h_f32, 4 * C * 2 * I},
          {"a_q", l.a_q, C * I},
          {"a_s", l.a_s, 4 * (I / 128) * kernels::fp8_scale_pitch(C)},
          {"w13_q", l.w13_q, EL * 2 * I * H},
          {"w13_s", l.w13_s, 4 * EL * (2 * I / 128) * (H / 128)},
          {"w2_q", l.w2_q, EL * H * I},
          {"w2_s", l.w2_s, 4 * EL * (H / 128) * (I / 128)},
          {"dout_q", l.dout_q, T * H},
          {"dout_s", l.dout_s, 4 * T * (H / 128)},
          {"recv_doutq", l.recv_doutq, R * T * H},
          {"recv_douts", l.recv_douts, 4 * R * T * (H / 128)},
          {"g_f32", l.g_f32, 4 * C * I},
          {"dh_q", l.dh_q, C * 2 * I},
          {"dh_s", l.dh_s, 4 * (2 * I / 128) * kernels::fp8_scale_pitch(C)},
          {"w2t_q", l.w2t_q, EL * I * H},
          {"w2t_s", l.w2t_s, 4 * EL * (I / 128) * (H / 128)},
          {"w13t_q", l.w13t_q, EL * H * 2 * I},
          {"w13t_s", l.w13t_s, 4 * EL * (H / 128) * (2 * I / 128)},
          {"dyt_q", l.dyt_q, H * cols},
          {"dyt_s", l.dyt_s, 2 * (cols / 128) * H},
          {"at_q", l.at_q, I * cols},
          {"at_s", l.at_s, 2 * (cols / 128) * I},
          {"dht_q", l.dht_q, 2 * I * cols},
          {"dht_s", l.dht_s, 2 * (cols / 128) * 2 * I},
          {"xt_q", l.xt_q, H * cols},
          {"xt_s", l.xt_s, 2 * (cols / 128) * H}};
}

TEST(WorkspaceLayoutTest, Fp8BuffersFitApartAndAligned) {
  const Shape s = shape(true);
  const WorkspaceLayout l = WorkspaceLayout::make(s);
  std::vector<Buffer> buffers = fp8_buffers(l, s);
  // The buffers every precision has, by their element counts (enough to tell an overlap).
  buffers.push_back({"combine", l.combine, 2 * int64_t{s.max_tokens} * s.top_k * s.hidden});
  buffers.push_back({"recv_token", l.recv_token, 4 * int64_t{s.num_ranks} * s.max_tokens});
  buffers.push_back({"row_dest", l.row_dest, 8 * s.row_capacity});
  buffers.push_back({"fused_work", l.fused_work, 4});
  std::sort(buffers.begin(), buffers.end(), [](const Buffer& a, const Buffer& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Buffer& b = buffers[i];
    EXPECT_GT(b.bytes, 0) << b.name;
    EXPECT_EQ(b.offset % 16, 0) << b.name << " is not 16-byte aligned";
    EXPECT_LE(b.offset + b.bytes, l.total) << b.name << " runs past the slice";
    if (i + 1 < buffers.size()) {
      EXPECT_LE(b.offset + b.bytes, buffers[i + 1].offset) << b.name << " overlaps " << buffers[i + 1].name;
    }
  }
}

// The bf16 backward's buffers with the bytes their tensors need (the bf16 forward writes recv_x, h and a).
std::vector<Buffer> bf16_backward_buffers(const WorkspaceLayout& l, const Shape& s) {
  const int64_t H = s.hidden, I = s.intermediate, R = s.num_ranks, T = s.max_tokens, C = s.row_capacity;
  return {{"recv_x", l.recv_x, 2 * R * T * H},
          {"recv_dout", l.recv_dout, 2 * R * T * H},
          {"h", l.h, 2 * C * 2 * I},
          {"a", l.a, 2 * C * I},
          {"dh", l.dh, 2 * C * 2 * I}};
}

int64_t bytes_of(const std::vector<Buffer>& buffers) {
  int64_t bytes = 0;
  for (const Buffer& b : buffers) bytes += b.bytes;
  return bytes;
}

TEST(WorkspaceLayoutTest, EachPrecisionGivesTheOthersBuffersNoRoom) {
  const Shape s16 = shape(false), s8 = shape(true);
  const WorkspaceLayout l16 = WorkspaceLayout::make(s16), l8 = WorkspaceLayout::make(s8);
  // Every FP8 buffer of the bf16 layout sits at its end, empty.
  for (const Buffer& b : fp8_buffers(l16, s16)) EXPECT_EQ(b.offset, l16.total) << b.name;
  // The bf16 backward's buffers of the FP8 layout are empty: each starts where the buffer after it does.
  EXPECT_EQ(l8.recv_x, l8.recv_token);
  EXPECT_EQ(l8.recv_dout, l8.recv_token);
  EXPECT_EQ(l8.h, l8.grid_arrivals);
  EXPECT_EQ(l8.a, l8.grid_arrivals);
  EXPECT_EQ(l8.dh, l8.grid_arrivals);
  // So the FP8 layout differs from the bf16 one by the FP8 tensors' bytes less the bf16 backward's
  // (alignment may add a little to each side: at most one kAlign per buffer).
  const int64_t expected = bytes_of(fp8_buffers(l8, s8)) - bytes_of(bf16_backward_buffers(l16, s16));
  EXPECT_LE(std::abs(l8.total - l16.total - expected), 40 * kAlign) << l8.total << " vs " << l16.total;
  // The bf16 layout keeps every one of them, apart and in the slice.
  for (const Buffer& b : bf16_backward_buffers(l16, s16)) {
    EXPECT_EQ(b.offset % 16, 0) << b.name;
    EXPECT_LE(b.offset + b.bytes, l16.total) << b.name;
  }
  EXPECT_LE(l16.recv_x + 2 * int64_t{s16.num_ranks} * s16.max_tokens * s16.hidden, l16.recv_dout);
  EXPECT_LE(l16.h + 2 * s16.row_capacity * 2 * s16.intermediate, l16.a);
  EXPECT_LE(l16.a + 2 * s16.row_capacity * s16.intermediate, l16.dh);
}

}  // namespace
}  // namespace megamoe::ep
