#include "device/epilogue/transforms.cuh"
#include "device/fp8_codes.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/fp8_quantize.hpp"
#include "kernels/swiglu_backward_row.cuh"
#include "kernels/warp_grid.hpp"

namespace megamoe::kernels {
namespace {

using device::e4m3_words_of;
using device::quantize_warp_group;
using device::scale_from_amax;
using device::WarpGroupQuantized;

constexpr int kGroup = 128;
constexpr int kWarpsPerBlock = 8;

// One warp per 1x128 group: each lane holds 4 consecutive values (one 8-byte load). pitch 0: scales
// row-major [rows, groups_per_row]; else K-block-major (group kb of row r at kb * pitch + r).
__global__ void quantize_rows_1x128_kernel(const __nv_bfloat16* __restrict__ x, int64_t num_groups,
                                           int64_t groups_per_row, int64_t pitch, uint8_t* __restrict__ q,
                                           float* __restrict__ scales) {
  device::begin_dependent_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t group = warp; group < num_groups; group += warp_stride) {
    const int64_t base = group * kGroup + lane * 4;
    const uint2 packed = *reinterpret_cast<const uint2*>(x + base);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&packed.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&packed.y);
    const float v[4] = {__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi)};
    const WarpGroupQuantized qv = quantize_warp_group(v);
    *reinterpret_cast<uint32_t*>(q + base) = qv.bytes;
    if (lane == 0) {
      const int64_t row = group / groups_per_row, kb = group % groups_per_row;
      scales[pitch == 0 ? group : kb * pitch + row] = qv.scale;
    }
  }
}

// One warp per row, its 1x128 groups of a = silu(g) * u in turn: lane holds 4 consecutive gate values and the
// 4 matching up values (two 16-byte loads). A warp per group had to split its group index into row and group
// by a 64-bit division, about 70 of the 173 instructions a group (docs/PERF.md runs 71-72). Only rows
// [0, *rows_used) when rows_used is given (read once per warp).
__global__ void swiglu_quantize_rows_1x128_kernel(const float* __restrict__ h, int64_t rows, int64_t I,
                                                  const int32_t* __restrict__ rows_used, int64_t pitch,
                                                  uint8_t* __restrict__ aq, float* __restrict__ scales) {
  device::begin_dependent_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t groups_per_row = I / kGroup;
  int64_t limit = rows;
  if (rows_used != nullptr) limit = min(max(static_cast<int64_t>(*rows_used), int64_t{0}), rows);
  for (int64_t row = warp; row < limit; row += warp_stride) {
    const float* h_row = h + row * 2 * I + lane * 4;
    uint8_t* aq_row = aq + row * I + lane * 4;
    for (int64_t kb = 0; kb < groups_per_row; ++kb) {
      const float4 g = *reinterpret_cast<const float4*>(h_row + kb * kGroup);
      const float4 u = *reinterpret_cast<const float4*>(h_row + I + kb * kGroup);
      const float a[4] = {device::swiglu(g.x, u.x), device::swiglu(g.y, u.y), device::swiglu(g.z, u.z),
                          device::swiglu(g.w, u.w)};
      const WarpGroupQuantized qa = quantize_warp_group(a);
      *reinterpret_cast<uint32_t*>(aq_row + kb * kGroup) = qa.bytes;
      if (lane == 0) scales[kb * pitch + row] = qa.scale;
    }
  }
}

// One warp per row: for each 128-column group kb of I, lane holds 4 consecutive columns; the gate group kb
// and the up group I / 128 + kb of dh are quantized from them (two amaxes), and the row's <g, a> is summed
// in a fixed order (per lane over kb, then the butterfly): the same bits every run.
__global__ void swiglu_backward_quantize_rows_1x128_kernel(const float* __restrict__ g, const float* __restrict__ h,
                                                           const float* __restrict__ row_weight, int64_t rows,
                                                           int64_t I, const int32_t* __restrict__ rows_used,
                                                           int64_t pitch, uint8_t* __restrict__ dh_q,
                                                           float* __restrict__ dh_s, float* __restrict__ a_out,
                                                           float* const* __restrict__ dot_rows, int dot_parts) {
  device::begin_dependent_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  int64_t limit = rows;
  if (rows_used != nullptr) limit = min(max(static_cast<int64_t>(*rows_used), int64_t{0}), rows);
  const int64_t groups = I / kGroup;
  for (int64_t row = warp; row < limit; row += warp_stride) {
    const float w = row_weight[row];
    const float* g_row = g + row * I;
    const float* h_row = h + row * 2 * I;
    float dot = 0.0f;
    for (int64_t kb = 0; kb < groups; ++kb) {
      const int64_t col = kb * kGroup + lane * 4;
      const SwigluRowValues v = swiglu_backward_row_block(
          w, *reinterpret_cast<const float4*>(g_row + col), *reinterpret_cast<const float4*>(h_row + col),
          *reinterpret_cast<const float4*>(h_row + I + col), row, kb, I, dh_q, dh_s, pitch, lane, dot);
      if (a_out != nullptr)
        *reinterpret_cast<float4*>(a_out + row * I + col) = make_float4(v.a[0], v.a[1], v.a[2], v.a[3]);
    }
    store_row_dot(dot, dot_rows, row, dot_parts, lane);
  }
}

