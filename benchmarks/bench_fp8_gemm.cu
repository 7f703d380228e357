// Blockwise-scaled FP8 GEMM (src/kernels/fp8_gemm.hpp) vs cuBLASLt FP8, side by side.
//
//   bench_fp8_gemm
//
// Shapes: dense 8192^3, and the MoE shapes of bench_gemm: 16 experts x 8192 rows (balanced),
// (N, K) in {(1536,2048), (2048,768), (3072,4096), (4096,1536)}.
// Baseline: cuBLASLt e4m3 x e4m3 -> bf16 (CUBLAS_COMPUTE_32F, fast accumulation off) with per-tensor scales:
// a speed baseline for the same operand bytes, not the same arithmetic (dense: cublasLtMatmul; MoE:
// strided-batched, possible because the split is uniform). Dense 8192^3 also against cuBLASLt's blockwise
// kernel on our scales (DeepSeek's recipe, ours; the kernel torch._scaled_mm runs for it). All scales are 1
// here, so all compute the same products and the outputs are compared (rel err ||D - D_cublasLt|| /
// ||D_cublasLt||: only the accumulation order and precision differ). Ours runs in single CTAs and in 2-CTA
// clusters (the weight panel multicast to a pair of tiles), and the two outputs must agree bit for bit; and
// with the promotion overlapped with the next block's wgmma (Fp8GemmTuning::overlap_promotion, one more line
// per shape, bitwise the same output). On
// the grouped shapes also with A's rows gathered by index (the layer's GEMM1 form), interleaved with the
// plain call and bitwise equal to it (one more line per shape; --gathered-only: that call alone, at
// N=3072 K=4096).
// Timing: CUDA events around each launch, 5 warm-ups, then 30 rounds in which every contender runs once in
// turn (interleaved, so clock drift hits all alike); the median of each. TFLOP/s = 2 M N K / time.
// Then the same with each contender's 5 warm-ups and 30 launches in a row, one contender after another (the
// order of the earlier runs, docs/PERF.md run 23), to compare the two orders.
//   bench_fp8_gemm [--interleaved | --sequential]
//   bench_fp8_gemm --k-sweep   (the grouped form's rate against K: the tile's fixed cost, see k_sweep)
//   bench_fp8_gemm --wgrad     (the layer's weight-gradient GEMMs: plain and overlapped loops, single CTAs and
//                              cluster pairs, see wgrad_shapes)
//   bench_fp8_gemm --k-sweep-pairs   (the same for the overlapped loop, single CTAs against 2-CTA pairs)
//   bench_fp8_gemm --gate-up   (the layer's GEMM1 with its SwiGLU epilogue: plain and overlapped loops, single
//                              CTAs and cluster pairs, see gate_up_shapes)
// (--out / --baseline, which scripts/gpu-check.sh gives every benchmark, are accepted and ignored: cuBLASLt
// is timed in the same run)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "bench_check.hpp"
#include "kernels/fp8_gemm.hpp"
#include "kernels/fp8_layout.hpp"
#include "kernels/fp8_wgrad.hpp"

using bf16 = __nv_bfloat16;

#define LT_CHECK(call)                                                                         \
  do {                                                                                         \
    cublasStatus_t s_ = (call);                                                                \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
      std::fprintf(stderr, "%s:%d %s: cublasLt status %d\n", __FILE__, __LINE__, #call, int(s_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace {

__global__ void fill_e4m3(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = float(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __nv_cvt_float_to_fp8((2.0f * u - 1.0f) * 4.0f, __NV_SATFINITE, __NV_E4M3);
  }
}

// dst row perm[r] = src row r (rows of `cols` bytes): A's rows scattered so that gathering them back through
// perm gives A again.
__global__ void scatter_rows(const uint8_t* src, uint8_t* dst, const int32_t* perm, int64_t rows, int cols) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint4* from = reinterpret_cast<const uint4*>(src + r * cols);
    uint4* to = reinterpret_cast<uint4*>(dst + int64_t{perm[r]} * cols);
    for (int c = threadIdx.x; c < cols / 16; c += blockDim.x) to[c] = from[c];
  }
}

