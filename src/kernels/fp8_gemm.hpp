// FP8 (E4M3) GEMM with DeepSeek-V3 blockwise scaling on Hopper (sm_90a), bf16 output. Internal,
// host-callable API; asynchronous on `stream`, no host synchronisation (graph-capturable).
//
//   D[m, n] = bf16( sum_kb  P_kb[m, n] * sa[m, kb] * sb[n / 128, kb] ),
//   P_kb[m, n] = sum_{k in block kb} float(qa[m, k]) * float(qb[n, k])      (kb = 128-wide K blocks)
//
// A (qa) is e4m3 [M, K] K-major with scales sa [M, K / 128] (one per 1 x 128 group of a row, as
// fp8::quantize_rows_1x128 computes them) stored K-block-major: sa[kb, m] at sa + kb * fp8_scale_pitch(M) + m
// (the transpose of quantize_rows_1x128's layout, with rows padded to a multiple of 4 floats; the kernel
// fetches one K block's scales of a tile's 128 rows as one TMA box, whose row strides must be multiples of
// 16 bytes; padding is never read). B (qb) is e4m3 [N, K] K-major with scales sb [ceil(N / 128), K / 128]
// (one per 128 x 128 block, fp8::quantize_blocks_128x128). e4m3 values are raw bytes (uint8_t), the encoding
// of include/megamoe/fp8.hpp.
//
// Arithmetic: P_kb is summed by the tensor cores (wgmma .f32 accumulators; Hopper's FP8 wgmma accumulates
// with limited precision inside one instruction group); after every K block it is promoted into an fp32
// register accumulator, acc = fma(P_kb, sa * sb, acc) (the scale product rounded once to fp32); D is acc
// rounded once to bf16 (round-to-nearest-even). Deterministic: fixed K order, no split-K, every output
// element computed by one thread.
//
// Grouped form (M grouped by expert, forward GEMM1/GEMM2 style): expert e owns rows
// [expert_offsets[e], expert_offsets[e + 1]) of A, sa (columns of its K-block-major layout) and D and multiplies them with B[e] [N, K] (scales
// sb[e] [ceil(N / 128), K / 128]). expert_offsets is a *device* int32 array of E + 1 nondecreasing entries
// with expert_offsets[E] <= max_rows, read only by the kernel (clamped into [0, max_rows]; a decreasing pair
// reads as an empty expert). Rows of D outside every expert are not written.
//
// Launch shape (Fp8GemmTuning): cluster_size 2 runs CTAs in pairs that take vertically adjacent tiles of the
// same 128 columns, each loading half of their weight panel and multicasting it to both (less L2 traffic per
// tile); the output is bitwise that of cluster_size 1 (every element is summed by one thread in the same K
// order either way). max_ctas caps the persistent grid (virtual ranks share one GPU; 0 = every SM).
//
// Requirements (checked, kInvalidArgument with a message otherwise): K a positive multiple of 128; N a
// positive multiple of 8 (a partial last 128-column tile is supported: its weight block has the scale of
// the block's existing rows); every pointer 16-byte aligned and non-null (dense: A, sa and D may be null
// when M == 0, which is a no-op); M (dense) / max_rows (grouped) in [0, 2^31 - 128); num_experts in
// [1, 1024]; cluster_size 1 or 2, max_ctas >= 0. Device: sm_90 (kNotSupported otherwise, and when no 2-CTA cluster fits).
// Tensor-map encoding failures are returned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/fp8_layout.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

inline constexpr int kFp8GemmMaxExperts = 1024;

struct Fp8GemmTuning {
  int cluster_size = 1;
  int max_ctas = 0;
  // Each consumer warpgroup promotes a K block while its next block's wgmma run (two partial accumulators,
  // mma_tile_fp8_blockwise_overlapped); bitwise the same output. Off by default until measured.
  bool overlap_promotion = false;
};

// Dense: A [M, K], sa [K / 128, fp8_scale_pitch(M)], B [N, K], sb [ceil(N / 128), K / 128], D [M, N] bf16
// row-major.
Status fp8_gemm_nt(const uint8_t* A, const float* sa, const uint8_t* B, const float* sb, __nv_bfloat16* D, int64_t M,
                   int N, int K, cudaStream_t stream, const Fp8GemmTuning& tuning = {});

// Rows addressed by index (the layer's expert GEMMs, with no copy in expert order).
//   a_rows: operand row r (r < max_rows) is row a_rows[r] of A, then the source [a_source_rows, K] (values
//     clamped into range), and its scales are that source row's: sa is then [a_source_rows, K / 128]
//     row-major (the layout a row's scales travel in with it), 4-byte aligned. Needs cluster_size 1.
//   d_rows: D row r is stored at d_rows[r] (N bf16, 16-byte aligned; nullptr drops the row); D may be null.
//   d_fp32: D stored unrounded instead, fp32 [max_rows, N] contiguous (16-byte aligned; D may be null): the
//     accumulator the bf16 D rounds, for a consumer that quantizes it again (the FP8 layer's h and g).
//   swiglu_a_q (with d_fp32; GEMM1 of the FP8 layer): B is W13 [E, 2I, K], gate rows then up rows (N = 2I, I a
//     multiple of 128); besides h (d_fp32, the same bits) the epilogue writes a = silu(gate) * up of every
//     expert row, quantized in 1 x 128 groups along I: swiglu_a_q [max_rows, I] e4m3 (16-byte aligned) and
//     the scales K-block-major (4-byte aligned), group (row, kb) at swiglu_a_s[kb * swiglu_a_s_pitch + row]
//     (pitch >= max_rows), bit for bit swiglu_quantize_rows_1x128 of h (fp8_quantize.hpp). Rows outside every
//     expert are not written. TMA A (no a_rows); cluster_size 1 or 2.
// Either way the output bits are those of the contiguous call on the same rows (d_fp32: before rounding).
struct Fp8GemmRows {
  const int32_t* a_rows = nullptr;
  int64_t a_source_rows = 0;
  void* const* d_rows = nullptr;
  float* d_fp32 = nullptr;
  uint8_t* swiglu_a_q = nullptr;
  float* swiglu_a_s = nullptr;
  int64_t swiglu_a_s_pitch = 0;
};

// Grouped: A [max_rows, K], sa [K / 128, fp8_scale_pitch(max_rows)], B [num_experts, N, K],
// sb [num_experts, ceil(N / 128), K / 128], D [max_rows, N] (see Fp8GemmRows for rows by index).
Status fp8_grouped_gemm_nt(const uint8_t* A, const float* sa, const uint8_t* B, const float* sb, __nv_bfloat16* D,
                           const int32_t* expert_offsets, int num_experts, int64_t max_rows, int N, int K,
                           cudaStream_t stream, const Fp8GemmTuning& tuning = {}, const Fp8GemmRows& by_index = {});

// Loads the kernel now (under lazy module loading a first launch waits for running kernels).
Status fp8_gemm_preload();

}  // namespace megamoe::kernels
