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
#include <cuda/ptx>
#include <string>

#include "device/fp8_codes.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "device/ptx/sync.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/fp8_swiglu_backward.hpp"
#include "kernels/swiglu_backward_row.cuh"
#include "kernels/token_major_groups.cuh"

namespace megamoe::kernels {
namespace {

// How a group of 128 routed rows is shared out: kBlockRows of its rows a block (128: one block a group; 64: a
// 2-CTA cluster a group, each CTA half of the rows, which exchange the column pass's maxima through
// distributed shared memory).
template <int kBlockRows>
struct StepShape {
  static constexpr int kGroup = kTokenMajorGroup;
  static constexpr int kCluster = kGroup / kBlockRows;
  static constexpr int kWarpRows = 8;                      // rows of the block a warp computes
  static constexpr int kWarps = kBlockRows / kWarpRows;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlocksPerSm = kCluster;            // what the shared tile leaves room for
  static constexpr int kBatch = 2;                         // rows whose loads are issued together
  static constexpr int kBatches = kWarpRows / kBatch;      // per kb
  static constexpr int kColumns = 3 * kGroup;              // a, dg, du of one kb
  static constexpr int kLaneRows = kBlockRows / 8;         // column pass: a lane's rows of a column (a row group)
  static constexpr int kPassColumns = kThreads / 8;        // column pass: eight lanes a column
  static constexpr int kPasses = kColumns / kPassColumns;
  static constexpr int kPerOutput = kGroup / kPassColumns;  // passes of each of a, dg, du
  // The tile, the block's routing weights and (pairs) the peer's column maxima of two kbs.
  static constexpr int kSmemFloats = kBlockRows * kColumns + kBlockRows + (kCluster > 1 ? 2 * kColumns : 0);
  static constexpr int kSmemBytes = static_cast<int>(kSmemFloats * sizeof(float));
  static_assert(kCluster == 1 || kCluster == 2, "one block or a pair a group");
  static_assert(kLaneRows * 8 == kBlockRows && kPassColumns % 32 == 0 && kGroup % kPassColumns == 0, "column pass");
  static_assert(kPassColumns / kWarps == 4, "a warp's column-pass lanes read four columns of eight row groups");
  static_assert(kBatches * kBatch == kWarpRows && kLaneRows % kWarpRows == 0, "a warp's rows lie in one row group");
  static_assert(kBatches % 2 == 0, "the next kb's first batch goes into ring[0]");
};

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

// The codes of a lane's kCount consecutive rows of a token-major channel, four to a word.
template <int kCount>
__device__ __forceinline__ void store_codes(uint8_t* p, const uint32_t (&words)[kCount / 4]) {
  if constexpr (kCount == 16)
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
  else
    *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
}

template <int kBlockRows>
__global__ void __launch_bounds__(StepShape<kBlockRows>::kThreads, StepShape<kBlockRows>::kBlocksPerSm)
    swiglu_backward_fp8_kernel(const Args args) {
  using S = StepShape<kBlockRows>;
  extern __shared__ __align__(16) unsigned char smem[];
  device::begin_dependent_grid();
  float* const tile = reinterpret_cast<float*>(smem);      // [kBlockRows][kColumns], swizzled
  float* const weights = tile + kBlockRows * S::kColumns;  // the block's routing weights
  float* const peer_amax = weights + kBlockRows;           // pairs: [kb % 2][logical column], written by the peer

  const int half = S::kCluster > 1 ? static_cast<int>(device::cluster_cta_rank()) : 0;
  const TokenMajorGroup group = find_token_major_group(args.offsets, args.experts, args.capacity,
                                                       static_cast<int>(blockIdx.x) / S::kCluster);
  if (group.rows == 0) return;  // uniform over the block and its cluster
  // Pairs: the peer must have started before this block writes into its shared memory (the first column pass).
  if constexpr (S::kCluster > 1) cuda::ptx::barrier_cluster_arrive(cuda::ptx::sem_relaxed);
  const int first_row = group.first + kBlockRows * half;                    // the block's first row
  const int rows = max(0, min(kBlockRows, group.rows - kBlockRows * half));  // of them, routed rows
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  if (t < kBlockRows) weights[t] = t < rows ? __ldg(args.row_weight + first_row + t) : 0.0f;
  __syncthreads();

  const int64_t I = args.I, blocks = I / S::kGroup;
  const SwigluBackwardFp8Outputs& out = args.out;

  // The row pass. The warp's rows lie in row group warp / (kLaneRows / kWarpRows) of the swizzle, so the lane's
  // float4 of a row (logical columns 4 lane .. 4 lane + 3 of a, dg and du) sits at run lane ^ that group.
  const int first_local = S::kWarpRows * warp;
  const int lane_run = 4 * (lane ^ (first_local / S::kLaneRows));
  float dot[S::kWarpRows] = {};
  const auto fetch = [&](RowLoads(&set)[S::kBatch], int64_t kb, int batch) {
#pragma unroll
    for (int j = 0; j < S::kBatch; ++j) {
      const int local = first_local + S::kBatch * batch + j;
      if (local < rows) {
        const int64_t row = first_row + local, column = kb * S::kGroup + 4 * lane;
        set[j].g = load_float4(args.g + row * I + column);
        set[j].gate = load_float4(args.h + row * 2 * I + column);
        set[j].up = load_float4(args.h + row * 2 * I + I + column);
      } else {
        set[j] = RowLoads{};
      }
    }
  };
  const auto row_pass = [&](const RowLoads(&set)[S::kBatch], int64_t kb, int batch) {
#pragma unroll
    for (int j = 0; j < S::kBatch; ++j) {
      const int local = first_local + S::kBatch * batch + j;
      // Rows past the group's are zeros in the tile (the token-major copy's padding) and are not written.
      SwigluRowValues v{};
      if (local < rows)  // uniform over the warp
        v = swiglu_backward_row_block(weights[local], set[j].g, set[j].gate, set[j].up, first_row + local, kb, I,
                                      out.dh_q, out.dh_s, out.dh_scales_pitch, lane, dot[S::kBatch * batch + j]);
      float* const tile_row = tile + local * S::kColumns + lane_run;
      store_float4(tile_row, v.a);
      store_float4(tile_row + S::kGroup, v.dg);
      store_float4(tile_row + 2 * S::kGroup, v.du);
    }
  };

  // The column pass: lane `part` of a column's eight takes rows kLaneRows part .. + kLaneRows - 1 (row group
  // `part`); a pass moves by whole bank rounds, so every load is one base plus a constant. Pass p reads logical
  // column kPassColumns p + pass_column.
  const int part = lane % 8, pass_column = S::kPassColumns / S::kWarps * warp + lane / 8;
  const float* const lane_tile = tile + S::kLaneRows * part * S::kColumns + (pass_column ^ (part << 2));
  const uint64_t k_block = static_cast<uint64_t>(group.column / S::kGroup);
  const auto lane_values = [&](int pass, float(&v)[S::kLaneRows]) {
#pragma unroll
    for (int i = 0; i < S::kLaneRows; ++i) v[i] = lane_tile[i * S::kColumns + S::kPassColumns * pass];
  };
  const auto store_pass = [&](int64_t kb, int pass, float scale, const uint32_t (&words)[S::kLaneRows / 4]) {
    // The pass's output (constants): a, then dh's gate half, then its up half.
    const int which = pass / S::kPerOutput;
    uint8_t* const qt = which == 0 ? out.at_q : out.dht_q;
    float* const st = which == 0 ? out.at_s : out.dht_s;
    const int64_t channels = which == 0 ? I : 2 * I;
    const int64_t c =
        (which == 2 ? I : 0) + kb * S::kGroup + S::kPassColumns * (pass % S::kPerOutput) + pass_column;
    store_codes<S::kLaneRows>(qt + c * args.columns + group.column + kBlockRows * half + S::kLaneRows * part,
                              words);
    if (part == 0 && half == 0) st[k_block * static_cast<uint64_t>(channels) + static_cast<uint64_t>(c)] = scale;
  };
  const auto column_pass = [&](int64_t kb) {
    if constexpr (S::kCluster == 1) {
#pragma unroll
      for (int pass = 0; pass < S::kPasses; ++pass) {
        float v[S::kLaneRows];
        lane_values(pass, v);
        const device::OctetGroupQuantized q = device::quantize_octet_group(v);
        store_pass(kb, pass, q.scale, q.words);
      }
    } else {
      // Each half's maxima of the kb's columns into the peer's shared memory, then the group's scales from both.
      float* const exchange = peer_amax + (kb % 2) * S::kColumns;
      const uint32_t peer = static_cast<uint32_t>(half ^ 1);
      float own[S::kPasses];
#pragma unroll
      for (int pass = 0; pass < S::kPasses; ++pass) {
        float v[S::kLaneRows];
        lane_values(pass, v);
        own[pass] = device::octet_amax(v);
        if (part == 0) device::store_peer_shared(exchange + S::kPassColumns * pass + pass_column, peer, own[pass]);
      }
      device::cluster_sync();
#pragma unroll
      for (int pass = 0; pass < S::kPasses; ++pass) {
        float v[S::kLaneRows];
        lane_values(pass, v);
        const float scale =
            device::scale_from_amax(fmaxf(own[pass], exchange[S::kPassColumns * pass + pass_column]));
        uint32_t words[S::kLaneRows / 4];
        device::e4m3_words_of(v, scale, words);
        store_pass(kb, pass, scale, words);
      }
    }
  };

  RowLoads ring[2][S::kBatch];
  fetch(ring[0], 0, 0);
  for (int64_t kb = 0; kb < blocks; ++kb) {
#pragma unroll
    for (int b = 0; b < S::kBatches; ++b) {
      if (b + 1 < S::kBatches) fetch(ring[(b + 1) % 2], kb, b + 1);
      row_pass(ring[b % 2], kb, b);
    }
    __syncthreads();
    if (kb + 1 < blocks) fetch(ring[0], kb + 1, 0);
    if constexpr (S::kCluster > 1)
      if (kb == 0) cuda::ptx::barrier_cluster_wait(cuda::ptx::sem_acquire);  // the start handshake
    column_pass(kb);
    __syncthreads();  // before the next row pass writes the tile
  }

  // The dots (swiglu_backward_row.cuh).
#pragma unroll
  for (int i = 0; i < S::kWarpRows; ++i)
    if (first_local + i < rows)  // uniform over the warp
      store_row_dot(dot[i], out.dot_rows, first_row + first_local + i, out.dot_parts, lane);
}

bool misaligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) != 0; }

