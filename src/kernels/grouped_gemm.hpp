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
//   3. K-grouped:             C[e][M, N] (+)= A[rows_e, M]^T . B[rows_e, N]          (weight gradients, fp32 or bf16)
//
// Operand rows may be gathered by index (GemmGather): operand row r is then row index[r] of the given
// tensor, e.g. a receive buffer read in expert order without an expand copy.
//
// Epilogues (forms 1 and 2), see GemmEpilogue. Accumulation is fp32 in the tensor cores (wgmma .f32
// accumulators, the sum over K in the hardware's order, not bitwise equal to a CPU sum); the epilogue works
// in fp32 and rounds to bf16 once, round-to-nearest-even, at the store. Form 3 stores fp32 (or bf16, its
// overload below, rounded once); with accumulate=true it adds the tile to the existing value (C = C + acc in
// fp32, one rounding, no atomics: every output element is owned by exactly one thread).
//
// Requirements (checked, kInvalidArgument otherwise): sm_90 device; K % 8 == 0, N % 8 == 0 (form 3:
// M % 8 == 0 and N % 8 == 0), 16-byte aligned base pointers; num_groups in [1, kGemmMaxGroups];
// SwiGLU forward: N (= 2I) a multiple of the tile width; SwiGLU backward: N (= I) % 64 == 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/device_error.hpp"
#include "megamoe/status.hpp"

