// Hopper (sm_90a) grouped-GEMM engine, BF16 inputs, fp32 accumulation. Internal, host-callable API.
//
// Every entry point is asynchronous on `stream` (no host synchronisation): it builds TMA tensor maps on the
// host from the pointers and the *maximum* sizes, and the kernel reads the per-expert row counts on the
// device from `group_offsets` (int32, E+1 entries, exclusive prefix sums of the rows of each expert:
// expert e owns rows [group_offsets[e], group_offsets[e+1]); nondecreasing; group_offsets[E] <= max_rows).
// An expert may have 0 rows. Nothing is read back to the host, so the calls can be captured in a graph.
//
// Three forms (row-major everywhere; "rows" = the rows of all experts, contiguous):
//   1. M-grouped, B K-major:  C[rows_e, N] = A[rows_e, K] . B[e][N, K]^T            (forward GEMM1/GEMM2)
//   2. M-grouped, B N-major:  C[rows_e, N] = A[rows_e, K] . B[e][K, N]              (activation gradients)
//   3. K-grouped:             C[e][M, N] (+)= A[rows_e, M]^T . B[rows_e, N]          (weight gradients, fp32)
//
// Epilogues (forms 1 and 2), composable, see GemmEpilogue. Accumulation is fp32 in the tensor cores
// (wgmma .f32 accumulators, the sum over K in the hardware's order, not bitwise equal to a CPU sum); the
// epilogue works in fp32 and rounds to bf16 once, round-to-nearest-even, at the store. Form 3 stores
// fp32; with accumulate=true it adds the tile to the existing fp32 value (C = C + acc, one fp32 rounding,
// no atomics: every output element is owned by exactly one thread).
//
// Requirements (checked, kInvalidArgument otherwise): sm_90 device; K % 8 == 0, N % 8 == 0 (form 3:
// M % 8 == 0 and N % 8 == 0), 16-byte aligned base pointers; num_groups in [1, kMaxGroups];
// SwiGLU forward: N (= 2I, the interleaved gate/up width) % 128 == 0; SwiGLU backward: N (= I) % 64 == 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/status.hpp"