// One block of 256 threads per 128 x 128 weight block: thread t reads 8 values (16 bytes) of rows t / 16 +
// 16 i, i = 0..7, at columns 8 (t % 16) .. + 7; the block's amax is reduced over warps in shared memory.
constexpr int kBlockThreads = 256;
__global__ void __launch_bounds__(kBlockThreads) quantize_blocks_128x128_kernel(const __nv_bfloat16* __restrict__ w,
                                                                               int64_t rows, int64_t cols,
                                                                               uint8_t* __restrict__ q,
                                                                               float* __restrict__ scales) {
  device::begin_dependent_grid();
  __shared__ float warp_amax[kBlockThreads / 32];
  const int64_t block_cols = cols / kGroup;
  const int64_t br = blockIdx.x / block_cols, bc = blockIdx.x % block_cols;
  const int t = threadIdx.x;
  const int64_t col = bc * kGroup + 8 * (t % 16);
  float v[8][8];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = br * kGroup + t / 16 + 16 * i;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[i][k] = 0.0f;
    if (row < rows) {
      const uint4 raw = *reinterpret_cast<const uint4*>(w + row * cols + col);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[i][2 * k] = __low2float(h[k]);
        v[i][2 * k + 1] = __high2float(h[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[i][k]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (t % 32 == 0) warp_amax[t / 32] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int i = 1; i < kBlockThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = scale_from_amax(amax);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t row = br * kGroup + t / 16 + 16 * i;
    if (row >= rows) continue;
    uint32_t words[2];
    e4m3_words_of(v[i], scale, words);
    *reinterpret_cast<uint2*>(q + row * cols + col) = make_uint2(words[0], words[1]);
  }
  if (t == 0) scales[blockIdx.x] = scale;
}

// One block of 256 threads per 128 x 128 block of one group's [N, K] matrix, which carries its scale along.
// The block's bytes pass through shared memory as 32-bit words, row r's word w at position
// w ^ transpose_swizzle(r) of its 128-byte row, so that both the loads' four consecutive rows (eight lanes a
// row) and the reads' 32 rows four apart (a lane each) hit 32 distinct banks. Each thread then takes four
// rows x four columns a word at a time, transposes the 4 x 4 bytes in registers (byte permutes) and stores
// four 4-byte pieces of columns: a warp's 32 lanes write one column's 128 rows, one 128-byte line. (The
// earlier 64 x 64 tiles, read back a byte at a time with 4-way bank conflicts, moved 2 TB/s: docs/PERF.md.)
constexpr int kTransposeBlock = 128;
__device__ __forceinline__ int transpose_swizzle(int r) { return ((r >> 2) & 31) ^ (r & 3); }

__global__ void __launch_bounds__(256) transpose_blocks_128x128_kernel(const uint8_t* __restrict__ q,
                                                                     const float* __restrict__ scales, int64_t N,
                                                                     int64_t K, uint8_t* __restrict__ qt,
                                                                     float* __restrict__ scales_t) {
  device::begin_dependent_grid();
  __shared__ uint32_t tile[kTransposeBlock * kTransposeBlock / 4];
  const int64_t k_blocks = K / kTransposeBlock, n_blocks = N / kTransposeBlock;
  const int64_t e = blockIdx.z, nb = blockIdx.x / k_blocks, kb = blockIdx.x % k_blocks;
  const int64_t n0 = nb * kTransposeBlock, k0 = kb * kTransposeBlock;
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, warp = t / 32;
  const uint8_t* src = q + (e * N + n0) * K + k0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = t / 8 + 32 * i, w0 = 4 * (t % 8);
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + r * K) + t % 8);
    uint32_t* row = tile + r * 32;
    const int swizzle = transpose_swizzle(r);
    row[(w0 + 0) ^ swizzle] = v.x;
    row[(w0 + 1) ^ swizzle] = v.y;
    row[(w0 + 2) ^ swizzle] = v.z;
    row[(w0 + 3) ^ swizzle] = v.w;
  }
  __syncthreads();
  uint8_t* dst = qt + (e * K + k0) * N + n0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int w = warp + 8 * k;  // bytes 4 w .. 4 w + 3 of rows 4 lane .. 4 lane + 3
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * lane + i;
      a[i] = tile[r * 32 + (w ^ transpose_swizzle(r))];
    }
    // a[i] byte j is (row 4 lane + i, column 4 w + j); column[j] byte i is the same byte.
    const uint32_t low01 = __byte_perm(a[0], a[1], 0x5140), high01 = __byte_perm(a[0], a[1], 0x7362);
    const uint32_t low23 = __byte_perm(a[2], a[3], 0x5140), high23 = __byte_perm(a[2], a[3], 0x7362);
    const uint32_t column[4] = {__byte_perm(low01, low23, 0x5410), __byte_perm(low01, low23, 0x7632),
                                __byte_perm(high01, high23, 0x5410), __byte_perm(high01, high23, 0x7632)};
