// Host side of the blockwise-scaled FP8 GEMM (fp8_gemm.hpp): argument checks, tensor maps, kernel parameters
// and the launch of its configuration for the cluster size asked for (fp8_gemm_kernel.cuh).
//
// Tensor maps: TMA copies bytes, so the e4m3 operands are described as bf16 tensors of half the width (a pair
// of e4m3 per "bf16"): a 128-byte box row is 128 e4m3 = one K block, the swizzle (on bytes) is the same, and
// out-of-range elements load as zero bytes, which are +0 in e4m3 too. The A scales are an fp32 tensor
// [K / 128, fp8_scale_pitch(rows)] whose boxes are one K block's scales of a tile's rows (block_scales.cuh).
#include <algorithm>
#include <cstdint>
#include <string>

#include "host/tensor_map.hpp"
#include "kernels/cluster_launch.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/fp8_gemm.hpp"
#include "kernels/fp8_gemm_kernel.cuh"

namespace megamoe::kernels {
namespace {

using Cfg1 = Fp8GemmConfig<1, false>;
constexpr int kBM = Cfg1::Shape::kBM;
constexpr int kBN = Cfg1::Shape::kBN;
constexpr int kKBlock = 128;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

Status check_shape(int64_t rows, const char* rows_name, int N, int K) {
  if (rows < 0 || rows >= (int64_t{1} << 31) - kBM) {
    return Status::invalid(std::string("fp8 GEMM: ") + rows_name + " must be in [0, 2^31 - 128), got " +
                           std::to_string(rows));
  }
  if (K <= 0 || K % kKBlock != 0) {
    return Status::invalid("fp8 GEMM: K must be a positive multiple of 128 (the scale block), got K=" +
                           std::to_string(K));
  }
  if (N <= 0 || N % 8 != 0) {
    return Status::invalid("fp8 GEMM: N must be a positive multiple of 8, got N=" + std::to_string(N));
  }
  return Status::ok();
}

Status check_pointer(const void* p, const char* name) {
  if (p == nullptr) return Status::invalid(std::string("fp8 GEMM: ") + name + " is null");
  if (!aligned16(p)) return Status::invalid(std::string("fp8 GEMM: ") + name + " must be 16-byte aligned");
  return Status::ok();
}

// An e4m3 tensor [outer..., cols] as bf16 pairs, boxes of 128 e4m3 (64 pairs) x box_rows.
Status map_e4m3(CUtensorMap* map, const void* base, int rank, const uint64_t* dims_e4m3, const uint32_t* box) {
  uint64_t dims[3] = {dims_e4m3[0] / 2, rank > 1 ? dims_e4m3[1] : 1, rank > 2 ? dims_e4m3[2] : 1};
  return make_bf16_tensor_map(map, base, rank, dims, box);
}

Status check_tuning(const Fp8GemmTuning& tuning) {
  if (tuning.cluster_size != 1 && tuning.cluster_size != 2) {
    return Status::invalid("fp8 GEMM: cluster_size must be 1 or 2, got " + std::to_string(tuning.cluster_size));
  }
  if (tuning.max_ctas < 0) {
    return Status::invalid("fp8 GEMM: max_ctas must be >= 0 (0 = every SM), got " + std::to_string(tuning.max_ctas));
  }
  if (tuning.max_ctas > 0 && tuning.max_ctas < tuning.cluster_size) {
    return Status::invalid("fp8 GEMM: max_ctas (" + std::to_string(tuning.max_ctas) +
                           ") is below one cluster of cluster_size CTAs");
  }
  return Status::ok();
}

// The SwiGLU epilogue's outputs and the shape it needs (Fp8GemmRows::swiglu_a_q).
Status check_swiglu(const Fp8GemmRows& by_index, int64_t max_rows, int N) {
  const bool any = by_index.swiglu_a_q != nullptr || by_index.swiglu_a_s != nullptr;
  if (!any) return Status::ok();
  if (by_index.swiglu_a_q == nullptr || by_index.swiglu_a_s == nullptr)
    return Status::invalid("fp8 GEMM: swiglu_a_q and swiglu_a_s go together");
  // a's codes leave as 16-byte pieces of rows (store_gate_up_codes), the scales one float at a time.
  if ((reinterpret_cast<uintptr_t>(by_index.swiglu_a_q) & 15u) != 0)
    return Status::invalid("fp8 GEMM: swiglu_a_q must be 16-byte aligned");
  if ((reinterpret_cast<uintptr_t>(by_index.swiglu_a_s) & 3u) != 0)
    return Status::invalid("fp8 GEMM: swiglu_a_s must be 4-byte aligned");
  if (by_index.d_fp32 == nullptr) return Status::invalid("fp8 GEMM: the SwiGLU epilogue needs d_fp32 (h)");
  if (by_index.a_rows != nullptr) return Status::invalid("fp8 GEMM: the SwiGLU epilogue reads A through TMA (no a_rows)");
  if (N % (2 * kKBlock) != 0)
    return Status::invalid("fp8 GEMM: the SwiGLU epilogue needs N = 2I with I a multiple of 128, got N=" +
                           std::to_string(N));
  if (by_index.swiglu_a_s_pitch < max_rows)
    return Status::invalid("fp8 GEMM: swiglu_a_s_pitch must be at least max_rows=" + std::to_string(max_rows) +
                           ", got " + std::to_string(by_index.swiglu_a_s_pitch));
  return Status::ok();
}

template <class Cfg>
Status launch(const uint8_t* A, const float* sa, const uint8_t* B, const float* sb, __nv_bfloat16* D,
              const int32_t* offsets, int num_groups, int64_t max_rows, int N, int K, const Fp8GemmRows& by_index,
              int max_ctas, cudaStream_t stream) {
  constexpr int kCluster = Cfg::Shape::kCluster;
  int num_sms = 0;
  MEGAMOE_RETURN_IF_ERROR(hopper_device_sms("fp8 GEMM", &num_sms));
  CUtensorMap tm_a{}, tm_b{}, tm_sa{}, tm_d{};
  const uint64_t rows = static_cast<uint64_t>(std::max<int64_t>(max_rows, 1));
  if constexpr (!Cfg::kGatherA) {
    {
      const uint64_t dims[2] = {rows, static_cast<uint64_t>(K / kKBlock)};
      const uint32_t box[2] = {static_cast<uint32_t>(device::kScaleBoxRows), 1};
      MEGAMOE_RETURN_IF_ERROR(
          make_fp32_tensor_map_2d(&tm_sa, sa, dims, fp8_scale_pitch(static_cast<int64_t>(rows)), box));
    }
    const uint64_t dims[2] = {static_cast<uint64_t>(K), rows};
    const uint32_t box[2] = {64, static_cast<uint32_t>(kBM)};
    MEGAMOE_RETURN_IF_ERROR(map_e4m3(&tm_a, A, 2, dims, box));
  }
  {
    // The B panel of an n-tile comes as two boxes of BN / 2 rows (TileLoader; in a 2-CTA cluster each CTA
    // loads one and multicasts it).
    const uint64_t dims[3] = {static_cast<uint64_t>(K), static_cast<uint64_t>(N), static_cast<uint64_t>(num_groups)};
    const uint32_t box[3] = {64, static_cast<uint32_t>(kBN / 2), 1};
    MEGAMOE_RETURN_IF_ERROR(map_e4m3(&tm_b, B, 3, dims, box));
  }
  const bool d_by_row = by_index.d_rows != nullptr;
  const bool d_fp32 = by_index.d_fp32 != nullptr;
  if (d_fp32) {
    const uint64_t dims[2] = {static_cast<uint64_t>(N), rows};
    const uint32_t box[2] = {32, 64};
    MEGAMOE_RETURN_IF_ERROR(make_fp32_tensor_map_2d(&tm_d, by_index.d_fp32, dims, static_cast<uint64_t>(N), box,
                                                    /*swizzle_128b=*/true));
  } else if (!d_by_row) {
    const uint64_t dims[2] = {static_cast<uint64_t>(N), rows};
    const uint32_t box[2] = {64, 64};
    MEGAMOE_RETURN_IF_ERROR(make_bf16_tensor_map(&tm_d, D, 2, dims, box));
  }
  Fp8GemmParams p{};
  p.group_offsets = offsets;
  p.num_groups = num_groups;
  p.max_rows = static_cast<int>(max_rows);
  p.N = N;
  p.K = K;
  if constexpr (Cfg::kGateUp) {
    // A tile's weight panel: 64 gate rows and the same channels' 64 up rows (I = N / 2 further).
    p.src.b_row_step = kBN / 2;
    p.src.b_half_offset = N / 2;
    p.swiglu = device::SwigluFp8Out{by_index.swiglu_a_q, by_index.swiglu_a_s, by_index.swiglu_a_s_pitch, N / 2};
  } else {
    p.src.b_row_step = kBN;
    p.src.b_half_offset = kBN / 2;
  }
  p.b_scales = device::WeightScales{sb, K / kKBlock, (N + kKBlock - 1) / kKBlock};
  if constexpr (Cfg::kGatherA) {
    // The bf16-pair view of the e4m3 rows (K / 2 pairs a row), as the TMA path sees them.
    p.src.a = device::gathered_rows(reinterpret_cast<const __nv_bfloat16*>(A), K / 2, by_index.a_rows,
                                    by_index.a_source_rows);
    p.sa_rows = sa;
  }
  p.epi.c = device::OutputRows{D, N, nullptr, by_index.d_rows};
  p.epi.aux = device::OutputRows{nullptr, N, nullptr, nullptr};
  p.epi.c_cols = N;
  p.epi.aux_cols = N;
  p.tma_store = d_by_row ? 0 : 1;  // rows stored through their pointers take the thread path
  p.d32 = by_index.d_fp32;

  ClusterLaunch launch;
  MEGAMOE_RETURN_IF_ERROR(prepare_cluster_launch<kCluster>(fp8_gemm_kernel<Cfg>, kFp8GemmThreads, Cfg::kSmemBytes,
                                                           stream, num_sms, max_ctas, "fp8 GEMM", &launch));
  int clusters = launch.clusters;
  if (offsets == nullptr) {  // dense: the work items (pairs of m-tiles in a cluster) are known here
    const int64_t m_units = ((max_rows + kBM - 1) / kBM + kCluster - 1) / kCluster;
    const int64_t n_items = Cfg::kGateUp ? N / (2 * kBN) : (N + kBN - 1) / kBN;  // gate-up: pairs of tiles
    const int64_t items = m_units * n_items;
    clusters = static_cast<int>(std::min<int64_t>(clusters, std::max<int64_t>(items, 1)));
  }
  launch.set_grid(clusters, kCluster);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&launch.config, fp8_gemm_kernel<Cfg>, tm_a, tm_b, tm_sa, tm_d, p));
  MEGAMOE_CHECK_LAUNCH(stream, "fp8_gemm_kernel");
  return Status::ok();
}

