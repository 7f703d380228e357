// One block of 512 threads per group of 128 routed rows (kernels/token_major_groups.cuh), taking the 128-channel
// blocks kb of I in turn. Per kb:
//   the row pass: warp w takes rows 8 w .. 8 w + 7 of the group, two at a time, a lane 4 channels of a row (one
//     16-byte load each of g, gate and up). It computes a, dg and du, quantizes the row's 1 x 128 groups of dg
//     and du across the warp and adds g a to the row's dot (swiglu_backward_row.cuh, shared with
//     swiglu_backward_quantize_rows_1x128), and leaves a, dg and du in a shared fp32 tile [128 rows][384 columns];
//   the column pass: eight lanes a tile column, 16 rows each, quantize each channel's 128 rows, the token-major
//     kernel's pass (fp8_token_major.cu), and store the codes as one 128-byte line of the channel's row of the
//     copy.
// The next two rows' loads are issued before the current two are used, and the first two rows of the next kb
// before the column pass, so that loads stay in flight while the block computes (a 192 KB tile leaves room for
// one block an SM).
// The tile's columns are XOR-swizzled by row / 16 in runs of four (column bits 2..4): a row-pass warp writes
// one row, whole bank rounds either way, and the 32 lanes of a column-pass load read four columns of eight row
// groups, 32 distinct banks.
#include <string>

#include "device/fp8_codes.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/fp8_swiglu_backward.hpp"
#include "kernels/swiglu_backward_row.cuh"
#include "kernels/token_major_groups.cuh"

namespace megamoe::kernels {
namespace {

constexpr int kGroup = kTokenMajorGroup;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpRows = kGroup / kWarps;    // rows of the group a warp computes
constexpr int kBatch = 2;                     // rows whose loads are issued together
constexpr int kBatches = kWarpRows / kBatch;  // per kb
constexpr int kColumns = 3 * kGroup;          // a, dg, du of one kb
constexpr int kLaneRows = 16;                 // column pass: a lane's rows of a column
constexpr int kPassColumns = kThreads / 8;    // column pass: eight lanes a column
constexpr int kPasses = kColumns / kPassColumns;
constexpr int kSmemBytes = static_cast<int>((kGroup * kColumns + kGroup) * sizeof(float));
static_assert(kLaneRows * 8 == kGroup && kPassColumns % 32 == 0 && kGroup % kPassColumns == 0, "column pass");
static_assert(kWarpRows * kWarps == kGroup && kBatches * kBatch == kWarpRows && 16 % kWarpRows == 0,
              "a warp's rows lie in one swizzle group");

struct RowLoads {
  float4 g, gate, up;
};

struct Args {
  const float* g;
  const float* h;
  const float* row_weight;
  int64_t I;
  const int32_t* offsets;
  int experts;
  int64_t capacity;
  int64_t columns;  // of the token-major copies
  SwigluBackwardFp8Outputs out;
};

__device__ __forceinline__ float4 load_float4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

__device__ __forceinline__ void store_float4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

__global__ void __launch_bounds__(kThreads, 1) swiglu_backward_fp8_kernel(const Args args) {
  extern __shared__ __align__(16) unsigned char smem[];
  device::begin_dependent_grid();
  float* const tile = reinterpret_cast<float*>(smem);  // [kGroup][kColumns], swizzled
  float* const weights = tile + kGroup * kColumns;     // the group's routing weights

  const TokenMajorGroup group =
      find_token_major_group(args.offsets, args.experts, args.capacity, static_cast<int>(blockIdx.x));
  if (group.rows == 0) return;  // uniform over the block
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  if (t < kGroup) weights[t] = t < group.rows ? __ldg(args.row_weight + group.first + t) : 0.0f;
  __syncthreads();

  const int64_t I = args.I, blocks = I / kGroup;
  const SwigluBackwardFp8Outputs& out = args.out;

  // The row pass. The warp's rows lie in row group warp / (16 / kWarpRows) of the swizzle, so the lane's float4
  // of a row (logical columns 4 lane .. 4 lane + 3 of a, dg and du) sits at run lane ^ that group.
  const int first_local = kWarpRows * warp;
  const int lane_run = 4 * (lane ^ (first_local / 16));
  float dot[kWarpRows] = {};
  const auto fetch = [&](RowLoads(&set)[kBatch], int64_t kb, int batch) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int local = first_local + kBatch * batch + j;
      if (local < group.rows) {
        const int64_t row = group.first + local, column = kb * kGroup + 4 * lane;
        set[j].g = load_float4(args.g + row * I + column);
        set[j].gate = load_float4(args.h + row * 2 * I + column);
        set[j].up = load_float4(args.h + row * 2 * I + I + column);
      } else {
        set[j] = RowLoads{};
      }
    }
  };
  const auto row_pass = [&](const RowLoads(&set)[kBatch], int64_t kb, int batch) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int local = first_local + kBatch * batch + j;
      // Rows past the group's are zeros in the tile (the token-major copy's padding) and are not written: their
      // loads are zeros (fetch), from which the arithmetic gives +0 everywhere, so only the stores branch.
      const SwigluRowValues v =
          swiglu_backward_row_block(weights[local], set[j].g, set[j].gate, set[j].up, group.first + local, kb, I,
                                    out.dh_q, out.dh_s, out.dh_scales_pitch, lane, dot[kBatch * batch + j],
                                    local < group.rows);
      float* const tile_row = tile + local * kColumns + lane_run;
      store_float4(tile_row, v.a);
      store_float4(tile_row + kGroup, v.dg);
      store_float4(tile_row + 2 * kGroup, v.du);
    }
  };

  // The column pass: lane `part` of a column's eight takes rows 16 part .. 16 part + 15 (row group `part`); a
  // pass moves by whole bank rounds, so every load is one base plus a constant. Pass p reads logical column
  // kPassColumns p + pass_column.
  const int part = lane % 8, pass_column = kPassColumns / kWarps * warp + lane / 8;
  const float* const lane_tile = tile + kLaneRows * part * kColumns + (pass_column ^ (part << 2));
  const uint64_t k_block = static_cast<uint64_t>(group.column / kGroup);
  const auto column_pass = [&](int64_t kb) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      float v[kLaneRows];