#pragma unroll
    for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(dst + (4 * w + j) * N + 4 * lane) = column[j];
  }
  if (t == 0) scales_t[(e * k_blocks + kb) * n_blocks + nb] = scales[(e * n_blocks + nb) * k_blocks + kb];
}

}  // namespace

Status transpose_blocks_128x128_e4m3(const uint8_t* q, const float* scales, int64_t groups, int64_t N, int64_t K,
                                     uint8_t* qt, float* scales_t, cudaStream_t stream) {
  if (groups < 0 || N < 0 || K < 0 || N % kGroup != 0 || K % kGroup != 0)
    return Status::invalid("transpose_blocks_128x128: N and K must be multiples of 128 and groups >= 0, got groups=" +
                           std::to_string(groups) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
  if (groups == 0 || N == 0 || K == 0) return Status::ok();
  if (q == nullptr || scales == nullptr || qt == nullptr || scales_t == nullptr)
    return Status::invalid("transpose_blocks_128x128: null pointer");
  if ((reinterpret_cast<uintptr_t>(q) & 15u) != 0 || (reinterpret_cast<uintptr_t>(qt) & 15u) != 0)
    return Status::invalid("transpose_blocks_128x128: q and qt must be 16-byte aligned");
  const int64_t tiles = (N / kTransposeBlock) * (K / kTransposeBlock);
  if (tiles >= (int64_t{1} << 31) || groups > 65535)
    return Status::invalid("transpose_blocks_128x128: too many tiles or groups");
  const dim3 grid(static_cast<unsigned>(tiles), 1, static_cast<unsigned>(groups));
  return kernels::launch_dependent(transpose_blocks_128x128_kernel, grid, dim3(256), 0, stream,
                                   "transpose_blocks_128x128_kernel", q, scales, N, K, qt, scales_t);
}

Status quantize_rows_1x128_bf16(const __nv_bfloat16* x, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                cudaStream_t stream, int64_t scales_pitch) {
  if (rows < 0 || cols <= 0 || cols % kGroup != 0)
    return Status::invalid("quantize_rows_1x128: cols must be a positive multiple of 128 and rows >= 0, got rows=" +
                           std::to_string(rows) + " cols=" + std::to_string(cols));
  if (scales_pitch != 0 && scales_pitch < rows)
    return Status::invalid("quantize_rows_1x128: scales_pitch must be 0 (row-major scales) or at least rows=" +
                           std::to_string(rows) + ", got " + std::to_string(scales_pitch));
  if (rows == 0) return Status::ok();
  if (x == nullptr || q == nullptr || scales == nullptr)
    return Status::invalid("quantize_rows_1x128: null pointer");
  const int64_t num_groups = rows * (cols / kGroup);
  int blocks = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid((num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock, &blocks));
  return kernels::launch_dependent(quantize_rows_1x128_kernel, dim3(blocks), dim3(kWarpsPerBlock * 32), 0, stream,
                                   "quantize_rows_1x128_kernel", x, num_groups, cols / kGroup, scales_pitch, q, scales);
}

Status swiglu_quantize_rows_1x128(const float* h, int64_t rows, int64_t I, const int32_t* rows_used,
                                  uint8_t* aq, float* scales, int64_t scales_pitch, cudaStream_t stream) {
  if (rows < 0 || I <= 0 || I % kGroup != 0)
    return Status::invalid("swiglu_quantize_rows_1x128: I must be a positive multiple of 128 and rows >= 0, got rows=" +
                           std::to_string(rows) + " I=" + std::to_string(I));
  if (scales_pitch < rows)
    return Status::invalid("swiglu_quantize_rows_1x128: scales_pitch must be at least rows=" + std::to_string(rows) +
                           ", got " + std::to_string(scales_pitch));
  if (rows == 0) return Status::ok();
  if (h == nullptr || aq == nullptr || scales == nullptr)
    return Status::invalid("swiglu_quantize_rows_1x128: null pointer");
  if ((reinterpret_cast<uintptr_t>(h) & 15u) != 0 || (reinterpret_cast<uintptr_t>(aq) & 3u) != 0)
    return Status::invalid("swiglu_quantize_rows_1x128: h must be 16-byte and aq 4-byte aligned");
  // Sized for every row; with rows_used the warps past the used rows find no work.
  int blocks = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, &blocks));
  return kernels::launch_dependent(swiglu_quantize_rows_1x128_kernel, dim3(blocks), dim3(kWarpsPerBlock * 32), 0,
                                   stream, "swiglu_quantize_rows_1x128_kernel", h, rows, I, rows_used, scales_pitch, aq,
                                   scales);
}