template <class T>
__global__ void fill_value(T* p, size_t n, T v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

__global__ void diff_norms(const bf16* a, const bf16* ref, size_t n, double* out) {
  double num = 0, den = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(ref[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  for (int o = 16; o > 0; o >>= 1) {
    num += __shfl_down_sync(0xffffffffu, num, o);
    den += __shfl_down_sync(0xffffffffu, den, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&out[0], num);
    atomicAdd(&out[1], den);
  }
}

double rel_err(const bf16* a, const bf16* ref, size_t n) {
  double* d;
  BENCH_CHECK_CUDA(cudaMalloc(&d, 2 * sizeof(double)));
  BENCH_CHECK_CUDA(cudaMemset(d, 0, 2 * sizeof(double)));
  diff_norms<<<1024, 256>>>(a, ref, n, d);
  BENCH_CHECK_CUDA(cudaGetLastError());
  double h[2];
  BENCH_CHECK_CUDA(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaFree(d));
  std::printf("  check: ||D - D_cublasLt||^2 = %.6e, ||D_cublasLt||^2 = %.6e over %zu values\n", h[0], h[1], n);
  return std::sqrt(h[0] / std::max(h[1], 1e-300));
}

bool g_sequential = false;  // the order being timed

// Median times of `fns`, timed in interleaved rounds (or one contender after another: g_sequential).
std::vector<double> interleaved_median_ms(const std::vector<std::function<void()>>& fns, int warmup = 5,
                                          int iters = 30) {
  if (g_sequential && fns.size() > 1) {
    std::vector<double> medians;
    for (const auto& fn : fns) medians.push_back(interleaved_median_ms({fn}, warmup, iters)[0]);
    return medians;
  }
  for (int i = 0; i < warmup; ++i)
    for (const auto& fn : fns) fn();
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  BENCH_CHECK_CUDA(cudaEventCreate(&a));
  BENCH_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<std::vector<float>> t(fns.size(), std::vector<float>(iters));
  for (int i = 0; i < iters; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      BENCH_CHECK_CUDA(cudaEventRecord(a));
      fns[f]();
      BENCH_CHECK_CUDA(cudaEventRecord(b));
      BENCH_CHECK_CUDA(cudaEventSynchronize(b));
      BENCH_CHECK_CUDA(cudaEventElapsedTime(&t[f][i], a, b));
    }
  }
  BENCH_CHECK_CUDA(cudaGetLastError());
  BENCH_CHECK_CUDA(cudaEventDestroy(a));
  BENCH_CHECK_CUDA(cudaEventDestroy(b));
  std::vector<double> medians;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    medians.push_back(v[iters / 2]);
  }
  return medians;
}

// cuBLASLt FP8 of our row-major D[M, N] = A[M, K] . B[N, K]^T, batch `batch` (strides between batches:
// A rows_per_batch * K, B N * K, D rows_per_batch * N). In column-major terms D^T [N, M] = B^T-op . A, the
// "TN" form FP8 matmuls require.
struct LtGemm {
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t heur{};
  void* workspace = nullptr;
  size_t workspace_bytes = size_t{64} << 20;
  bool ok = false;

  // sa / sb non-null: DeepSeek's blockwise recipe in cuBLASLt (the kernel torch._scaled_mm runs for it), with
  // our scale layouts: cuBLASLt's A is our B (the weights, 128 x 128 blocks: sb [N / 128, K / 128]), its B our
  // A (1 x 128 blocks, K-block-major: sa [K / 128, M]). Otherwise per-tensor scales `one`.
  LtGemm(int64_t M, int N, int K, int batch, const float* one, const float* sa = nullptr, const float* sb = nullptr) {
    LT_CHECK(cublasLtCreate(&lt));
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    const int8_t fast_accum = 0;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
    const float* a_scale = sb != nullptr ? sb : one;
    const float* b_scale = sa != nullptr ? sa : one;
    if (sa != nullptr && sb != nullptr) {
      const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
      LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
    }
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K));
    LT_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K));
    LT_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
    if (batch > 1) {
      const int64_t sa = int64_t{N} * K, sb = M * K, sc = M * N;
      for (auto [l, stride] : {std::pair{la, sa}, std::pair{lb, sb}, std::pair{lc, sc}}) {
        LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
        LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)));
      }
    }
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                  sizeof(workspace_bytes)));
    BENCH_CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found);
    ok = s == CUBLAS_STATUS_SUCCESS && found > 0;
    if (!ok) std::printf("  cuBLASLt: no FP8 algorithm for this shape (status %d)\n", int(s));
  }
  ~LtGemm() {
    cudaFree(workspace);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(lt);
  }
  void run(const uint8_t* A, const uint8_t* B, bf16* D) const {
    const float alpha = 1.0f, beta = 0.0f;
    LT_CHECK(cublasLtMatmul(lt, op, &alpha, B, la, A, lb, &beta, D, lc, D, lc, &heur.algo, workspace,
                            workspace_bytes, nullptr));
  }
};

void fill(uint8_t* p, size_t n, uint64_t seed) {
  fill_e4m3<<<2048, 256>>>(p, n, seed);
  BENCH_CHECK_CUDA(cudaGetLastError());
}
// Every element v (fp32 scales, or TokenMajorScale bits).
template <class T>
void fill(T* p, size_t n, T v) {
  fill_value<<<1024, 256>>>(p, n, v);
  BENCH_CHECK_CUDA(cudaGetLastError());
}

