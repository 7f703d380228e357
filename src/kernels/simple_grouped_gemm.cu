// Simple grouped GEMM on tensor cores through nvcuda::wmma (bf16 16x16x16 fragments, fp32 accumulate).
//
// Tiling: one block of 8 warps computes a 128x128 output tile; BK = 32; each warp owns a 64x32 sub-tile
// (2 warps along m x 4 along n, 4x2 accumulator fragments). Operand tiles go to shared memory in the
// operand's own global orientation (the wmma fragment layout follows it: row_major when the operand is
// contiguous along j, col_major otherwise), through a 4-stage cp.async pipeline: 16-byte copies where 8
// consecutive elements are in range and 16-byte aligned, a masked scalar fallback otherwise (zeros beyond
// the edges). Epilogue: each warp stages 16x32 fp32 of its accumulators in shared memory and writes them out
// 4 consecutive columns per lane (vector stores when aligned), applying row_scale / row_destinations /
// accumulate.
//
// Persistent: the grid is at most max_blocks (default: one block per SM) and blocks stride over the work
// items (group, m-tile, n-tile). In M-grouped mode the tile counts per group come from the device offsets:
// every block computes the prefix of tiles per group in shared memory at start, then maps a work index to its
// group by binary search. In K-grouped mode every group has the same number of output tiles (an empty group
// still writes its C_g).
#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "device/epilogue/transforms.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/dependent_launch.hpp"
#include "kernels/simple_grouped_gemm.hpp"

