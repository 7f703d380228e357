// Host side of the FP8 weight-gradient GEMM (fp8_wgrad.hpp): argument checks, tensor maps (the e4m3 operands
// as bf16 pairs, as in fp8_gemm.cu; the scales as 16-bit tensors [K blocks, rows]), the persistent launch.
#include <cstdint>
#include <string>
#include <type_traits>

#include "host/tensor_map.hpp"
#include "kernels/cluster_launch.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/fp8_token_major.hpp"
#include "kernels/fp8_wgrad.hpp"
#include "kernels/fp8_wgrad_kernel.cuh"

namespace megamoe::kernels {
namespace {

Status check(const uint8_t* qa, const TokenMajorScale* sa, int64_t M, const uint8_t* qb, const TokenMajorScale* sb,
             int64_t N, const int32_t* offsets, int experts, int64_t capacity, const void* D) {
  if (M <= 0 || N <= 0 || M % 128 != 0 || N % 128 != 0 || M >= (int64_t{1} << 31) || N >= (int64_t{1} << 31))
    return Status::invalid("fp8 wgrad GEMM: M and N must be positive multiples of 128, got M=" + std::to_string(M) +
                           " N=" + std::to_string(N));
  if (experts < 1 || experts > device::kMaxGroups)
    return Status::invalid("fp8 wgrad GEMM: experts must be in [1, " + std::to_string(device::kMaxGroups) + "], got " +
                           std::to_string(experts));
  if (capacity < 0 || token_major_columns(capacity, experts) >= (int64_t{1} << 31))
    return Status::invalid("fp8 wgrad GEMM: capacity out of range: " + std::to_string(capacity));
  if (qa == nullptr || qb == nullptr || sa == nullptr || sb == nullptr || offsets == nullptr || D == nullptr)
    return Status::invalid("fp8 wgrad GEMM: null pointer");
  if ((reinterpret_cast<uintptr_t>(qa) & 15u) != 0 || (reinterpret_cast<uintptr_t>(qb) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(sa) & 15u) != 0 || (reinterpret_cast<uintptr_t>(sb) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(D) & 15u) != 0)
    return Status::invalid("fp8 wgrad GEMM: qa, qb, sa, sb and D must be 16-byte aligned");
  return Status::ok();
}

// An e4m3 matrix [rows, columns] as bf16 pairs, boxes of 128 e4m3 (64 pairs) x box_rows rows.
Status operand_map(CUtensorMap* map, const uint8_t* q, int64_t rows, int64_t columns, uint32_t box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(columns / 2), static_cast<uint64_t>(rows)};
  const uint32_t box[2] = {64, box_rows};
  return make_bf16_tensor_map(map, q, 2, dims, box);
}

// Scales [columns / 128, rows] of 16 bits, boxes of one K block's box_rows rows.
Status scale_map(CUtensorMap* map, const TokenMajorScale* s, int64_t rows, int64_t columns, uint32_t box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(rows), static_cast<uint64_t>(columns / 128)};
  const uint32_t box[2] = {box_rows, 1};
  return make_u16_tensor_map_2d(map, s, dims, box);
}

template <class Cfg>
Status launch(const CUtensorMap& tm_a, const CUtensorMap& tm_b, const CUtensorMap& tm_sa, const CUtensorMap& tm_sb,
              const Fp8WgradParams& p, int64_t tiles, int num_sms, int max_ctas, cudaStream_t stream) {
  ClusterLaunch launch;
  MEGAMOE_RETURN_IF_ERROR(prepare_cluster_launch<Cfg::kCluster>(fp8_wgrad_kernel<Cfg>, kFp8WgradThreads,
                                                                Cfg::kSmemBytes, stream, num_sms, max_ctas,
                                                                "fp8 wgrad GEMM", &launch));
  // No more clusters than work items (a cluster's item is kCluster tiles).
  const int64_t items = tiles / Cfg::kCluster;
  launch.set_grid(static_cast<int>(items < launch.clusters ? items : launch.clusters), Cfg::kCluster);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&launch.config, fp8_wgrad_kernel<Cfg>, tm_a, tm_b, tm_sa, tm_sb, p));
  MEGAMOE_CHECK_LAUNCH(stream, "fp8_wgrad_kernel");
  return Status::ok();
}