template <int kBlockRows>
Status launch_step(const Args& args, int64_t groups, cudaStream_t stream) {
  using S = StepShape<kBlockRows>;
  const auto kernel = swiglu_backward_fp8_kernel<kBlockRows>;
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
  return kernels::launch_dependent_in_clusters(kernel, dim3(static_cast<unsigned>(groups * S::kCluster)),
                                               dim3(S::kThreads), S::kCluster, S::kSmemBytes, stream,
                                               "swiglu_backward_fp8_kernel", args);
}

}  // namespace

Status swiglu_backward_quantize_fp8(const float* g, const float* h, const float* row_weight, int64_t I,
                                    const int32_t* offsets, int experts, int64_t capacity,
                                    const SwigluBackwardFp8Outputs& out, cudaStream_t stream,
                                    SwigluBackwardBlocks blocks) {
  const std::string what = "swiglu_backward_quantize_fp8";
  if (I <= 0 || I % kTokenMajorGroup != 0 || experts < 1 || capacity < 0)
    return Status::invalid(what + ": I must be a positive multiple of 128, experts >= 1 and capacity >= 0, got I=" +
                           std::to_string(I) + " experts=" + std::to_string(experts) +
                           " capacity=" + std::to_string(capacity));
  if (out.dh_scales_pitch < capacity)
    return Status::invalid(what + ": dh_scales_pitch must be at least capacity=" + std::to_string(capacity) +
                           ", got " + std::to_string(out.dh_scales_pitch));
  if (out.dot_rows != nullptr && out.dot_parts < 1)
    return Status::invalid(what + ": dot_parts must be >= 1 with dot_rows");
  const int64_t groups = (capacity + kTokenMajorGroup - 1) / kTokenMajorGroup + experts;
  if (groups >= (int64_t{1} << 30)) return Status::invalid(what + ": too many row groups");
  if (capacity == 0) return Status::ok();
  if (g == nullptr || h == nullptr || row_weight == nullptr || offsets == nullptr || out.dh_q == nullptr ||
      out.dh_s == nullptr || out.at_q == nullptr || out.at_s == nullptr || out.dht_q == nullptr ||
      out.dht_s == nullptr)
    return Status::invalid(what + ": null pointer");
  if (misaligned(g, 16) || misaligned(h, 16) || misaligned(out.at_q, 16) || misaligned(out.dht_q, 16) ||
      misaligned(out.dh_q, 4))
    return Status::invalid(what + ": g, h, at_q and dht_q must be 16-byte aligned, dh_q 4-byte aligned");
  const Args args{g, h, row_weight, I, offsets, experts, capacity, token_major_columns(capacity, experts), out};
  return blocks == SwigluBackwardBlocks::kPairPerGroup ? launch_step<64>(args, groups, stream)
                                                       : launch_step<128>(args, groups, stream);
}

Status swiglu_backward_fp8_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_backward_fp8_kernel<64>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_backward_fp8_kernel<128>));
  return Status::ok();
}

}  // namespace megamoe::kernels