namespace megamoe::kernels {
namespace {

constexpr int kBM = 128;
constexpr int kBN = 128;
constexpr int kBK = 32;
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpM = 64;  // rows of the output tile per warp
constexpr int kWarpN = 32;  // columns per warp
constexpr int kWarpsAlongN = kBN / kWarpN;
constexpr int kFragsM = kWarpM / 16;
constexpr int kFragsN = kWarpN / 16;
constexpr int kPad = 8;  // bf16 elements of padding per shared-memory row (16 bytes): fewer bank conflicts

static_assert((kBM / kWarpM) * (kBN / kWarpN) == kWarps, "warp layout must cover the tile");

// Shared-memory footprint of one operand tile, either orientation (the larger of the two).
constexpr int tile_elems(int i_extent, int j_extent) {
  const int contig_j = i_extent * (j_extent + kPad);
  const int contig_i = j_extent * (i_extent + kPad);
  return contig_j > contig_i ? contig_j : contig_i;
}
constexpr int kATileElems = tile_elems(kBM, kBK);
constexpr int kBTileElems = tile_elems(kBK, kBN);
constexpr int kStageBytes = (kATileElems + kBTileElems) * 2;
constexpr int kEpiLd = kWarpN + 4;  // fp32 staging row stride (multiple of 4 floats, rows 16-byte aligned)
constexpr int kEpiBytesPerWarp = 16 * kEpiLd * 4;
constexpr int kPipelineBytes = kStages * kStageBytes;
constexpr int kEpiBytes = kWarps * kEpiBytesPerWarp;
constexpr int kFixedSmemBytes = kPipelineBytes + kEpiBytes;

static_assert(kATileElems * 2 % 128 == 0 && kBTileElems * 2 % 128 == 0, "tiles keep 128-byte alignment");
static_assert(kEpiBytesPerWarp % 32 == 0, "wmma store needs 32-byte aligned staging");

struct Params {
  const __nv_bfloat16* a;
  int64_t lda;
  int64_t a_group_stride;
  const __nv_bfloat16* b;
  int64_t ldb;
  int64_t b_group_stride;
  const int32_t* offsets;
  int num_groups;
  bool k_grouped;
  int m;  // K-grouped: rows of C_g
  int n;
  int k;  // M-grouped: reduction length
  int m_tiles;  // K-grouped only
  int n_tiles;
  void* c;
  int64_t ldc;
  int64_t c_group_stride;
  bool out_fp32;
  bool accumulate;
  const float* row_scale;
  void* const* row_destinations;
};

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Loads an OUTER x INNER tile (INNER contiguous in global memory and in shared memory, row stride
// INNER + kPad) whose origin is element (outer0, inner0) of p (address p + outer * ld + inner). Elements at
// outer >= outer_valid or inner >= inner_valid (counted from the origin) are zero-filled, never read.
template <int OUTER, int INNER>
__device__ __forceinline__ void load_tile(__nv_bfloat16* __restrict__ smem, const __nv_bfloat16* __restrict__ p,
                                          int64_t ld, int64_t outer0, int outer_valid, int64_t inner0,
                                          int inner_valid) {
  constexpr int kChunksPerRow = INNER / 8;
  constexpr int kChunks = OUTER * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int chunk = it * kThreads + static_cast<int>(threadIdx.x);
    const int o = chunk / kChunksPerRow;
    const int i = (chunk % kChunksPerRow) * 8;
    __nv_bfloat16* dst = smem + o * (INNER + kPad) + i;
    if (o < outer_valid && i < inner_valid) {
      const __nv_bfloat16* src = p + (outer0 + o) * ld + (inner0 + i);
      if (i + 8 <= inner_valid && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        cp_async_16(dst, src);
      } else {
        __align__(16) __nv_bfloat16 v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = i + e < inner_valid ? src[e] : __float2bfloat16(0.0f);
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
      }
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Loads the I x J tile of an operand with origin (i0, j0); vi / vj elements valid along i / j. Stored as
// [I][J + kPad] when the operand is contiguous along j (row_major for wmma), else [J][I + kPad] (col_major).
template <int I, int J, bool kContigJ>
__device__ __forceinline__ void load_operand(__nv_bfloat16* smem, const __nv_bfloat16* p, int64_t ld, int64_t i0,
                                             int vi, int64_t j0, int vj) {
  if constexpr (kContigJ) {
    load_tile<I, J>(smem, p, ld, i0, vi, j0, vj);
  } else {
    load_tile<J, I>(smem, p, ld, j0, vj, i0, vi);
  }
}

// Element (i, j) of a staged I x J tile.
template <int I, int J, bool kContigJ>
__device__ __forceinline__ constexpr int smem_offset(int i, int j) {
  return kContigJ ? i * (J + kPad) + j : j * (I + kPad) + i;
}
template <int I, int J, bool kContigJ>
__device__ __forceinline__ constexpr unsigned smem_ld() {
  return kContigJ ? J + kPad : I + kPad;
}

// Writes up to 4 consecutive values v[0..count) to dst (bf16 or fp32), adding to fp32 outputs when accumulate.
__device__ __forceinline__ void store_values(void* dst, const float (&v)[4], int count, bool out_fp32,
                                             bool accumulate) {
  if (out_fp32) {
    float* d = static_cast<float*>(dst);
    if (count == 4 && (reinterpret_cast<uintptr_t>(d) & 15) == 0) {
      device::store_output4(d, make_float4(v[0], v[1], v[2], v[3]), accumulate);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (e < count) device::store_output(d + e, v[e], accumulate);
    }
  } else {
    __nv_bfloat16* d = static_cast<__nv_bfloat16*>(dst);
    if (count == 4 && (reinterpret_cast<uintptr_t>(d) & 7) == 0) {
      __align__(8) __nv_bfloat162 out[2] = {__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3])};
      *reinterpret_cast<uint2*>(d) = *reinterpret_cast<const uint2*>(out);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (e < count) d[e] = __float2bfloat16(v[e]);
    }
  }
}

template <bool kAContigJ, bool kBContigJ>
__global__ void __launch_bounds__(kThreads, 1) simple_grouped_gemm_kernel(const Params p) {
  device::begin_dependent_grid();
  using namespace nvcuda;
  using ALayout = std::conditional_t<kAContigJ, wmma::row_major, wmma::col_major>;
  using BLayout = std::conditional_t<kBContigJ, wmma::row_major, wmma::col_major>;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  float* const epi_stage = reinterpret_cast<float*>(smem_raw + kPipelineBytes);
  long long* const tile_prefix = reinterpret_cast<long long*>(smem_raw + kFixedSmemBytes);  // M-grouped only
  __shared__ long long warp_sums[kWarps];

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warp_m = warp / kWarpsAlongN;
  const int warp_n = warp % kWarpsAlongN;

  // ---- work count (and, M-grouped, the per-group tile prefix) ----
  long long total_work = 0;
  if (p.k_grouped) {
    total_work = static_cast<long long>(p.num_groups) * p.m_tiles * p.n_tiles;
  } else {
    long long carry = 0;
    for (int base = 0; base < p.num_groups; base += kThreads) {
      const int g = base + tid;
      long long v = 0;
      if (g < p.num_groups) {
        const int rows = p.offsets[g + 1] - p.offsets[g];
        if (rows > 0) v = static_cast<long long>((rows + kBM - 1) / kBM) * p.n_tiles;
      }
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const long long t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
      }
      if (lane == 31) warp_sums[warp] = v;
      __syncthreads();
      long long before = 0;
      long long chunk_total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        before += w < warp ? warp_sums[w] : 0;
        chunk_total += warp_sums[w];
      }
      if (g < p.num_groups) tile_prefix[g + 1] = carry + before + v;
      carry += chunk_total;
      __syncthreads();  // warp_sums is rewritten by the next chunk
    }
    if (tid == 0) tile_prefix[0] = 0;
    __syncthreads();
    total_work = carry;
  }

