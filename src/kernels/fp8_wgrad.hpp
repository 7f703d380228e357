// The FP8 weight-gradient GEMM (the FP8 backward's dW2 = dy^T a and dW13 = dh^T x, docs/FP8.md): for every
// local expert e,
//   D[e] (+)= sum over the expert's K blocks kb of (sa[kb][m] * sb[kb][n]) * sum_k qa[m][k] qb[n][k]
// with qa [M, columns] and qb [N, columns] the token-major E4M3 copies of kernels/fp8_token_major.hpp (the
// expert's routed rows from column token_major_start(offsets[e], e), 128 per K block, the last block
// zero-padded), sa [columns / 128, M] and sb [columns / 128, N] their K-block-major power-of-two scales (as
// TokenMajorScale, fp8_layout.hpp; any other bf16 value is read as that bf16, exactly), and columns =
// token_major_columns(capacity, experts). The tensor cores sum each K block (their limited-precision FP8
// accumulation inside one block), the scales are applied in fp32 registers after it (one product of the
// two scales, one fused multiply-add per element), D [experts, M, N] is fp32, stored or, with accumulate,
// added to (one fp32 rounding). An expert without rows gets zeros (or nothing added).
// Limits, checked: M and N positive multiples of 128, 1 <= experts <= 1024, capacity in [0, 2^31 - 128 experts);
// qa, qb, sa, sb and D 16-byte aligned; max_ctas >= 0 caps the persistent grid (0: every SM; virtual ranks
// sharing a GPU pass their share); overlap_promotion promotes each K block while the next one's wgmma run
// (fp8_mainloop.cuh's overlapped loop; bitwise the same D; slower, docs/PERF.md run 112). cluster: 2 runs
// pairs of vertically adjacent tiles in 2-CTA clusters that share their B panel through multicast (M a
// multiple of 256, and max_ctas 0 or at least 2, else refused; bitwise the same D; slower in runs 111-112,
// where the L2 was not the limit), 1 single CTAs. tile_columns: 128, or 192 (128 x 192 tiles, the plain loop in
// single CTAs only, else refused; bitwise the same D; 1-2.5% faster on three of the four benchmark shapes, run
// 125). transpose_d: D is [experts, N, M], each D[e] stored transposed (the same values: D^T = B^T A, so
// that the layer's dW13 = dh^T x can be formed as x^T dh, whose N = 2I 192-column tiles can cover whole; each
// value stored straight from the accumulators, a warp's store one 32-byte sector (half of one in bf16) in each
// of four rows of D[e] (device/epilogue/epilogues.cuh, epilogue_fp32_transposed_direct); single CTAs only,
// else refused).
// offsets: device int32 [experts + 1] (clamped into [0, capacity]). Sm_90 only. Asynchronous on `stream`.
// The overload with a bf16 D rounds each value once (to nearest even) where it stores it; with accumulate, the
// fp32 sum of the bf16 value D holds and the fp32 gradient, rounded once. Single CTAs only (cluster 1, else
// refused); the same values as the fp32 D rounded.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/fp8_layout.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

Status fp8_wgrad_gemm(const uint8_t* qa, const TokenMajorScale* sa, int64_t M, const uint8_t* qb,
                      const TokenMajorScale* sb, int64_t N, const int32_t* offsets, int experts, int64_t capacity,
                      float* D, bool accumulate, cudaStream_t stream, int max_ctas = 0,
                      bool overlap_promotion = false, int cluster = 1, int tile_columns = 128,
                      bool transpose_d = false);
Status fp8_wgrad_gemm(const uint8_t* qa, const TokenMajorScale* sa, int64_t M, const uint8_t* qb,
                      const TokenMajorScale* sb, int64_t N, const int32_t* offsets, int experts, int64_t capacity,
                      __nv_bfloat16* D, bool accumulate, cudaStream_t stream, int max_ctas = 0,
                      bool overlap_promotion = false, int cluster = 1, int tile_columns = 128,
                      bool transpose_d = false);

// Loads the kernel now (see fp8_quantize_preload).
Status fp8_wgrad_preload();

}  // namespace megamoe::kernels