Status swiglu_backward_quantize_rows_1x128(const float* g, const float* h, const float* row_weight, int64_t rows,
                                           int64_t I, const int32_t* rows_used, uint8_t* dh_q, float* dh_s,
                                           int64_t scales_pitch, float* a_out, float* const* dot_rows, int dot_parts,
                                           cudaStream_t stream) {
  if (rows < 0 || I <= 0 || I % kGroup != 0)
    return Status::invalid("swiglu_backward_quantize_rows_1x128: I must be a positive multiple of 128 and rows >= 0, "
                           "got rows=" + std::to_string(rows) + " I=" + std::to_string(I));
  if (scales_pitch < rows)
    return Status::invalid("swiglu_backward_quantize_rows_1x128: scales_pitch must be at least rows=" +
                           std::to_string(rows) + ", got " + std::to_string(scales_pitch));
  if (dot_rows != nullptr && dot_parts < 1)
    return Status::invalid("swiglu_backward_quantize_rows_1x128: dot_parts must be >= 1 with dot_rows");
  if (rows == 0) return Status::ok();
  if (g == nullptr || h == nullptr || row_weight == nullptr || dh_q == nullptr || dh_s == nullptr)
    return Status::invalid("swiglu_backward_quantize_rows_1x128: null pointer");
  if ((reinterpret_cast<uintptr_t>(g) & 15u) != 0 || (reinterpret_cast<uintptr_t>(h) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(a_out) & 15u) != 0 || (reinterpret_cast<uintptr_t>(dh_q) & 3u) != 0)
    return Status::invalid("swiglu_backward_quantize_rows_1x128: g, h and a_out must be 16-byte, dh_q 4-byte aligned");
  int blocks = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, &blocks));
  return kernels::launch_dependent(swiglu_backward_quantize_rows_1x128_kernel, dim3(blocks), dim3(kWarpsPerBlock * 32),
                                   0, stream, "swiglu_backward_quantize_rows_1x128_kernel", g, h, row_weight, rows, I,
                                   rows_used, scales_pitch, dh_q, dh_s, a_out, dot_rows, dot_parts);
}

Status quantize_blocks_128x128_bf16(const __nv_bfloat16* w, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                    cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % kGroup != 0)
    return Status::invalid("quantize_blocks_128x128: cols must be a positive multiple of 128 and rows >= 0, got "
                           "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  if (rows == 0) return Status::ok();
  if (w == nullptr || q == nullptr || scales == nullptr)
    return Status::invalid("quantize_blocks_128x128: null pointer");
  if ((reinterpret_cast<uintptr_t>(w) & 15u) != 0 || (reinterpret_cast<uintptr_t>(q) & 7u) != 0)
    return Status::invalid("quantize_blocks_128x128: w must be 16-byte and q 8-byte aligned");
  const int64_t blocks = (rows + kGroup - 1) / kGroup * (cols / kGroup);
  if (blocks >= (int64_t{1} << 31)) return Status::invalid("quantize_blocks_128x128: too many blocks");
  return kernels::launch_dependent(quantize_blocks_128x128_kernel, dim3(static_cast<unsigned>(blocks)),
                                   dim3(kBlockThreads), 0, stream, "quantize_blocks_128x128_kernel", w, rows, cols, q,
                                   scales);
}

Status fp8_quantize_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, quantize_rows_1x128_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_quantize_rows_1x128_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, swiglu_backward_quantize_rows_1x128_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, quantize_blocks_128x128_kernel));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, transpose_blocks_128x128_kernel));
  return Status::ok();
}

}  // namespace megamoe::kernels