namespace megamoe::kernels {

inline constexpr int kGemmMaxGroups = 1024;

// ---- SwiGLU internal layout of W13 ----
// The public W13 is [E, 2I, H] with gate rows 0..I-1 and up rows I..2I-1. The engine uses an interleaved
// row order so that one 256-wide output tile holds matching gate and up columns: internal row q lies in
// block b = q / 128; the first 64 rows of the block are gate rows 64b..64b+63, the next 64 the matching up
// rows I+64b..I+64b+63. Requires I % 64 == 0. h (the pre-activation, [rows, 2I]) and dh use the same
// internal column order; dW13 computed from the interleaved dh comes out in internal row order too.
inline constexpr int kSwiGLUInterleave = 64;

// Public row (0..2I-1) of internal row q, and the inverse. Exact permutations.
constexpr int64_t swiglu_public_row(int64_t q, int64_t I) {
  const int64_t b = q / (2 * kSwiGLUInterleave), w = q % (2 * kSwiGLUInterleave);
  return w < kSwiGLUInterleave ? b * kSwiGLUInterleave + w : I + b * kSwiGLUInterleave + (w - kSwiGLUInterleave);
}
constexpr int64_t swiglu_internal_row(int64_t r, int64_t I) {
  const bool up = r >= I;
  const int64_t i = up ? r - I : r;
  return (i / kSwiGLUInterleave) * (2 * kSwiGLUInterleave) + (up ? kSwiGLUInterleave : 0) + i % kSwiGLUInterleave;
}

// Row permutation of a [E, 2I, cols] tensor between the public and the internal order (exact copies).
// to_internal=true: out[e][swiglu_internal_row(r)] = in[e][r]; false: the inverse. in and out must not alias.
Status swiglu_permute_rows_bf16(const __nv_bfloat16* in, __nv_bfloat16* out, int64_t num_experts, int64_t I,
                                int64_t cols, bool to_internal, cudaStream_t stream);
Status swiglu_permute_rows_f32(const float* in, float* out, int64_t num_experts, int64_t I, int64_t cols,
                               bool to_internal, cudaStream_t stream);

// ---- epilogue ----
enum class GemmActivation : int {
  kNone = 0,
  kSwiGLU = 1,          // form 1: acc = h (interleaved gate/up, N = 2I wide); C = a = silu(g) * u, [rows, N/2]
  kSwiGLUBackward = 2,  // form 2: acc = da ([rows, I], N = I); reads h, C = dh (interleaved, [rows, 2N])
};

struct GemmEpilogue {
  GemmActivation activation = GemmActivation::kNone;
  // Per-row scale (fp32, indexed by the source row of A): multiplies the value stored to C (after the
  // activation; for SwiGLU backward, which is linear in da, this equals scaling da). Aux outputs unscaled.
  const float* row_scale = nullptr;
  // Scatter: C row (and aux rows) of source row r is scatter_rows[r]; -1 drops the row. nullptr = identity.
  const int32_t* scatter_rows = nullptr;
  // SwiGLU forward: optional h output [rows, N] bf16 (interleaved layout, unscaled).
  // SwiGLU backward: optional a = silu(g)*u output [rows, N] bf16 (unscaled).
  __nv_bfloat16* aux_out = nullptr;
  // SwiGLU backward: required h input [rows, 2N] bf16 (interleaved), indexed by the source row.
  const __nv_bfloat16* h_in = nullptr;
};

// How forms 1 and 2 (plain and SwiGLU forward epilogues) write C. Every mode gives bitwise the same C; they
// differ in speed only (docs/GEMM.md, run 8). A warpgroup's 64-row slice of a tile whose rows all belong
// to the expert, without scatter, can leave through TMA stores; partial slices and scatter always take
// the thread path. Form 3 and the SwiGLU backward epilogue always use the thread path.
enum class GemmStoreMode : int {
  kDefault = 0,  // the measured fastest of the modes below
  kThreads = 1,  // 4-stage ring; the threads copy C out of one 8 KB staging box per consumer warpgroup
  kTmaBox = 2,   // 4-stage ring; one 8 KB box per warpgroup, stored by TMA (each box waits for the last)
  kTmaTile = 3,  // 3-stage ring; four boxes per warpgroup (its whole 64 x 256 slice), stored by TMA: the
                 // epilogue never waits for its own stores, they drain during the next tile's main loop
};

// Launch shape. cluster_size 1 (default): independent persistent CTAs. 2: pairs of CTAs on vertically
// adjacent tiles share the B panel through TMA multicast (half the B traffic from L2).
struct GemmTuning {
  int cluster_size = 1;
  int max_ctas = 0;  // cap on the persistent grid (0 = every SM): virtual ranks share one GPU
  GemmStoreMode store = GemmStoreMode::kDefault;
  // Optional device int (cluster_size 1 only): work items are then handed out dynamically by atomicAdd on
  // it, and form 3 numbers the experts with the most rows first, so uneven experts leave no long tail.
  // The engine zeroes it (cudaMemsetAsync on the stream) before each launch; launches that can run at the
  // same time need distinct counters. Results are bitwise the same either way (every output tile is
  // computed whole by one CTA).
  int* work_counter = nullptr;
};

// Loads the kernels with cluster size 1 now (under lazy module loading a first launch waits for running
// kernels, which deadlocks virtual ranks spinning at a device barrier).
Status grouped_gemm_preload();

// Form 1. A [max_rows, K], B [num_groups, N, K], C [max_rows (or scatter target), N] (SwiGLU: N/2 wide).
Status grouped_gemm_nt(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning = {});

// Form 2. A [max_rows, K], B [num_groups, K, N] (N contiguous), C [max_rows, N]
// (SwiGLU backward: C = dh [rows, 2N]).
Status grouped_gemm_nn(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning = {});

// Form 3. A [max_rows, M], B [max_rows, N], C [num_groups, M, N] fp32. accumulate: C += A^T B, else C = A^T B
// (an expert with 0 rows gets C[e] = 0, or C[e] unchanged when accumulating).
// Boundary contract: the reduction of expert e runs over exactly its rows; K-tiles that straddle into the
// next expert (or past max_rows) have the foreign rows of both operands zeroed in shared memory before the
// tensor cores read them, so neither finite nor non-finite values of other experts leak in.
Status grouped_gemm_tn(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int M, int N, bool accumulate, cudaStream_t stream,
                       const GemmTuning& tuning = {});

}  // namespace megamoe::kernels