#pragma unroll
      for (int i = 0; i < kLaneRows; ++i) v[i] = lane_tile[i * kColumns + kPassColumns * pass];
      const device::OctetGroupQuantized q = device::quantize_octet_group(v);
      // The pass's output (constants): a, then dh's gate half, then its up half.
      constexpr int kPerOutput = kGroup / kPassColumns;
      const int which = pass / kPerOutput;
      uint8_t* const qt = which == 0 ? out.at_q : out.dht_q;
      TokenMajorScale* const st = which == 0 ? out.at_s : out.dht_s;
      const int64_t channels = which == 0 ? I : 2 * I;
      const int64_t c = (which == 2 ? I : 0) + kb * kGroup + kPassColumns * (pass % kPerOutput) + pass_column;
      *reinterpret_cast<uint4*>(qt + c * args.columns + group.column + kLaneRows * part) =
          make_uint4(q.words[0], q.words[1], q.words[2], q.words[3]);
      if (part == 0)
        st[k_block * static_cast<uint64_t>(channels) + static_cast<uint64_t>(c)] =
            device::power_of_two_scale_bits(q.scale);
    }
  };

  RowLoads ring[2][kBatch];
  fetch(ring[0], 0, 0);
  for (int64_t kb = 0; kb < blocks; ++kb) {
#pragma unroll
    for (int b = 0; b < kBatches; ++b) {
      if (b + 1 < kBatches) fetch(ring[(b + 1) % 2], kb, b + 1);
      row_pass(ring[b % 2], kb, b);
    }
    static_assert(kBatches % 2 == 0, "the next kb's first batch goes into ring[0]");
    __syncthreads();
    if (kb + 1 < blocks) fetch(ring[0], kb + 1, 0);
    column_pass(kb);
    __syncthreads();  // before the next row pass writes the tile
  }

  // The dots (swiglu_backward_row.cuh).
#pragma unroll
  for (int i = 0; i < kWarpRows; ++i)
    if (first_local + i < group.rows)  // uniform over the warp
      store_row_dot(dot[i], out.dot_rows, group.first + first_local + i, out.dot_parts, lane);
}

bool misaligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) != 0; }

}  // namespace

Status swiglu_backward_quantize_fp8(const float* g, const float* h, const float* row_weight, int64_t I,
                                    const int32_t* offsets, int experts, int64_t capacity,
                                    const SwigluBackwardFp8Outputs& out, cudaStream_t stream) {
  const std::string what = "swiglu_backward_quantize_fp8";
  if (I <= 0 || I % kGroup != 0 || experts < 1 || capacity < 0)
    return Status::invalid(what + ": I must be a positive multiple of 128, experts >= 1 and capacity >= 0, got I=" +
                           std::to_string(I) + " experts=" + std::to_string(experts) +
                           " capacity=" + std::to_string(capacity));
  if (out.dh_scales_pitch < capacity)
    return Status::invalid(what + ": dh_scales_pitch must be at least capacity=" + std::to_string(capacity) +
                           ", got " + std::to_string(out.dh_scales_pitch));
  if (out.dot_rows != nullptr && out.dot_parts < 1)
    return Status::invalid(what + ": dot_parts must be >= 1 with dot_rows");
  const int64_t groups = (capacity + kGroup - 1) / kGroup + experts;
  if (groups >= (int64_t{1} << 31)) return Status::invalid(what + ": too many row groups");
  if (capacity == 0) return Status::ok();
  if (g == nullptr || h == nullptr || row_weight == nullptr || offsets == nullptr || out.dh_q == nullptr ||
      out.dh_s == nullptr || out.at_q == nullptr || out.at_s == nullptr || out.dht_q == nullptr ||
      out.dht_s == nullptr)
    return Status::invalid(what + ": null pointer");
  if (misaligned(g, 16) || misaligned(h, 16) || misaligned(out.at_q, 16) || misaligned(out.dht_q, 16) ||
      misaligned(out.dh_q, 4))
    return Status::invalid(what + ": g, h, at_q and dht_q must be 16-byte aligned, dh_q 4-byte aligned");
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(swiglu_backward_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const Args args{g, h, row_weight, I, offsets, experts, capacity, token_major_columns(capacity, experts), out};
  return kernels::launch_dependent(swiglu_backward_fp8_kernel, dim3(static_cast<unsigned>(groups)), dim3(kThreads),
                                   kSmemBytes, stream, "swiglu_backward_fp8_kernel", args);
}

Status swiglu_backward_fp8_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_backward_fp8_kernel));
  return Status::ok();
}

}  // namespace megamoe::kernels