template <bool kOverlap>
Status launch_overlap(const Fp8GemmTuning& tuning, const uint8_t* A, const float* sa, const uint8_t* B,
                      const float* sb, __nv_bfloat16* D, const int32_t* offsets, int num_groups, int64_t max_rows,
                      int N, int K, const Fp8GemmRows& by_index, cudaStream_t stream) {
  const int cap = tuning.max_ctas;
  if (by_index.swiglu_a_q != nullptr) {
    if (tuning.cluster_size == 2) {
      return launch<Fp8GemmConfig<2, false, kOverlap, true>>(A, sa, B, sb, D, offsets, num_groups, max_rows, N, K,
                                                             by_index, cap, stream);
    }
    return launch<Fp8GemmConfig<1, false, kOverlap, true>>(A, sa, B, sb, D, offsets, num_groups, max_rows, N, K,
                                                           by_index, cap, stream);
  }
  if (by_index.a_rows != nullptr) {
    return launch<Fp8GemmConfig<1, true, kOverlap>>(A, sa, B, sb, D, offsets, num_groups, max_rows, N, K, by_index,
                                                    cap, stream);
  }
  if (tuning.cluster_size == 2) {
    return launch<Fp8GemmConfig<2, false, kOverlap>>(A, sa, B, sb, D, offsets, num_groups, max_rows, N, K,
                                                     by_index, cap, stream);
  }
  return launch<Fp8GemmConfig<1, false, kOverlap>>(A, sa, B, sb, D, offsets, num_groups, max_rows, N, K, by_index,
                                                   cap, stream);
}

