// A simple, general grouped GEMM on tensor cores (WMMA, bf16 in, fp32 accumulate): the correctness twin
// and first working engine of the layer's modular path. The fast Hopper engine (grouped_gemm.hpp)
// replaces it form by form; this one stays as a check.
//
// One formula covers the three MoE forms: for every group g,
//     C_g[m, n] = sum_k A_g(m, k) * B_g(k, n)
// M-grouped (forward GEMM1/GEMM2, activation gradients): group g owns rows
//     [offsets[g], offsets[g+1]) of A and C; k in [0, K); B_g is the weight of expert g.
// K-grouped (weight gradients): group g's reduction runs over rows [offsets[g], offsets[g+1]) of A and B;
//     C_g is a separate [M, N] matrix per group.
// Group offsets live on the device (never copied to the host); a group may be empty.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/status.hpp"

namespace megamoe::kernels {

enum class GroupMode { kM, kK };
enum class OutputType { kBF16, kFP32 };

// A 2-D bf16 operand. Element (i, j) of group g sits at
//     ptr + g * group_stride + (contiguous_in_j ? i * ld + j : j * ld + i)
// For A, (i, j) = (m, k); for B, (i, j) = (k, n). In K-grouped mode the row offsets of the group are
// applied to the k index of both operands (group_stride is then 0).
struct GemmOperand {
  const __nv_bfloat16* ptr = nullptr;
  int64_t ld = 0;
  bool contiguous_in_j = true;
  int64_t group_stride = 0;
};

struct GroupedGemmArgs {
  GroupMode mode = GroupMode::kM;
  int num_groups = 0;
  const int32_t* group_offsets = nullptr;  // device, [num_groups + 1], non-decreasing, offsets[0] >= 0
  int64_t m = 0;  // K-grouped only: rows of each C_g
  int64_t n = 0;
  int64_t k = 0;  // M-grouped only: reduction length
  GemmOperand a;
  GemmOperand b;

  // Output: M-grouped: row r (global, offsets applied) at c + r * ldc; K-grouped: c + g * c_group_stride + m * ldc.
  void* c = nullptr;
  int64_t ldc = 0;
  int64_t c_group_stride = 0;
  OutputType output = OutputType::kBF16;
  bool accumulate = false;  // fp32 output only: C += result

  // M-grouped epilogue options (may be combined): value = acc * row_scale[r]; and instead of row r of C,
  // store to row_destinations[r] (a device pointer to N contiguous outputs; nullptr drops the row).
  const float* row_scale = nullptr;
  void* const* row_destinations = nullptr;
};

// Launches at most max_blocks persistent blocks (0 = one per SM), so that virtual ranks sharing a GPU
// stay co-resident. Asynchronous; no host synchronisation.
Status simple_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, int max_blocks = 0);

// Loads every instantiation of the kernel now. Under CUDA's lazy module loading the first launch loads
// the kernel, and a load waits for running kernels: with virtual ranks spinning at a barrier that is a
// deadlock, so layers load what they launch when they are created.
Status simple_grouped_gemm_preload();

}  // namespace megamoe::kernels
