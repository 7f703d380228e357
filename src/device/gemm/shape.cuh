// Compile-time shape of a grouped-GEMM main loop: the form (which operands are K-major), the CTA tile
// (128 x BN, two consumer warpgroups of 64 x BN each), the K depth of a stage (64: one 128-byte swizzle
// span of bf16), the ring depth and the cluster size.
#pragma once

#include <cstdint>

#include "device/epilogue/box_store.cuh"

namespace megamoe::device {

// Row-major everywhere; "rows" = the rows of all experts, contiguous.
//   kNT: C[rows_e, N] = A[rows_e, K] . B[e][N, K]^T   (both K-major)
//   kNN: C[rows_e, N] = A[rows_e, K] . B[e][K, N]     (B N-major)
//   kTN: C[e][M, N]   = A[rows_e, M]^T . B[rows_e, N]  (both MN-major; the expert's rows are the reduction)
enum class GemmForm : int { kNT = 0, kNN = 1, kTN = 2 };

template <GemmForm kForm_, int kBN_, int kStages_, int kCluster_>
struct MainloopShape {
  static constexpr GemmForm kForm = kForm_;
  static constexpr int kBM = 128;
  static constexpr int kBN = kBN_;
  static constexpr int kBK = 64;
  static constexpr int kStages = kStages_;
  static constexpr int kCluster = kCluster_;
  static constexpr int kConsumerGroups = 2;
  static constexpr bool kKGrouped = kForm == GemmForm::kTN;
  static_assert(kBN == 128 || kBN == 192 || kBN == 256, "tiles are 128 x 128, 128 x 192 or 128 x 256");
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");

  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  // wgmma operand majorness and descriptor geometry (device/ptx/wgmma.cuh).
  static constexpr int kTransA = kForm == GemmForm::kTN ? 1 : 0;
  static constexpr int kTransB = kForm == GemmForm::kNT ? 0 : 1;
  static constexpr uint32_t kAStep = kTransA ? 2048u : 32u;  // bytes to the next k16 slice
  static constexpr uint32_t kBStep = kTransB ? 2048u : 32u;
  static constexpr uint32_t kALbo = kTransA ? kBoxBytes : 16u;
  static constexpr uint32_t kBLbo = kTransB ? kBoxBytes : 16u;
};

}  // namespace megamoe::device