Status launch_for(const Fp8GemmTuning& tuning, const uint8_t* A, const float* sa, const uint8_t* B, const float* sb,
                  __nv_bfloat16* D, const int32_t* offsets, int num_groups, int64_t max_rows, int N, int K,
                  const Fp8GemmRows& by_index, cudaStream_t stream) {
  if (tuning.overlap_promotion) {
    return launch_overlap<true>(tuning, A, sa, B, sb, D, offsets, num_groups, max_rows, N, K, by_index, stream);
  }
  return launch_overlap<false>(tuning, A, sa, B, sb, D, offsets, num_groups, max_rows, N, K, by_index, stream);
}

}  // namespace

Status fp8_gemm_nt(const uint8_t* A, const float* sa, const uint8_t* B, const float* sb, __nv_bfloat16* D, int64_t M,
                   int N, int K, cudaStream_t stream, const Fp8GemmTuning& tuning) {
  MEGAMOE_RETURN_IF_ERROR(check_tuning(tuning));
  MEGAMOE_RETURN_IF_ERROR(check_shape(M, "M", N, K));
  MEGAMOE_RETURN_IF_ERROR(check_pointer(B, "B"));
  MEGAMOE_RETURN_IF_ERROR(check_pointer(sb, "sb"));
  if (M == 0) return Status::ok();
  MEGAMOE_RETURN_IF_ERROR(check_pointer(A, "A"));
  MEGAMOE_RETURN_IF_ERROR(check_pointer(sa, "sa"));
  MEGAMOE_RETURN_IF_ERROR(check_pointer(D, "D"));
  return launch_for(tuning, A, sa, B, sb, D, nullptr, 1, M, N, K, Fp8GemmRows{}, stream);
}