  for (long long work = blockIdx.x; work < total_work; work += gridDim.x) {
    // ---- map the work index to (group, m-tile, n-tile) ----
    int g = 0;
    long long local = 0;
    if (p.k_grouped) {
      const long long per_group = static_cast<long long>(p.m_tiles) * p.n_tiles;
      g = static_cast<int>(work / per_group);
      local = work - g * per_group;
    } else {
      // The group g with tile_prefix[g] <= work < tile_prefix[g + 1] (empty groups have equal bounds).
      int lo = 0;
      int hi = p.num_groups - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (tile_prefix[mid + 1] > work) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      g = lo;
      local = work - tile_prefix[g];
    }
    const int m_tile = static_cast<int>(local / p.n_tiles);
    const int n_tile = static_cast<int>(local % p.n_tiles);
    const int n0 = n_tile * kBN;
    const int n_valid = min(kBN, p.n - n0);

    // Output rows of this tile: M-grouped, global rows [m0, m_end); K-grouped, rows [m0, m_end) of C_g.
    // Reduction range: M-grouped, k in [0, K); K-grouped, global rows [k_begin, k_end) of A and B.
    int m0 = 0;
    int m_end = 0;
    int k_begin = 0;
    int k_end = 0;
    if (p.k_grouped) {
      m0 = m_tile * kBM;
      m_end = p.m;
      k_begin = p.offsets[g];
      k_end = max(k_begin, p.offsets[g + 1]);
    } else {
      const int row_begin = p.offsets[g];
      m0 = row_begin + m_tile * kBM;
      m_end = p.offsets[g + 1];
      k_begin = 0;
      k_end = p.k;
    }
    const int m_valid = min(kBM, m_end - m0);
    const int k_tiles = (k_end - k_begin + kBK - 1) / kBK;

    const __nv_bfloat16* const a_ptr = p.a + g * p.a_group_stride;
    const __nv_bfloat16* const b_ptr = p.b + g * p.b_group_stride;
    auto stage_a = [&](int s) {
      return reinterpret_cast<__nv_bfloat16*>(smem_raw + s * kStageBytes);
    };
    auto stage_b = [&](int s) {
      return reinterpret_cast<__nv_bfloat16*>(smem_raw + s * kStageBytes + kATileElems * 2);
    };
    auto load_stage = [&](int s, int kt) {
      const int k0 = k_begin + kt * kBK;
      const int k_valid = min(kBK, k_end - k0);
      load_operand<kBM, kBK, kAContigJ>(stage_a(s), a_ptr, p.lda, m0, m_valid, k0, k_valid);
      load_operand<kBK, kBN, kBContigJ>(stage_b(s), b_ptr, p.ldb, k0, k_valid, n0, n_valid);
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragsM][kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    // ---- main loop: kStages - 1 k-tiles in flight ----
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s, s);
      cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // k-tile kt is visible to all; everyone is done with k-tile kt - 1
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next % kStages, next);
      cp_async_commit();

      const __nv_bfloat16* sa = stage_a(kt % kStages);
      const __nv_bfloat16* sb = stage_b(kt % kStages);
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, ALayout> af[kFragsM];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> bf[kFragsN];
#pragma unroll
        for (int i = 0; i < kFragsM; ++i)
          wmma::load_matrix_sync(af[i], sa + smem_offset<kBM, kBK, kAContigJ>(warp_m * kWarpM + i * 16, kk),
                                 smem_ld<kBM, kBK, kAContigJ>());
#pragma unroll
        for (int j = 0; j < kFragsN; ++j)
          wmma::load_matrix_sync(bf[j], sb + smem_offset<kBK, kBN, kBContigJ>(kk, warp_n * kWarpN + j * 16),
                                 smem_ld<kBK, kBN, kBContigJ>());
#pragma unroll
        for (int i = 0; i < kFragsM; ++i)
#pragma unroll
          for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc[i][j], af[i], bf[j], acc[i][j]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages

    // ---- epilogue: 16 rows x 32 columns per warp at a time, through shared memory ----
    float* const stage = epi_stage + warp * (kEpiBytesPerWarp / 4);
    const int sub_row = lane / 8;       // 4 rows per pass
    const int sub_col = (lane % 8) * 4;  // 4 consecutive columns per lane
    const int n = n0 + warp_n * kWarpN + sub_col;
    const int n_count = min(4, p.n - n);
    char* const c_group = static_cast<char*>(p.c) == nullptr
                              ? nullptr
                              : static_cast<char*>(p.c) + (p.k_grouped ? g * p.c_group_stride : 0) *
                                                              (p.out_fp32 ? 4 : 2);
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j)
        wmma::store_matrix_sync(stage + j * 16, acc[i][j], kEpiLd, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int rr = 0; rr < 16; rr += 4) {
        const int r_local = rr + sub_row;
        const int row_in_tile = warp_m * kWarpM + i * 16 + r_local;
        if (row_in_tile < m_valid && n_count > 0) {
          const int row = m0 + row_in_tile;
          const float4 f = *reinterpret_cast<const float4*>(stage + r_local * kEpiLd + sub_col);
          float v[4] = {f.x, f.y, f.z, f.w};
          if (p.row_scale != nullptr) {
            const float scale = p.row_scale[row];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] *= scale;
          }
          void* dst = nullptr;
          if (p.row_destinations != nullptr) {
            void* const row_dst = p.row_destinations[row];
            if (row_dst != nullptr)
              dst = static_cast<char*>(row_dst) + static_cast<int64_t>(n) * (p.out_fp32 ? 4 : 2);
          } else {
            dst = c_group + (row * p.ldc + n) * (p.out_fp32 ? 4 : 2);
          }
          if (dst != nullptr) store_values(dst, v, n_count, p.out_fp32, p.accumulate);
        }
      }
      __syncwarp();
    }
  }
}

template <bool kAContigJ, bool kBContigJ>
Status launch(const Params& params, int blocks, size_t smem_bytes, int smem_optin, cudaStream_t stream) {
  const auto kernel = simple_grouped_gemm_kernel<kAContigJ, kBContigJ>;
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernel));
  // The kernel's static shared memory (warp_sums) comes on top of the dynamic part.
  if (smem_bytes + attributes.sharedSizeBytes > static_cast<size_t>(smem_optin))
    return Status(StatusCode::kNotSupported, "simple_grouped_gemm: " + std::to_string(params.num_groups) +
                                                 " groups need " + std::to_string(smem_bytes) +
                                                 " bytes of dynamic shared memory, the device allows " +
                                                 std::to_string(smem_optin) + " in all");
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  return kernels::launch_dependent(kernel, dim3(blocks), dim3(kThreads), smem_bytes, stream,
                                   "simple_grouped_gemm_kernel", params);
}

std::string operand_error(const char* name, const char* what) {
  return std::string("simple_grouped_gemm: operand ") + name + ": " + what;
}

// ld must be positive and, where the extent along the contiguous dimension is known, at least that extent.
Status check_operand(const GemmOperand& op, const char* name, int64_t known_extent_if_contiguous) {
  if (op.ptr == nullptr) return Status::invalid(operand_error(name, "null pointer"));
  if (op.ld < 1) return Status::invalid(operand_error(name, ("ld must be >= 1, got " + std::to_string(op.ld)).c_str()));
  if (known_extent_if_contiguous >= 0 && op.ld < known_extent_if_contiguous)
    return Status::invalid(operand_error(name, ("ld " + std::to_string(op.ld) + " is below the contiguous extent " +
                                                std::to_string(known_extent_if_contiguous))
                                                   .c_str()));
  return Status::ok();
}

}  // namespace

Status simple_grouped_gemm_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, simple_grouped_gemm_kernel<false, false>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, simple_grouped_gemm_kernel<false, true>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, simple_grouped_gemm_kernel<true, false>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, simple_grouped_gemm_kernel<true, true>));
  return Status::ok();
}

