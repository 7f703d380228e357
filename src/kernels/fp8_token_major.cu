// One block of 256 threads per (group of 128 routed rows of one expert, 64 channels): the rows are read
// row-major (half a warp per row, 4 channels a lane, coalesced) into a shared fp32 tile (33 KB); then each
// channel's 128 values are taken by four threads of 32 rows each, whose amax meets by shuffles, and stored
// as 32 contiguous E4M3 bytes each of the channel's row of the copy (fp8_token_major.hpp).
#include <string>

#include "device/epilogue/transforms.cuh"
#include "device/fp8_codes.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/fp8_token_major.hpp"

namespace megamoe::kernels {
namespace {

constexpr int kGroup = 128;
constexpr int kThreads = 256;
constexpr int kChannelsPerBlock = 64;

struct Fp32Rows {
  const float* rows;
  int64_t channels;
  __device__ __forceinline__ void load4(int64_t r, int64_t c, float (&v)[4]) const {
    const float4 x = *reinterpret_cast<const float4*>(rows + r * channels + c);
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
  }
};

struct E4m3Rows {
  const uint8_t* q;
  const float* scales;
  int64_t source_rows;
  const int32_t* row_src;
  const float* row_weight;
  int64_t channels;
  __device__ __forceinline__ void load4(int64_t r, int64_t c, float (&v)[4]) const {
    const int64_t src = row_src[r];
    if (src < 0 || src >= source_rows) {
      v[0] = v[1] = v[2] = v[3] = 0.0f;
      return;
    }
    const uint32_t codes = *reinterpret_cast<const uint32_t*>(q + src * channels + c);
    const float scale = scales[src * (channels / kGroup) + c / kGroup];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = device::e4m3_value(codes >> (8 * k)) * scale;
      if (row_weight != nullptr) v[k] *= row_weight[r];
    }
  }
};

// a = silu(g) u of GEMM1's fp32 output h [rows, 2I] (gate columns, then up), I channels: the forward's
// activation, recomputed with the epilogues' arithmetic (device/epilogue/transforms.cuh).
struct SwigluRows {
  const float* h;
  int64_t I;
  __device__ __forceinline__ void load4(int64_t r, int64_t c, float (&v)[4]) const {
    const float4 g = *reinterpret_cast<const float4*>(h + r * 2 * I + c);
    const float4 u = *reinterpret_cast<const float4*>(h + r * 2 * I + I + c);
    v[0] = device::swiglu(g.x, u.x);
    v[1] = device::swiglu(g.y, u.y);
    v[2] = device::swiglu(g.z, u.z);
    v[3] = device::swiglu(g.w, u.w);
  }
};

// dh = SwiGLU'(w g) of row r, 2I channels (dg for the gate columns, then du), from g [rows, I], h and the
// row's routing weight: the values swiglu_backward_quantize_rows_1x128 (fp8_quantize.hpp) quantizes along
// the channels, the same arithmetic.
struct SwigluGradRows {
  const float* g;
  const float* h;
  const float* row_weight;
  int64_t I;
  __device__ __forceinline__ void load4(int64_t r, int64_t c, float (&v)[4]) const {
    const bool up = c >= I;
    const int64_t j = up ? c - I : c;
    const float w = row_weight[r];
    const float4 gs = *reinterpret_cast<const float4*>(g + r * I + j);
    const float4 hg = *reinterpret_cast<const float4*>(h + r * 2 * I + j);
    const float4 hu = *reinterpret_cast<const float4*>(h + r * 2 * I + I + j);
    const float da[4] = {w * gs.x, w * gs.y, w * gs.z, w * gs.w};
    const float gate[4] = {hg.x, hg.y, hg.z, hg.w}, upv[4] = {hu.x, hu.y, hu.z, hu.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const device::SwiGLUGrad d = device::swiglu_backward(da[k], gate[k], upv[k]);
      v[k] = up ? d.du : d.dg;
    }
  }
};

template <class Rows>
__global__ void __launch_bounds__(kThreads) token_major_quantize_kernel(Rows rows, const int32_t* __restrict__ offsets,
                                                                        int experts, int64_t capacity,
                                                                        int64_t channels, int64_t columns,
                                                                        uint8_t* __restrict__ qt,
                                                                        float* __restrict__ st) {
  __shared__ float tile[kGroup][kChannelsPerBlock + 1];
  // The block's group: how many rows it has (0: the block has none), its first row, its first column.
  __shared__ int64_t group_rows, group_first, group_column;
  const int t = threadIdx.x;
  if (t == 0) {
    // Groups are numbered expert by expert. Each expert's rows are clamped to start where the previous one's
    // end and to stay inside [0, capacity]: then no group reads past the rows or writes into another
    // expert's columns, whatever the offsets hold.
    group_rows = 0;
    int64_t remaining = blockIdx.x, previous_end = 0;
    for (int e = 0; e < experts; ++e) {
      const int64_t begin = min(max(static_cast<int64_t>(offsets[e]), previous_end), capacity);
      const int64_t end = min(max(static_cast<int64_t>(offsets[e + 1]), begin), capacity);
      previous_end = end;
      const int64_t groups = (end - begin + kGroup - 1) / kGroup;
      if (remaining < groups) {
        group_first = begin + remaining * kGroup;
        group_rows = min(end - group_first, static_cast<int64_t>(kGroup));
        group_column = token_major_start(begin, e) + remaining * kGroup;
        break;
      }
      remaining -= groups;
    }
  }
  __syncthreads();
  const int valid = static_cast<int>(group_rows);
  if (valid == 0) return;  // uniform over the block
  const int64_t first = group_first, column = group_column;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kChannelsPerBlock;

  constexpr int kLanesPerRow = kChannelsPerBlock / 4, kRowsPerPass = kThreads / kLanesPerRow;
  const int quad = t % kLanesPerRow;
#pragma unroll 4
  for (int i = 0; i < kGroup / kRowsPerPass; ++i) {
    const int rr = t / kLanesPerRow + kRowsPerPass * i;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (rr < valid) rows.load4(first + rr, c0 + 4 * quad, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[rr][4 * quad + k] = v[k];
  }
  __syncthreads();

  constexpr int kThreadsPerChannel = kThreads / kChannelsPerBlock, kRowsPerThread = kGroup / kThreadsPerChannel;
  const int c = t / kThreadsPerChannel, part = t % kThreadsPerChannel;
  float amax = 0.0f;
#pragma unroll 8
  for (int i = 0; i < kRowsPerThread; ++i) amax = fmaxf(amax, fabsf(tile[part * kRowsPerThread + i][c]));
#pragma unroll
  for (int offset = 1; offset < kThreadsPerChannel; offset *= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = device::scale_from_amax(amax);
  uint8_t* dst = qt + (c0 + c) * columns + column + part * kRowsPerThread;
#pragma unroll
  for (int chunk = 0; chunk < kRowsPerThread / 16; ++chunk) {
    uint32_t word[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < 16; ++k)
      word[k / 4] |= device::e4m3_of(tile[part * kRowsPerThread + 16 * chunk + k][c], scale) << (8 * (k % 4));
    *reinterpret_cast<uint4*>(dst + 16 * chunk) = make_uint4(word[0], word[1], word[2], word[3]);
  }
  if (part == 0) st[(column / kGroup) * channels + c0 + c] = scale;
}

Status check_common(const char* what, int64_t channels, const int32_t* offsets, int experts, int64_t capacity,
                    const uint8_t* qt, const float* st) {
  if (channels <= 0 || channels % kGroup != 0 || experts < 1 || capacity < 0)
    return Status::invalid(std::string(what) + ": channels must be a positive multiple of 128, experts >= 1 and "
                           "capacity >= 0, got channels=" + std::to_string(channels) + " experts=" +
                           std::to_string(experts) + " capacity=" + std::to_string(capacity));
  if (offsets == nullptr || qt == nullptr || st == nullptr) return Status::invalid(std::string(what) + ": null pointer");
  if ((reinterpret_cast<uintptr_t>(qt) & 15u) != 0)
    return Status::invalid(std::string(what) + ": qt must be 16-byte aligned");
  const int64_t groups = (capacity + kGroup - 1) / kGroup + experts;
  if (groups >= (int64_t{1} << 31) || channels / kChannelsPerBlock > 65535)
    return Status::invalid(std::string(what) + ": too many row groups or channel blocks");
  return Status::ok();
}

template <class Rows>
Status launch(const char* what, const Rows& rows, int64_t channels, const int32_t* offsets, int experts,
              int64_t capacity, uint8_t* qt, float* st, cudaStream_t stream) {
  // Every possible group gets a block (the counts are on the device): at most one partial group per expert.
  const int64_t groups = (capacity + kGroup - 1) / kGroup + experts;
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>(channels / kChannelsPerBlock), 1);
  token_major_quantize_kernel<Rows><<<grid, kThreads, 0, stream>>>(rows, offsets, experts, capacity, channels,
                                                                  token_major_columns(capacity, experts), qt, st);
  MEGAMOE_CHECK_LAUNCH(stream, what);
  return Status::ok();
}

}  // namespace

Status token_major_quantize_fp32(const float* rows, int64_t channels, const int32_t* offsets, int experts,
                                 int64_t capacity, uint8_t* qt, float* st, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_fp32", channels, offsets, experts, capacity, qt, st));
  if (capacity == 0) return Status::ok();
  if (rows == nullptr || (reinterpret_cast<uintptr_t>(rows) & 15u) != 0)
    return Status::invalid("token_major_quantize_fp32: rows must be non-null and 16-byte aligned");
  return launch("token_major_quantize_kernel<Fp32Rows>", Fp32Rows{rows, channels}, channels, offsets, experts,
                capacity, qt, st, stream);
}

Status token_major_quantize_e4m3(const uint8_t* q, const float* scales, int64_t source_rows, const int32_t* row_src,
                                 const float* row_weight, int64_t channels, const int32_t* offsets, int experts,
                                 int64_t capacity, uint8_t* qt, float* st, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_e4m3", channels, offsets, experts, capacity, qt, st));
  if (source_rows < 0) return Status::invalid("token_major_quantize_e4m3: source_rows must be >= 0");
  if (capacity == 0) return Status::ok();
  if (q == nullptr || scales == nullptr || row_src == nullptr)
    return Status::invalid("token_major_quantize_e4m3: null pointer");
  if ((reinterpret_cast<uintptr_t>(q) & 3u) != 0)
    return Status::invalid("token_major_quantize_e4m3: q must be 4-byte aligned");
  return launch("token_major_quantize_kernel<E4m3Rows>",
                E4m3Rows{q, scales, source_rows, row_src, row_weight, channels}, channels, offsets, experts, capacity,
                qt, st, stream);
}

Status token_major_quantize_swiglu(const float* h, int64_t I, const int32_t* offsets, int experts, int64_t capacity,
                                   uint8_t* qt, float* st, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_swiglu", I, offsets, experts, capacity, qt, st));
  if (capacity == 0) return Status::ok();
  if (h == nullptr || (reinterpret_cast<uintptr_t>(h) & 15u) != 0)
    return Status::invalid("token_major_quantize_swiglu: h must be non-null and 16-byte aligned");
  return launch("token_major_quantize_kernel<SwigluRows>", SwigluRows{h, I}, I, offsets, experts, capacity, qt, st,
                stream);
}

Status token_major_quantize_swiglu_grad(const float* g, const float* h, const float* row_weight, int64_t I,
                                        const int32_t* offsets, int experts, int64_t capacity, uint8_t* qt, float* st,
                                        cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_common("token_major_quantize_swiglu_grad", I, offsets, experts, capacity, qt, st));
  if (capacity == 0) return Status::ok();
  if (g == nullptr || h == nullptr || row_weight == nullptr || (reinterpret_cast<uintptr_t>(g) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(h) & 15u) != 0)
    return Status::invalid("token_major_quantize_swiglu_grad: g, h and row_weight must be non-null, g and h 16-byte "
                           "aligned");
  return launch("token_major_quantize_kernel<SwigluGradRows>", SwigluGradRows{g, h, row_weight, I}, 2 * I, offsets,
                experts, capacity, qt, st, stream);
}

Status token_major_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<Fp32Rows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<E4m3Rows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<SwigluRows>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, token_major_quantize_kernel<SwigluGradRows>));
  return Status::ok();
}

}  // namespace megamoe::kernels