Status fp8_grouped_gemm_nt(const uint8_t* A, const float* sa, const uint8_t* B, const float* sb, __nv_bfloat16* D,
                           const int32_t* expert_offsets, int num_experts, int64_t max_rows, int N, int K,
                           cudaStream_t stream, const Fp8GemmTuning& tuning, const Fp8GemmRows& by_index) {
  MEGAMOE_RETURN_IF_ERROR(check_tuning(tuning));
  MEGAMOE_RETURN_IF_ERROR(check_shape(max_rows, "max_rows", N, K));
  if (num_experts < 1 || num_experts > kFp8GemmMaxExperts) {
    return Status::invalid("fp8 GEMM: num_experts must be in [1, " + std::to_string(kFp8GemmMaxExperts) +
                           "], got " + std::to_string(num_experts));
  }
  MEGAMOE_RETURN_IF_ERROR(check_pointer(A, "A"));
  MEGAMOE_RETURN_IF_ERROR(check_pointer(B, "B"));
  MEGAMOE_RETURN_IF_ERROR(check_pointer(sb, "sb"));
  if (by_index.a_rows != nullptr) {
    // Gathered scales are read 4 bytes at a time: fp32 alignment is enough.
    if (sa == nullptr) return Status::invalid("fp8 GEMM: sa is null");
    if ((reinterpret_cast<uintptr_t>(sa) & 3u) != 0) return Status::invalid("fp8 GEMM: sa must be 4-byte aligned");
    if (by_index.a_source_rows < 1 || by_index.a_source_rows >= (int64_t{1} << 31)) {
      return Status::invalid("fp8 GEMM: a_source_rows must be in [1, 2^31), got " +
                             std::to_string(by_index.a_source_rows));
    }
    if (tuning.cluster_size != 1) return Status::invalid("fp8 GEMM: gathered A rows need cluster_size 1");
  } else {
    MEGAMOE_RETURN_IF_ERROR(check_pointer(sa, "sa"));
  }
  if (by_index.d_rows != nullptr && by_index.d_fp32 != nullptr)
    return Status::invalid("fp8 GEMM: d_rows and d_fp32 exclude each other");
  if (by_index.d_fp32 != nullptr) MEGAMOE_RETURN_IF_ERROR(check_pointer(by_index.d_fp32, "d_fp32"));
  MEGAMOE_RETURN_IF_ERROR(check_swiglu(by_index, max_rows, N));
  if (by_index.d_rows == nullptr && by_index.d_fp32 == nullptr) MEGAMOE_RETURN_IF_ERROR(check_pointer(D, "D"));
  if (expert_offsets == nullptr) return Status::invalid("fp8 GEMM: expert_offsets is null");
  if (max_rows == 0) return Status::ok();  // every expert is empty (offsets are clamped into [0, max_rows])
  return launch_for(tuning, A, sa, B, sb, D, expert_offsets, num_experts, max_rows, N, K, by_index, stream);
}

Status fp8_gemm_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Cfg1>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<2, false>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<1, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<1, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<2, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<1, true, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<1, false, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<1, false, true, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<2, false, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_gemm_kernel<Fp8GemmConfig<2, false, true, true>>));
  return Status::ok();
}

}  // namespace megamoe::kernels