Status simple_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, int max_blocks) {
  constexpr int64_t kMaxDim = INT32_MAX - kBM;
  const bool k_grouped = args.mode == GroupMode::kK;
  if (args.mode != GroupMode::kM && args.mode != GroupMode::kK)
    return Status::invalid("simple_grouped_gemm: unknown group mode");
  if (args.num_groups < 0)
    return Status::invalid("simple_grouped_gemm: num_groups must be >= 0, got " + std::to_string(args.num_groups));
  if (args.m < 0 || args.n < 0 || args.k < 0 || args.m > kMaxDim || args.n > kMaxDim || args.k > kMaxDim)
    return Status::invalid("simple_grouped_gemm: m, n, k must be in [0, 2^31 - 129], got m=" + std::to_string(args.m) +
                           " n=" + std::to_string(args.n) + " k=" + std::to_string(args.k));
  if (max_blocks < 0)
    return Status::invalid("simple_grouped_gemm: max_blocks must be >= 0, got " + std::to_string(max_blocks));
  if (args.output != OutputType::kBF16 && args.output != OutputType::kFP32)
    return Status::invalid("simple_grouped_gemm: unknown output type");
  if (args.accumulate && args.output != OutputType::kFP32)
    return Status::invalid("simple_grouped_gemm: accumulate requires fp32 output");
  if (k_grouped && (args.row_scale != nullptr || args.row_destinations != nullptr))
    return Status::invalid("simple_grouped_gemm: row_scale and row_destinations are M-grouped options only");
  if (args.num_groups == 0 || args.n == 0 || (k_grouped && args.m == 0)) return Status::ok();  // nothing to write

  if (args.group_offsets == nullptr) return Status::invalid("simple_grouped_gemm: null group_offsets");
  // Extents along each operand's contiguous dimension: A (m, k), B (k, n); the row-indexed dimension (m in
  // M-grouped mode, k in K-grouped mode) has an extent known only on the device (-1: unchecked).
  const int64_t m_extent = k_grouped ? args.m : -1;
  const int64_t k_extent = k_grouped ? -1 : args.k;
  MEGAMOE_RETURN_IF_ERROR(check_operand(args.a, "a", args.a.contiguous_in_j ? k_extent : m_extent));
  MEGAMOE_RETURN_IF_ERROR(check_operand(args.b, "b", args.b.contiguous_in_j ? args.n : k_extent));
  if (args.row_destinations == nullptr) {
    if (args.c == nullptr) return Status::invalid("simple_grouped_gemm: null c (and no row_destinations)");
    if (args.ldc < args.n)
      return Status::invalid("simple_grouped_gemm: ldc " + std::to_string(args.ldc) + " is below n " +
                             std::to_string(args.n));
  }
  if (k_grouped && args.c_group_stride < 0)
    return Status::invalid("simple_grouped_gemm: c_group_stride must be >= 0, got " +
                           std::to_string(args.c_group_stride));

  Params params{};
  params.a = args.a.ptr;
  params.lda = args.a.ld;
  params.a_group_stride = args.a.group_stride;
  params.b = args.b.ptr;
  params.ldb = args.b.ld;
  params.b_group_stride = args.b.group_stride;
  params.offsets = args.group_offsets;
  params.num_groups = args.num_groups;
  params.k_grouped = k_grouped;
  params.m = static_cast<int>(args.m);
  params.n = static_cast<int>(args.n);
  params.k = static_cast<int>(args.k);
  params.m_tiles = static_cast<int>((args.m + kBM - 1) / kBM);
  params.n_tiles = static_cast<int>((args.n + kBN - 1) / kBN);
  params.c = args.c;
  params.ldc = args.ldc;
  params.c_group_stride = args.c_group_stride;
  params.out_fp32 = args.output == OutputType::kFP32;
  params.accumulate = args.accumulate;
  params.row_scale = args.row_scale;
  params.row_destinations = args.row_destinations;

  int device = 0;
  int num_sms = 0;
  int smem_optin = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));

  const size_t smem_bytes = static_cast<size_t>(kFixedSmemBytes) +
                            (k_grouped ? 0 : static_cast<size_t>(args.num_groups + 1) * sizeof(long long));
  // The number of M-grouped tiles is known only on the device: launch the cap and let idle blocks exit.
  int64_t blocks = max_blocks > 0 ? max_blocks : num_sms;
  if (k_grouped) {
    const int64_t total = static_cast<int64_t>(args.num_groups) * params.m_tiles * params.n_tiles;
    if (total < blocks) blocks = total;
  }
  const int grid = static_cast<int>(blocks);

  if (args.a.contiguous_in_j) {
    if (args.b.contiguous_in_j) return launch<true, true>(params, grid, smem_bytes, smem_optin, stream);
    return launch<true, false>(params, grid, smem_bytes, smem_optin, stream);
  }
  if (args.b.contiguous_in_j) return launch<false, true>(params, grid, smem_bytes, smem_optin, stream);
  return launch<false, false>(params, grid, smem_bytes, smem_optin, stream);
}

}  // namespace megamoe::kernels