namespace megamoe::kernels {

inline constexpr int kGemmMaxGroups = 1024;

// ---- epilogue ----
enum class GemmActivation : int {
  kNone = 0,
  // Form 1: B = W13 [E, 2I, K] in the public order (gate rows 0..I-1, up rows I..2I-1), N = 2I; each tile
  // loads matching gate and up rows, so C = a = silu(g) * u [rows, N/2] comes out of the epilogue.
  kSwiGLU = 1,
  // Form 2: acc = da [rows, N = I]; reads h [rows, 2N] (gate columns, then up columns); C = dh [rows, 2N],
  // same column order.
  kSwiGLUBackward = 2,
};

struct GemmEpilogue {
  GemmActivation activation = GemmActivation::kNone;
  // Per-row scale (fp32, indexed by the source row of A): multiplies the value stored to C (after the
  // activation; for SwiGLU backward, which is linear in da, this equals scaling da).
  const float* row_scale = nullptr;
  // Scatter: C row (and aux rows) of source row r is scatter_rows[r]; -1 drops the row. nullptr = identity.
  const int32_t* scatter_rows = nullptr;
  // Row pointers: C row of source row r starts at row_pointers[r] (any address, a peer's buffer included;
  // nullptr drops the row). Excludes scatter_rows; aux rows stay contiguous.
  void* const* row_pointers = nullptr;
  // SwiGLU forward: optional h output [rows, N] (gate columns then up columns, unscaled).
  // SwiGLU backward: required row_scale * a output [rows, N], a = silu(g) * u recomputed from h.
  __nv_bfloat16* aux_out = nullptr;
  // SwiGLU backward: required h input [rows, 2N], indexed by the source row.
  const __nv_bfloat16* h_in = nullptr;
  // SwiGLU backward, optional: for source row r, the partial sums <da_r, a_r> over each n-tile's columns
  // (unscaled da) are written to row_dots[r][0 .. n_tiles) (grouped_gemm_n_tiles; nullptr skips the row).
  // Summing them in order gives the routing-weight gradient, deterministically.
  float* const* row_dots = nullptr;
};

// How forms 1 and 2 write C. Every mode gives bitwise the same C; they differ in speed only (docs/GEMM.md).
// A warpgroup's 64-row slice of a tile whose rows all belong to the expert, with contiguous outputs, can
// leave through TMA stores; partial slices, scatter and row pointers always take the thread path. Form 3
// always uses the thread path.
enum class GemmStoreMode : int {
  kDefault = 0,  // the measured fastest of the modes below
  kThreads = 1,  // the threads copy C out of one 8 KB staging box per consumer warpgroup (deeper ring)
  kTmaTile = 3,  // staging boxes for the warpgroup's whole slice, stored by TMA: the epilogue never waits for
                 // its own stores, they drain during the next tile's main loop (one stage less)
};

// Launch shape. cluster_size 1 (default): independent persistent CTAs. 2: pairs of CTAs on vertically
// adjacent tiles share the B panel through TMA multicast (half the B traffic from L2).
struct GemmTuning {
  int cluster_size = 1;
  int max_ctas = 0;  // cap on the persistent grid (0 = every SM): virtual ranks share one GPU
  GemmStoreMode store = GemmStoreMode::kDefault;
  // Optional device int (cluster_size 1 only): work items are then handed out dynamically by atomicAdd on
  // it, and form 3 numbers the experts with the most rows first, so uneven experts leave no long tail.
  // It must be zero before its first launch, and each launch leaves it zero (its last drawing CTA resets
  // it); launches that can run at the same time need distinct counters. Results are bitwise the same either
  // way (every output tile is computed whole by one CTA).
  int* work_counter = nullptr;
  // Tile width: 256 (default, 0) or 128 (cluster_size 1 only). The tile is 128 rows high.
  int tile_n = 0;
};

// Operand rows gathered by index. With a_rows, the A pointer is the source tensor (a_source_rows rows of
// the operand's width) and operand row r (r < max_rows) is source row a_rows[r]; values outside
// [0, a_source_rows) are clamped into it. b_rows: the same for B, form 3 only. Gathered operands need
// cluster_size 1.
struct GemmGather {
  const int32_t* a_rows = nullptr;
  int64_t a_source_rows = 0;
  const int32_t* b_rows = nullptr;
  int64_t b_source_rows = 0;
};

// Forms 1 and 2, optional: tiles whose A rows are produced while the GEMM runs. Row blocks of 128 rows are
// numbered over the experts in order (expert e's blocks follow those of e - 1; an expert with r rows has
// ceil(r / 128) of them); the tile of block b loads once counters[b] >= target (acquire at system scope;
// producers add with release). A wait longer than timeout_ns records kTimeout in *error naming the block,
// and the tile proceeds, so the kernel never hangs.
struct GemmReadiness {
  const uint32_t* counters = nullptr;
  uint32_t target = 1;
  ep::DeviceError* error = nullptr;
  int rank = 0;
  uint64_t timeout_ns = 0;
};

// n-tiles of an output N columns wide under `tuning` (the number of row_dots partials per row).
int grouped_gemm_n_tiles(int N, const GemmTuning& tuning);

// Loads every kernel of the engine now (under lazy module loading a first launch waits for running
// kernels, which deadlocks virtual ranks spinning at a device barrier).
Status grouped_gemm_preload();

// Form 1. A [max_rows, K], B [num_groups, N, K], C [max_rows (or scatter target), N] (SwiGLU: N/2 wide).
Status grouped_gemm_nt(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning = {}, const GemmGather& gather = {},
                       const GemmReadiness& readiness = {});

// Form 2. A [max_rows, K], B [num_groups, K, N] (N contiguous), C [max_rows, N]
// (SwiGLU backward: C = dh [rows, 2N]).
Status grouped_gemm_nn(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning = {}, const GemmGather& gather = {},
                       const GemmReadiness& readiness = {});

// Form 3. A [max_rows, M], B [max_rows, N], C [num_groups, M, N] fp32. accumulate: C += A^T B, else C = A^T B
// (an expert with 0 rows gets C[e] = 0, or C[e] unchanged when accumulating). transpose_c: C [num_groups, N, M]
// holds each C[e] transposed (C[e][n][m] = (A^T B)[m][n], bitwise the values of the untransposed call), so
// that the operand whose rows are gathered can be A, whichever of the two it is (A is the narrower operand
// of a tile, 128 columns against 256, and gathered rows cost per byte: docs/PERF.md runs 14 and 32).
// Boundary contract: the reduction of expert e runs over exactly its rows; K-tiles that straddle into the
// next expert (or past max_rows) have the foreign rows of both operands zeroed in shared memory before the
// tensor cores read them, so neither finite nor non-finite values of other experts leak in.
Status grouped_gemm_tn(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int M, int N, bool accumulate, cudaStream_t stream,
                       const GemmTuning& tuning = {}, const GemmGather& gather = {}, bool transpose_c = false);
// The same with C in bf16: each value (with accumulate, the sum of the existing value and the new one, in fp32)
// rounded once to nearest even: bitwise the fp32 call's C rounded to bf16, when not accumulating.
Status grouped_gemm_tn(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                       const int32_t* group_offsets, int num_groups, int64_t max_rows, int M, int N, bool accumulate,
                       cudaStream_t stream, const GemmTuning& tuning = {}, const GemmGather& gather = {},
                       bool transpose_c = false);

}  // namespace megamoe::kernels