// Both outputs: Out is float or __nv_bfloat16 (configurations with kBf16D, single CTAs).
template <class Out>
Status wgrad_gemm(const uint8_t* qa, const TokenMajorScale* sa, int64_t M, const uint8_t* qb, const TokenMajorScale* sb,
                  int64_t N, const int32_t* offsets, int experts, int64_t capacity, Out* D, bool accumulate,
                  cudaStream_t stream, int max_ctas, bool overlap_promotion, int cluster, int tile_columns,
                  bool transpose_d) {
  constexpr bool kBf16 = std::is_same_v<Out, __nv_bfloat16>;
  MEGAMOE_RETURN_IF_ERROR(check(qa, sa, M, qb, sb, N, offsets, experts, capacity, D));
  if (max_ctas < 0) return Status::invalid("fp8 wgrad GEMM: max_ctas must be >= 0, got " + std::to_string(max_ctas));
  if (cluster != 1 && cluster != 2)
    return Status::invalid("fp8 wgrad GEMM: cluster must be 1 or 2, got " + std::to_string(cluster));
  if (kBf16 && cluster != 1)
    return Status::invalid("fp8 wgrad GEMM: a bf16 D runs in single CTAs (cluster 1), got cluster " +
                           std::to_string(cluster));
  if (max_ctas > 0 && max_ctas < cluster)
    return Status::invalid("fp8 wgrad GEMM: max_ctas (" + std::to_string(max_ctas) + ") is below one cluster of " +
                           std::to_string(cluster) + " CTAs");
  if (tile_columns != 128 && tile_columns != 192)
    return Status::invalid("fp8 wgrad GEMM: tile_columns must be 128 or 192, got " + std::to_string(tile_columns));
  if (tile_columns == 192 && (overlap_promotion || cluster != 1))
    return Status::invalid("fp8 wgrad GEMM: 192-column tiles run the plain loop in single CTAs");
  if (transpose_d && cluster != 1)
    return Status::invalid("fp8 wgrad GEMM: a transposed D runs in single CTAs (cluster 1), got cluster " +
                           std::to_string(cluster));
  if (cluster == 2 && M % 256 != 0)
    return Status::invalid("fp8 wgrad GEMM: 2-CTA clusters pair m-tiles, so M must be a multiple of 256, got M=" +
                           std::to_string(M));
  int num_sms = 0;
  MEGAMOE_RETURN_IF_ERROR(hopper_device_sms("fp8 wgrad GEMM", &num_sms));
  const int64_t columns = token_major_columns(capacity, experts);
  CUtensorMap tm_a{}, tm_sa{};
  MEGAMOE_RETURN_IF_ERROR(operand_map(&tm_a, qa, M, columns, 128));
  MEGAMOE_RETURN_IF_ERROR(scale_map(&tm_sa, sa, M, columns, 128));
  Fp8WgradParams p{};
  p.offsets = offsets;
  p.experts = experts;
  p.capacity = static_cast<int>(capacity);
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  if constexpr (kBf16) {
    p.D16 = D;
  } else {
    p.D = D;
  }
  p.accumulate = accumulate ? 1 : 0;
  // B's box is the rows one CTA of the configuration loads (half the panel in a cluster pair), its scales' box
  // the tile's columns.
  const auto run = [&](auto config) -> Status {
    using Cfg = decltype(config);
    CUtensorMap tm_b{}, tm_sb{};
    MEGAMOE_RETURN_IF_ERROR(operand_map(&tm_b, qb, N, columns, Cfg::kBRowsLoaded));
    MEGAMOE_RETURN_IF_ERROR(scale_map(&tm_sb, sb, N, columns, Cfg::kBN));
    const int64_t tiles = static_cast<int64_t>(experts) * (M / 128) * ((N + Cfg::kBN - 1) / Cfg::kBN);
    return launch<Cfg>(tm_a, tm_b, tm_sa, tm_sb, p, tiles, num_sms, max_ctas, stream);
  };
  if (transpose_d) {
    if (tile_columns == 192) return run(Fp8WgradConfig<false, 1, 192, true, kBf16>{});
    return overlap_promotion ? run(Fp8WgradConfig<true, 1, 128, true, kBf16>{})
                             : run(Fp8WgradConfig<false, 1, 128, true, kBf16>{});
  }
  if (tile_columns == 192) return run(Fp8WgradConfig<false, 1, 192, false, kBf16>{});
  if constexpr (!kBf16) {
    if (cluster == 2) return overlap_promotion ? run(Fp8WgradConfig<true, 2>{}) : run(Fp8WgradConfig<false, 2>{});
  }
  return overlap_promotion ? run(Fp8WgradConfig<true, 1, 128, false, kBf16>{})
                           : run(Fp8WgradConfig<false, 1, 128, false, kBf16>{});
}

}  // namespace

Status fp8_wgrad_gemm(const uint8_t* qa, const TokenMajorScale* sa, int64_t M, const uint8_t* qb,
                      const TokenMajorScale* sb, int64_t N, const int32_t* offsets, int experts, int64_t capacity,
                      float* D, bool accumulate, cudaStream_t stream, int max_ctas, bool overlap_promotion,
                      int cluster, int tile_columns, bool transpose_d) {
  return wgrad_gemm(qa, sa, M, qb, sb, N, offsets, experts, capacity, D, accumulate, stream, max_ctas,
                    overlap_promotion, cluster, tile_columns, transpose_d);
}

Status fp8_wgrad_gemm(const uint8_t* qa, const TokenMajorScale* sa, int64_t M, const uint8_t* qb,
                      const TokenMajorScale* sb, int64_t N, const int32_t* offsets, int experts, int64_t capacity,
                      __nv_bfloat16* D, bool accumulate, cudaStream_t stream, int max_ctas, bool overlap_promotion,
                      int cluster, int tile_columns, bool transpose_d) {
  return wgrad_gemm(qa, sa, M, qb, sb, N, offsets, experts, capacity, D, accumulate, stream, max_ctas,
                    overlap_promotion, cluster, tile_columns, transpose_d);
}

Status fp8_wgrad_preload() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 2>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<true, 2>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 192>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 128, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<true, 1, 128, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 192, true>>));
  // The bf16-D configurations.
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 128, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<true, 1, 128, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 192, false, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 128, true, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<true, 1, 128, true, true>>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, fp8_wgrad_kernel<Fp8WgradConfig<false, 1, 192, true, true>>));
  return Status::ok();
}

}  // namespace megamoe::kernels