// Device expert offsets [experts + 1] of a balanced split: expert e's rows from e * rows_per_expert.
int32_t* balanced_offsets(int experts, int64_t rows_per_expert) {
  std::vector<int32_t> off(experts + 1);
  for (int e = 0; e <= experts; ++e) off[e] = static_cast<int32_t>(e * rows_per_expert);
  int32_t* offsets;
  BENCH_CHECK_CUDA(cudaMalloc(&offsets, off.size() * sizeof(int32_t)));
  BENCH_CHECK_CUDA(cudaMemcpy(offsets, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return offsets;
}

// The operands of a blockwise FP8 (grouped) GEMM: A [M, K] and B [E, N, K] E4M3 codes from two seeds, sa the
// rows' 1 x 128 scales (pitch fp8_scale_pitch(M)) and sb the 128 x 128 block scales, all 1, and D [M, N] bf16.
struct Fp8GemmOperands {
  uint8_t *A = nullptr, *B = nullptr;
  float *sa = nullptr, *sb = nullptr;
  bf16* D = nullptr;
  Fp8GemmOperands(int64_t M, int E, int64_t N, int64_t K, uint64_t seed_a, uint64_t seed_b) {
    const size_t sa_count = size_t(megamoe::kernels::fp8_scale_pitch(M)) * (K / 128);
    const size_t sb_count = size_t(E) * ((N + 127) / 128) * (K / 128);
    BENCH_CHECK_CUDA(cudaMalloc(&A, size_t(M) * K));
    BENCH_CHECK_CUDA(cudaMalloc(&B, size_t(E) * N * K));
    BENCH_CHECK_CUDA(cudaMalloc(&sa, sa_count * sizeof(float)));
    BENCH_CHECK_CUDA(cudaMalloc(&sb, sb_count * sizeof(float)));
    BENCH_CHECK_CUDA(cudaMalloc(&D, size_t(M) * N * sizeof(bf16)));
    fill(A, size_t(M) * K, seed_a);
    fill(B, size_t(E) * N * K, seed_b);
    fill(sa, sa_count, 1.0f);
    fill(sb, sb_count, 1.0f);
  }
  void release() {
    for (void* p : {static_cast<void*>(A), static_cast<void*>(B), static_cast<void*>(sa), static_cast<void*>(sb),
                    static_cast<void*>(D)})
      BENCH_CHECK_CUDA(cudaFree(p));
  }
};

// The grouped GEMM with A's rows gathered by index (the layer's GEMM1 and d_a forms: the producer threads'
// cp.async instead of TMA boxes, and a proxy fence per K block in the consumers): A's rows scattered by a
// random permutation and gathered back through it, so the output must be bitwise that of the plain call.
// Timed in interleaved rounds with the plain call; one line, "<name> gathered A rows ...".
// alone: only the gathered call is timed (the plain one runs once afterwards, for the check), so that its
// launches come first (scripts/profile-fp8-gemm.sh --gathered).
void bench_gathered(const char* name, const uint8_t* A, const uint8_t* B, const float* sb, const int32_t* offsets,
                    int E, int64_t M, int N, int K, bool alone) {
  std::vector<int32_t> perm(static_cast<size_t>(M));
  for (int64_t r = 0; r < M; ++r) perm[r] = static_cast<int32_t>(r);
  uint64_t x = 0x243F6A8885A308D3ull;
  for (int64_t r = M - 1; r > 0; --r) {  // Fisher-Yates with a fixed splitmix-style sequence
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    std::swap(perm[r], perm[static_cast<int64_t>((z ^ (z >> 31)) % static_cast<uint64_t>(r + 1))]);
  }
  int32_t* perm_d;
  uint8_t* A_src;
  float* sa_rows;  // [M, K / 128] row-major: the gathered form's scale layout (all 1, as the plain call's)
  bf16 *D_plain, *D_gathered;
  const size_t d_count = size_t(M) * N;
  BENCH_CHECK_CUDA(cudaMalloc(&perm_d, perm.size() * sizeof(int32_t)));
  BENCH_CHECK_CUDA(cudaMalloc(&A_src, size_t(M) * K));
  BENCH_CHECK_CUDA(cudaMalloc(&sa_rows, size_t(M) * (K / 128) * sizeof(float)));
  BENCH_CHECK_CUDA(cudaMalloc(&D_plain, d_count * sizeof(bf16)));
  BENCH_CHECK_CUDA(cudaMalloc(&D_gathered, d_count * sizeof(bf16)));
  BENCH_CHECK_CUDA(cudaMemcpy(perm_d, perm.data(), perm.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  scatter_rows<<<4096, 128>>>(A, A_src, perm_d, M, K);
  BENCH_CHECK_CUDA(cudaGetLastError());
  fill(sa_rows, size_t(M) * (K / 128), 1.0f);
  float* sa_plain;  // the plain call's K-block-major scales, all 1
  const size_t sa_count = size_t(megamoe::kernels::fp8_scale_pitch(M)) * (K / 128);
  BENCH_CHECK_CUDA(cudaMalloc(&sa_plain, sa_count * sizeof(float)));
  fill(sa_plain, sa_count, 1.0f);
  BENCH_CHECK_CUDA(cudaMemset(D_plain, 0xFF, d_count * sizeof(bf16)));
  BENCH_CHECK_CUDA(cudaMemset(D_gathered, 0xFF, d_count * sizeof(bf16)));
  megamoe::kernels::Fp8GemmRows rows;
  rows.a_rows = perm_d;
  rows.a_source_rows = M;
  const auto plain = [&] {
    BENCH_CHECK_OK(
        megamoe::kernels::fp8_grouped_gemm_nt(A, sa_plain, B, sb, D_plain, offsets, E, M, N, K, nullptr, {1, 0}));
  };
  const auto gathered = [&] {
    BENCH_CHECK_OK(megamoe::kernels::fp8_grouped_gemm_nt(A_src, sa_rows, B, sb, D_gathered, offsets, E, M, N, K,
                                                         nullptr, {1, 0}, rows));
  };
  // The overlapped promotion on the gathered form, with bf16 and with fp32 output (the layer's h and g are the
  // latter): which of the two the overlapped loop loses on.
  float* D32_plain;
  float* D32_overlap;
  bf16* D_overlap;
  BENCH_CHECK_CUDA(cudaMalloc(&D32_plain, d_count * sizeof(float)));
  BENCH_CHECK_CUDA(cudaMalloc(&D32_overlap, d_count * sizeof(float)));
  BENCH_CHECK_CUDA(cudaMalloc(&D_overlap, d_count * sizeof(bf16)));
  BENCH_CHECK_CUDA(cudaMemset(D32_plain, 0xFF, d_count * sizeof(float)));
  BENCH_CHECK_CUDA(cudaMemset(D32_overlap, 0xFF, d_count * sizeof(float)));
  BENCH_CHECK_CUDA(cudaMemset(D_overlap, 0xFF, d_count * sizeof(bf16)));
  const auto gathered_with = [&](bf16* d, float* d32, bool overlap) {
    megamoe::kernels::Fp8GemmRows r = rows;
    r.d_fp32 = d32;
    megamoe::kernels::Fp8GemmTuning tuning{1, 0};
    tuning.overlap_promotion = overlap;
    BENCH_CHECK_OK(megamoe::kernels::fp8_grouped_gemm_nt(A_src, sa_rows, B, sb, d, offsets, E, M, N, K, nullptr,
                                                         tuning, r));
  };
  std::vector<double> t;
  if (alone) {
    t = {0.0, interleaved_median_ms({gathered})[0]};
    plain();
  } else {
    t = interleaved_median_ms({plain, gathered, [&] { gathered_with(D_overlap, nullptr, true); },
                               [&] { gathered_with(nullptr, D32_plain, false); },
                               [&] { gathered_with(nullptr, D32_overlap, true); }});
  }
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> h1(d_count), h2(d_count);
  BENCH_CHECK_CUDA(cudaMemcpy(h1.data(), D_plain, d_count * 2, cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaMemcpy(h2.data(), D_gathered, d_count * 2, cudaMemcpyDeviceToHost));
  size_t differ = 0;
  for (size_t i = 0; i < d_count; ++i) differ += h1[i] != h2[i];
  const double flop = 2.0 * double(M) * N * K;
  if (alone) {
    std::printf("%s gathered A rows %8.3f ms %7.1f TFLOP/s | %zu outputs differ from the TMA call's\n", name, t[1],
                flop / t[1] * 1e-9, differ);
  } else {
    std::printf("%s gathered A rows %8.3f ms %7.1f TFLOP/s | TMA rows in the same rounds %8.3f ms %7.1f TFLOP/s "
                "(gathered x %.3f) | %zu outputs differ from the TMA call's\n",
                name, t[1], flop / t[1] * 1e-9, t[0], flop / t[0] * 1e-9, t[0] / t[1], differ);
  }
  if (!alone) {
    std::vector<uint16_t> h3(d_count);
    BENCH_CHECK_CUDA(cudaMemcpy(h3.data(), D_overlap, d_count * 2, cudaMemcpyDeviceToHost));
    size_t differ_overlap = 0;
    for (size_t i = 0; i < d_count; ++i) differ_overlap += h3[i] != h2[i];
    std::vector<uint32_t> f1(d_count), f2(d_count);
    BENCH_CHECK_CUDA(cudaMemcpy(f1.data(), D32_plain, d_count * 4, cudaMemcpyDeviceToHost));
    BENCH_CHECK_CUDA(cudaMemcpy(f2.data(), D32_overlap, d_count * 4, cudaMemcpyDeviceToHost));
    size_t differ32 = 0;
    for (size_t i = 0; i < d_count; ++i) differ32 += f1[i] != f2[i];
    std::printf("%s gathered, overlapped promotion: bf16 out %8.3f ms %7.1f TFLOP/s (x %.3f of the plain loop, %zu "
                "differ) | fp32 out plain %8.3f ms %7.1f, overlapped %8.3f ms %7.1f (x %.3f, %zu differ)\n",
                name, t[2], flop / t[2] * 1e-9, t[1] / t[2], differ_overlap, t[3], flop / t[3] * 1e-9, t[4],
                flop / t[4] * 1e-9, t[3] / t[4], differ32);
  }
  BENCH_CHECK_CUDA(cudaFree(D_overlap));
  BENCH_CHECK_CUDA(cudaFree(D32_overlap));
  BENCH_CHECK_CUDA(cudaFree(D32_plain));
  BENCH_CHECK_CUDA(cudaFree(sa_plain));
  BENCH_CHECK_CUDA(cudaFree(D_gathered));
  BENCH_CHECK_CUDA(cudaFree(D_plain));
  BENCH_CHECK_CUDA(cudaFree(sa_rows));
  BENCH_CHECK_CUDA(cudaFree(A_src));
  BENCH_CHECK_CUDA(cudaFree(perm_d));
}

// One row of the table: `groups` experts of `rows_per_group` rows each (groups == 0: dense).
// gathered_only: only the gathered-rows call of a grouped shape (bench_gathered alone).
void bench(const char* name, int groups, int64_t rows_per_group, int N, int K, const float* one,
           bool gathered_only = false) {
  const int E = std::max(groups, 1);
  const int64_t M = rows_per_group * E;
  Fp8GemmOperands ops(M, E, N, K, 1, 2);
  const uint8_t *A = ops.A, *B = ops.B;
  const float *sa = ops.sa, *sb = ops.sb;
  bf16* const D = ops.D;
  bf16* D_ref;
  BENCH_CHECK_CUDA(cudaMalloc(&D_ref, size_t(M) * N * sizeof(bf16)));
  int32_t* const offsets = balanced_offsets(E, rows_per_group);
  BENCH_CHECK_CUDA(cudaMemset(D, 0xFF, size_t(M) * N * sizeof(bf16)));

  const auto release = [&] {
    ops.release();
    BENCH_CHECK_CUDA(cudaFree(D_ref));
    BENCH_CHECK_CUDA(cudaFree(offsets));
  };
  if (gathered_only) {
    if (groups > 0) bench_gathered(name, A, B, sb, offsets, E, M, N, K, true);
    release();
    return;
  }

  bf16* D_pair;
  BENCH_CHECK_CUDA(cudaMalloc(&D_pair, size_t(M) * N * sizeof(bf16)));
  BENCH_CHECK_CUDA(cudaMemset(D_pair, 0xFF, size_t(M) * N * sizeof(bf16)));
  auto ours = [&](int cluster_size, bf16* out, bool overlap = false) {
    megamoe::kernels::Fp8GemmTuning tuning{cluster_size, 0};
    tuning.overlap_promotion = overlap;
    if (groups == 0) {
      BENCH_CHECK_OK(megamoe::kernels::fp8_gemm_nt(A, sa, B, sb, out, M, N, K, nullptr, tuning));
    } else {
      BENCH_CHECK_OK(megamoe::kernels::fp8_grouped_gemm_nt(A, sa, B, sb, out, offsets, E, M, N, K, nullptr, tuning));
    }
  };
  bf16 *D_overlap, *D_overlap_pair;
  for (bf16** d : {&D_overlap, &D_overlap_pair}) {
    BENCH_CHECK_CUDA(cudaMalloc(d, size_t(M) * N * sizeof(bf16)));
    BENCH_CHECK_CUDA(cudaMemset(*d, 0xFF, size_t(M) * N * sizeof(bf16)));
  }
  const double flop = 2.0 * double(M) * N * K;
  LtGemm lt(rows_per_group, N, K, groups == 0 ? 1 : E, one);
  std::vector<std::function<void()>> contenders = {[&] { ours(1, D); }, [&] { ours(2, D_pair); },
                                                   [&] { ours(1, D_overlap, true); },
                                                   [&] { ours(2, D_overlap_pair, true); }};
  if (lt.ok) contenders.push_back([&] { lt.run(A, B, D_ref); });
  // Dense: also cuBLASLt's blockwise kernel on our scales (sa's pitch is M here: M is a multiple of 4).
  std::unique_ptr<LtGemm> lt_block;
  bf16* D_block = nullptr;
  if (groups == 0 && megamoe::kernels::fp8_scale_pitch(M) == M && K / 128 % 4 == 0) {
    lt_block = std::make_unique<LtGemm>(rows_per_group, N, K, 1, one, sa, sb);
    BENCH_CHECK_CUDA(cudaMalloc(&D_block, size_t(M) * N * sizeof(bf16)));
    BENCH_CHECK_CUDA(cudaMemset(D_block, 0xFF, size_t(M) * N * sizeof(bf16)));
    if (lt_block->ok) contenders.push_back([&] { lt_block->run(A, B, D_block); });
  }
  const std::vector<double> t = interleaved_median_ms(contenders);
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  const double t_ours = t[0], t_pair = t[1], t_overlap = t[2], t_overlap_pair = t[3], t_lt = lt.ok ? t[4] : 0.0;
  if (lt_block && lt_block->ok) {
    const double t_block = t.back();
    std::printf("%-30s cuBLASLt blockwise 1x128 / 128x128 (the recipe of ours; torch._scaled_mm's kernel) %8.3f ms "
                "%7.1f TFLOP/s | ours / it x %.3f | rel err to per-tensor %.2e\n",
                name, t_block, flop / t_block * 1e-9, t_block / t_ours,
                lt.ok ? rel_err(D_block, D_ref, size_t(M) * N) : -1.0);
  } else if (lt_block) {
    std::printf("%-30s cuBLASLt blockwise: no algorithm here\n", name);
  }
  if (D_block != nullptr) BENCH_CHECK_CUDA(cudaFree(D_block));
  if (groups > 0) bench_gathered(name, A, B, sb, offsets, E, M, N, K, false);
  const double err = lt.ok ? rel_err(D, D_ref, size_t(M) * N) : -1.0;
  std::vector<uint16_t> h1(size_t(M) * N), h2(size_t(M) * N);
  BENCH_CHECK_CUDA(cudaMemcpy(h1.data(), D, h1.size() * 2, cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaMemcpy(h2.data(), D_pair, h2.size() * 2, cudaMemcpyDeviceToHost));
  size_t differ = 0;
  for (size_t i = 0; i < h1.size(); ++i) differ += h1[i] != h2[i];
  BENCH_CHECK_CUDA(cudaMemcpy(h2.data(), D_overlap, h2.size() * 2, cudaMemcpyDeviceToHost));
  size_t differ_overlap = 0;
  for (size_t i = 0; i < h1.size(); ++i) differ_overlap += h1[i] != h2[i];
  std::printf("%s overlapped promotion %8.3f ms %7.1f TFLOP/s | the plain loop in the same rounds %8.3f ms (overlapped "
              "x %.3f) | %zu outputs differ\n",
              name, t_overlap, flop / t_overlap * 1e-9, t_ours, t_ours / t_overlap, differ_overlap);
  BENCH_CHECK_CUDA(cudaMemcpy(h2.data(), D_overlap_pair, h2.size() * 2, cudaMemcpyDeviceToHost));
  size_t differ_overlap_pair = 0;
  for (size_t i = 0; i < h1.size(); ++i) differ_overlap_pair += h1[i] != h2[i];
  std::printf("%s overlapped promotion in pairs %8.3f ms %7.1f TFLOP/s | x %.3f the plain pairs | %zu outputs differ\n",
              name, t_overlap_pair, flop / t_overlap_pair * 1e-9, t_pair / t_overlap_pair, differ_overlap_pair);
  BENCH_CHECK_CUDA(cudaFree(D_overlap));
  BENCH_CHECK_CUDA(cudaFree(D_overlap_pair));
  std::printf("%-30s %8.3f ms %7.1f TFLOP/s | pairs %8.3f ms %7.1f TFLOP/s (x %.3f; %zu outputs differ) | cuBLASLt "
              "%8.3f ms %7.1f TFLOP/s | x %.3f / %.3f | rel err %.2e\n",
              name, t_ours, flop / t_ours * 1e-9, t_pair, flop / t_pair * 1e-9, t_ours / t_pair, differ, t_lt,
              lt.ok ? flop / t_lt * 1e-9 : 0.0, lt.ok ? t_lt / t_ours : 0.0, lt.ok ? t_lt / t_pair : 0.0, err);
  BENCH_CHECK_CUDA(cudaFree(D_pair));
  release();
}

// --k-sweep: the layer's grouped form (16 experts x 8192 rows, N = 2048, single CTAs) at K = 2 .. 32 blocks of
// 128, the plain and the overlapped promotion, all interleaved in the same rounds. A tile that costs kb K blocks
// of main loop plus a fixed X (tile boundary: last promotion, epilogue, next tile's start) runs at
// rate = c kb / (kb + X), i.e. 1 / rate = 1 / c + (X / c) / kb: a straight line in 1 / kb, fitted by least
// squares; c is the main loop's own rate, X the tile's fixed cost in K blocks (docs/FP8.md).
// cluster 2 (--k-sweep-pairs): the overlapped loop in single CTAs and in 2-CTA pairs (the weight panel
// multicast: a quarter fewer L2 bytes per block, docs/PERF.md run 83) instead of plain and overlapped.
void k_sweep(int cluster) {
  constexpr int E = 16, N = 2048;
  constexpr int64_t rows_per_group = 8192, M = rows_per_group * E;
  const int blocks[] = {2, 4, 6, 8, 12, 16, 24, 32};
  constexpr int kMaxK = 32 * 128;
  Fp8GemmOperands ops(M, E, N, kMaxK, 1, 2);
  const uint8_t *A = ops.A, *B = ops.B;
  const float *sa = ops.sa, *sb = ops.sb;
  bf16* const D = ops.D;
  int32_t* const offsets = balanced_offsets(E, rows_per_group);
  std::vector<std::function<void()>> contenders;
  for (const int group : {0, 1}) {
    const bool overlap = cluster == 2 || group == 1;
    const int group_cluster = cluster == 2 && group == 1 ? 2 : 1;
    for (const int kb : blocks) {
      contenders.push_back([=] {
        megamoe::kernels::Fp8GemmTuning tuning{group_cluster, 0};
        tuning.overlap_promotion = overlap;
        BENCH_CHECK_OK(
            megamoe::kernels::fp8_grouped_gemm_nt(A, sa, B, sb, D, offsets, E, M, N, kb * 128, nullptr, tuning));
      });
    }
  }
  const std::vector<double> t = interleaved_median_ms(contenders);
  constexpr int kCount = sizeof(blocks) / sizeof(blocks[0]);
  std::printf("K sweep: grouped 16x8192 N=%d, interleaved (median of 30)\n", N);
  std::printf("| loop | K blocks | K | ms | TFLOP/s |\n|---|---|---|---|---|\n");
  const char* group_name[2] = {cluster == 2 ? "overlapped" : "plain", cluster == 2 ? "overlapped pairs" : "overlapped"};
  for (int o = 0; o < 2; ++o) {
    // Least squares of y = 1 / rate against x = 1 / kb.
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    std::vector<double> rate(kCount);
    for (int i = 0; i < kCount; ++i) {
      const double ms = t[o * kCount + i];
      rate[i] = 2.0 * double(M) * N * blocks[i] * 128 / (ms * 1e-3) / 1e12;
      std::printf("| %s | %d | %d | %.3f | %.1f |\n", group_name[o], blocks[i], blocks[i] * 128, ms, rate[i]);
      const double x = 1.0 / blocks[i], y = 1.0 / rate[i];
      sx += x, sy += y, sxx += x * x, sxy += x * y;
    }
    const double n = kCount, slope = (n * sxy - sx * sy) / (n * sxx - sx * sx), icpt = (sy - slope * sx) / n;
    const double c = 1.0 / icpt, X = slope * c;
    // One K block of a 128 x 128 tile at rate c, on one of the SMs that share the work.
    int sms = 0, device = 0;
    BENCH_CHECK_CUDA(cudaGetDevice(&device));
    BENCH_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const double block_us = 2.0 * 128 * 128 * 128 / (c * 1e12 / sms) * 1e6;
    double worst = 0;
    for (int i = 0; i < kCount; ++i) {
      const double fit = c * blocks[i] / (blocks[i] + X);
      worst = std::max(worst, std::fabs(fit - rate[i]) / rate[i]);
    }
    std::printf("fit (%s): rate = c kb / (kb + X), c = %.1f TFLOP/s, X = %.2f K blocks = %.2f us a tile "
                "(a K block %.3f us on one of %d SMs); worst residual %.1f%%\n",
                group_name[o], c, X, X * block_us, block_us, sms, 100.0 * worst);
  }
  ops.release();
  BENCH_CHECK_CUDA(cudaFree(offsets));
}


// The FP8 layer's weight gradients (kernels/fp8_wgrad.hpp) at the benchmark configuration: 16 experts of 8192
// routed rows (K of the GEMM), dW13 = dh^T x (M = 2I, N = H) and dW2 = dy^T a (M = H, N = I) for (H, I) =
// (2048, 768) and (4096, 1536). Seven forms: the plain and the overlapped loop, in single CTAs and in 2-CTA
// cluster pairs sharing B, the plain loop in 128 x 192 tiles, and the plain loop on the operands swapped with D
// stored transposed (D^T = B^T A, as the layer forms dW13) in 128 x 128 and 128 x 192 tiles. Scales 1, so that
// all seven must agree bit for bit. Each shape also against the data
// GEMM of the same FLOPs (8192 rows an expert, N = M, K = N), whose promotion is one scale a row (overlapped,
// as in the layer, and plain): what the weight gradient's two scales a value cost, at equal work.
void wgrad_shapes() {
  constexpr int E = 16;
  constexpr int64_t rows_per_expert = 8192, capacity = rows_per_expert * E;
  const int64_t columns = megamoe::kernels::token_major_columns(capacity, E);
  int32_t* const offsets = balanced_offsets(E, rows_per_expert);
  struct Form {
    const char* name;
    bool overlap;
    int cluster;
    int tile_columns;
    bool swapped;
  };
  constexpr int kFormCount = 7;
  constexpr Form kForms[kFormCount] = {{"plain", false, 1, 128, false},
                                       {"overlapped", true, 1, 128, false},
                                       {"plain, pairs", false, 2, 128, false},
                                       {"overlapped, pairs", true, 2, 128, false},
                                       {"plain, 192 columns", false, 1, 192, false},
                                       {"swapped, transposed D", false, 1, 128, true},
                                       {"swapped, transposed D, 192 columns", false, 1, 192, true}};
  std::printf("FP8 weight gradients: 16 experts x 8192 routed rows, interleaved (median of 30), TFLOP/s\n");
  std::printf("| gradient (H, I) | M | N | plain | overlapped | plain, pairs | overlapped, pairs | "
              "plain, 192 columns | swapped, transposed D | swapped, transposed D, 192 columns | best / plain | "
              "best swapped / best | data GEMM, same FLOPs | data GEMM, plain loop | best / data GEMM | bitwise |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const int64_t layer_shapes[2][2] = {{2048, 768}, {4096, 1536}};
  for (const auto& hi : layer_shapes) {
    const int64_t H = hi[0], I = hi[1];
    const struct {
      const char* name;
      int64_t M, N;
    } grads[2] = {{"dW13", 2 * I, H}, {"dW2", H, I}};
    for (const auto& g : grads) {
      const int64_t M = g.M, N = g.N;
      const size_t count = size_t(E) * M * N;
      uint8_t *qa, *qb;
      megamoe::kernels::TokenMajorScale *sa, *sb;
      float* D[kFormCount];
      const size_t scale_rows = size_t(columns / 128);
      BENCH_CHECK_CUDA(cudaMalloc(&qa, size_t(M) * columns));
      BENCH_CHECK_CUDA(cudaMalloc(&qb, size_t(N) * columns));
      BENCH_CHECK_CUDA(cudaMalloc(&sa, scale_rows * M * sizeof(*sa)));
      BENCH_CHECK_CUDA(cudaMalloc(&sb, scale_rows * N * sizeof(*sb)));
      fill(qa, size_t(M) * columns, 11);
      fill(qb, size_t(N) * columns, 12);
      constexpr megamoe::kernels::TokenMajorScale kOne = 0x3F80;  // 1.0: the upper half of its fp32 bits
      fill(sa, scale_rows * M, kOne);
      fill(sb, scale_rows * N, kOne);
      // Poisoned unlike each other, so that an output one form leaves unwritten cannot compare equal.
      for (int f = 0; f < kFormCount; ++f) {
        BENCH_CHECK_CUDA(cudaMalloc(&D[f], count * sizeof(float)));
        BENCH_CHECK_CUDA(cudaMemset(D[f], 0xFC + f, count * sizeof(float)));
      }
      // The data GEMM of the same FLOPs: A [capacity, K = N] rows, B [E, N' = M, K].
      Fp8GemmOperands data(capacity, E, M, N, 13, 14);
      std::vector<std::function<void()>> contenders;
      for (int f = 0; f < kFormCount; ++f) {
        float* const d = D[f];
        const Form form = kForms[f];
        contenders.push_back([=] {
          if (form.swapped)
            BENCH_CHECK_OK(megamoe::kernels::fp8_wgrad_gemm(qb, sb, N, qa, sa, M, offsets, E, capacity, d, false,
                                                            nullptr, 0, false, 1, form.tile_columns, true));
          else
            BENCH_CHECK_OK(megamoe::kernels::fp8_wgrad_gemm(qa, sa, M, qb, sb, N, offsets, E, capacity, d, false,
                                                            nullptr, 0, form.overlap, form.cluster,
                                                            form.tile_columns));
        });
      }
      // Overlapped (as the layer's data GEMMs whose A comes by TMA), then plain.
      for (const bool overlap : {true, false}) {
        megamoe::kernels::Fp8GemmTuning tuning{};
        tuning.overlap_promotion = overlap;
        contenders.push_back([=] {
          BENCH_CHECK_OK(megamoe::kernels::fp8_grouped_gemm_nt(data.A, data.sa, data.B, data.sb, data.D, offsets, E,
                                                               capacity, static_cast<int>(M), static_cast<int>(N),
                                                               nullptr, tuning));
        });
      }
      const std::vector<double> t = interleaved_median_ms(contenders);
      BENCH_CHECK_CUDA(cudaDeviceSynchronize());
      std::vector<float> first(count), other(count);
      BENCH_CHECK_CUDA(cudaMemcpy(first.data(), D[0], count * sizeof(float), cudaMemcpyDeviceToHost));
      // A swapped form that differs is reported (its timing still stands); any other ends the benchmark.
      bool same = true, swapped_same = true;
      for (int f = 1; f < kFormCount; ++f) {
        BENCH_CHECK_CUDA(cudaMemcpy(other.data(), D[f], count * sizeof(float), cudaMemcpyDeviceToHost));
        if (std::memcmp(first.data(), other.data(), count * sizeof(float)) != 0) {
          std::fprintf(stderr, "bench_fp8_gemm --wgrad: %s %s: the %s form's D differs from the plain loop's\n",
                       g.name, std::to_string(H).c_str(), kForms[f].name);
          (kForms[f].swapped ? swapped_same : same) = false;
        }
      }
      const double flops = 2.0 * double(capacity) * double(M) * double(N);
      const auto rate = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
      const double best128 = std::min(std::min(t[0], t[1]), std::min(t[2], t[3]));
      const double best = std::min(best128, t[4]), best_swapped = std::min(t[5], t[6]);
      std::printf("| %s (%lld, %lld) | %lld | %lld | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | x %.3f | "
                  "x %.3f | %.1f | %.1f | x %.3f | %s |\n",
                  g.name, static_cast<long long>(H), static_cast<long long>(I), static_cast<long long>(M),
                  static_cast<long long>(N), rate(t[0]), rate(t[1]), rate(t[2]), rate(t[3]), rate(t[4]), rate(t[5]),
                  rate(t[6]), t[0] / best, best / best_swapped, rate(t[7]), rate(t[8]),
                  t[7] / std::min(best, best_swapped), !same ? "NO" : swapped_same ? "yes" : "yes; swapped NO");
      for (void* p : {static_cast<void*>(qa), static_cast<void*>(qb), static_cast<void*>(sa), static_cast<void*>(sb)})
        BENCH_CHECK_CUDA(cudaFree(p));
      for (float* d : D) BENCH_CHECK_CUDA(cudaFree(d));
      data.release();
      if (!same) std::exit(1);
    }
  }
  BENCH_CHECK_CUDA(cudaFree(offsets));
}

// The FP8 layer's GEMM1 (Fp8GemmRows::swiglu_a_q: h = x W13^T in fp32 and a = silu(gate) * up quantized 1 x 128)
// at the benchmark configuration: 16 experts of 8192 rows, N = 2I, K = H for (H, I) = (2048, 768) and
// (4096, 1536). Four forms: the plain and the overlapped loop, in single CTAs and in 2-CTA pairs sharing the
// weight panel. Scales 1; all four must agree bit for bit in h, a's codes and a's scales.
void gate_up_shapes() {
  constexpr int E = 16;
  constexpr int64_t rows_per_expert = 8192, capacity = rows_per_expert * E;
  int32_t* const offsets = balanced_offsets(E, rows_per_expert);
  struct Form {
    const char* name;
    bool overlap;
    int cluster;
  };
  constexpr Form kForms[4] = {{"plain", false, 1}, {"overlapped", true, 1}, {"plain, pairs", false, 2},
                              {"overlapped, pairs", true, 2}};
  std::printf("FP8 GEMM1 with the SwiGLU epilogue: 16 experts x 8192 rows, interleaved (median of 30), TFLOP/s\n");
  std::printf("| (H, I) | N | K | plain | overlapped | plain, pairs | overlapped, pairs | pairs / single (best of "
              "each) | bitwise |\n|---|---|---|---|---|---|---|---|---|\n");
  const int layer_shapes[2][2] = {{2048, 768}, {4096, 1536}};
  for (const auto& hi : layer_shapes) {
    const int H = hi[0], I = hi[1], N = 2 * I, K = H;
    const int64_t pitch = megamoe::kernels::fp8_scale_pitch(capacity);
    Fp8GemmOperands ops(capacity, E, N, K, 21, 22);
    float* h[4];
    uint8_t* aq[4];
    float* as[4];
    const size_t h_count = size_t(capacity) * N, aq_count = size_t(capacity) * I, as_count = size_t(pitch) * (I / 128);
    std::vector<std::function<void()>> contenders;
    for (int f = 0; f < 4; ++f) {
      BENCH_CHECK_CUDA(cudaMalloc(&h[f], h_count * sizeof(float)));
      BENCH_CHECK_CUDA(cudaMalloc(&aq[f], aq_count));
      BENCH_CHECK_CUDA(cudaMalloc(&as[f], as_count * sizeof(float)));
      // Poisoned unlike each other, so that an output one form leaves unwritten cannot compare equal.
      BENCH_CHECK_CUDA(cudaMemset(h[f], 0xFC + f, h_count * sizeof(float)));
      BENCH_CHECK_CUDA(cudaMemset(aq[f], 0xF0 + f, aq_count));
      BENCH_CHECK_CUDA(cudaMemset(as[f], 0xFC + f, as_count * sizeof(float)));
      megamoe::kernels::Fp8GemmRows rows;
      rows.d_fp32 = h[f];
      rows.swiglu_a_q = aq[f];
      rows.swiglu_a_s = as[f];
      rows.swiglu_a_s_pitch = pitch;
      megamoe::kernels::Fp8GemmTuning tuning{kForms[f].cluster, 0};
      tuning.overlap_promotion = kForms[f].overlap;
      contenders.push_back([=] {
        BENCH_CHECK_OK(megamoe::kernels::fp8_grouped_gemm_nt(ops.A, ops.sa, ops.B, ops.sb, nullptr, offsets, E,
                                                             capacity, N, K, nullptr, tuning, rows));
      });
    }
    const std::vector<double> t = interleaved_median_ms(contenders);
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    bool same = true;
    const auto compare = [&](const void* first, const void* other, size_t bytes, const char* what, int f) {
      std::vector<uint8_t> x(bytes), y(bytes);
      BENCH_CHECK_CUDA(cudaMemcpy(x.data(), first, bytes, cudaMemcpyDeviceToHost));
      BENCH_CHECK_CUDA(cudaMemcpy(y.data(), other, bytes, cudaMemcpyDeviceToHost));
      if (x != y) {
        std::fprintf(stderr, "bench_fp8_gemm --gate-up: H=%d: the %s form's %s differs from the plain loop's\n", H,
                     kForms[f].name, what);
        same = false;
      }
    };
    for (int f = 1; f < 4; ++f) {
      compare(h[0], h[f], h_count * sizeof(float), "h", f);
      compare(aq[0], aq[f], aq_count, "a codes", f);
      // Only the scales of expert rows are written: the first `capacity` of each group's pitch.
      for (int q = 0; q < I / 128; ++q)
        compare(as[0] + q * pitch, as[f] + q * pitch, size_t(capacity) * sizeof(float), "a scales", f);
    }
    const double flops = 2.0 * double(capacity) * double(N) * double(K);
    const auto rate = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
    std::printf("| (%d, %d) | %d | %d | %.1f | %.1f | %.1f | %.1f | x %.3f | %s |\n", H, I, N, K, rate(t[0]),
                rate(t[1]), rate(t[2]), rate(t[3]), std::min(t[0], t[1]) / std::min(t[2], t[3]), same ? "yes" : "NO");
    for (int f = 0; f < 4; ++f)
      for (void* p : {static_cast<void*>(h[f]), static_cast<void*>(aq[f]), static_cast<void*>(as[f])})
        BENCH_CHECK_CUDA(cudaFree(p));
    ops.release();
    if (!same) std::exit(1);
  }
  BENCH_CHECK_CUDA(cudaFree(offsets));
}
}  // namespace

int main(int argc, char** argv) {
  // Both orders by default (runs 38-40 saw 740-920 TFLOP/s dense interleaved where run 23 measured 1030 one
  // contender after another, with the same main loop): --interleaved or --sequential for one of them.
  bool interleaved = true, sequential = true, dense_only = false, gathered_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--k-sweep")) {  // the tile's fixed cost: rate against K blocks (k_sweep above)
      k_sweep(1);
      return 0;
    }
    if (!std::strcmp(argv[i], "--k-sweep-pairs")) {  // the same, overlapped, single CTAs against 2-CTA pairs
      k_sweep(2);
      return 0;
    }
    if (!std::strcmp(argv[i], "--wgrad")) {  // the layer's weight gradients (wgrad_shapes above)
      wgrad_shapes();
      return 0;
    }
    if (!std::strcmp(argv[i], "--gate-up")) {  // the layer's GEMM1 with its SwiGLU epilogue (gate_up_shapes)
      gate_up_shapes();
      return 0;
    }
    if (!std::strcmp(argv[i], "--dense-only")) {  // the 8192^3 GEMM alone (scripts/profile-fp8-gemm.sh)
      dense_only = true;
    } else if (!std::strcmp(argv[i], "--gathered-only")) {  // the gathered-rows GEMM at N=3072 K=4096 alone
      gathered_only = true;
    } else if (!std::strcmp(argv[i], "--sequential")) {
      interleaved = false;
    } else if (!std::strcmp(argv[i], "--interleaved")) {
      sequential = false;
    } else if ((!std::strcmp(argv[i], "--out") || !std::strcmp(argv[i], "--baseline")) && i + 1 < argc) {
      ++i;  // scripts/gpu-check.sh passes these to every benchmark; this one times its own baseline
    } else {
      std::fprintf(stderr,
                   "usage: bench_fp8_gemm [--interleaved | --sequential] [--dense-only | --gathered-only] "
                   "[--out IGNORED] [--baseline IGNORED] | --k-sweep | --k-sweep-pairs | --wgrad | --gate-up\n");
      return 2;
    }
  }
  if (!interleaved && !sequential) {
    std::fprintf(stderr, "bench_fp8_gemm: --interleaved and --sequential exclude each other\n");
    return 2;
  }
  if (dense_only && gathered_only) {
    std::fprintf(stderr, "bench_fp8_gemm: --dense-only and --gathered-only exclude each other\n");
    return 2;
  }
  float* one;
  BENCH_CHECK_CUDA(cudaMalloc(&one, sizeof(float)));
  fill(one, 1, 1.0f);
  for (const bool one_after_another : {false, true}) {
    if (one_after_another ? !sequential : !interleaved) continue;
    g_sequential = one_after_another;
    std::printf("blockwise FP8 GEMM (scales 1), single CTAs and 2-CTA pairs, vs cuBLASLt FP8 (per-tensor scales 1);\n"
                "x = single-CTA time / pair time, and cuBLASLt time / ours (single / pairs); contenders timed %s\n",
                g_sequential ? "one after another" : "in interleaved rounds");
    if (gathered_only) {  // the layer's GEMM1 at H = 4096, I = 1536 (scripts/profile-fp8-gemm.sh --gathered)
      bench("grouped 16x8192 N=3072 K=4096", 16, 8192, 3072, 4096, one, true);
      continue;
    }
    bench("dense 8192^3", 0, 8192, 8192, 8192, one);
    if (dense_only) continue;
    const int shapes[4][2] = {{1536, 2048}, {2048, 768}, {3072, 4096}, {4096, 1536}};
    for (const auto& s : shapes) {
      char name[64];
      std::snprintf(name, sizeof(name), "grouped 16x8192 N=%d K=%d", s[0], s[1]);
      bench(name, 16, 8192, s[0], s[1], one);
    }
  }
  BENCH_CHECK_CUDA(cudaFree(one));
  return 0;
}
