// Grouped-GEMM engine vs cuBLAS (and torch._grouped_mm, read from a CSV that
// benchmarks/bench_gemm_torch.py writes in the same device session), side by side.
//
//   bench_gemm [torch_results.csv]
//
// Shapes: 16 experts x 8192 rows (balanced) and a skewed split with the same total (4 experts empty, one
// with 4x the mean rows), (N, K) in {(1536,2048), (2048,768), (3072,4096), (4096,1536)}; dense 8192^3.
// Timing: CUDA events around each launch, 5 warm-ups, median of 30. Every engine result is compared with
// cuBLAS on the device (rel err ||C - C_cublas|| / ||C_cublas||).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "kernels/grouped_gemm.hpp"

using bf16 = __nv_bfloat16;
using megamoe::kernels::GemmActivation;
using megamoe::kernels::GemmEpilogue;
using megamoe::kernels::GemmTuning;

#define CB(call)                                                                         \
  do {                                                                                   \
    cublasStatus_t s_ = (call);                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      std::fprintf(stderr, "%s:%d %s: cublas %d\n", __FILE__, __LINE__, #call, int(s_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
namespace {

__global__ void fill_random(bf16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = float(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

template <typename T>
__device__ double to_d(T v) {
  if constexpr (sizeof(T) == 2) {
    return double(__bfloat162float(v));
  } else {
    return double(v);
  }
}

template <typename T>
__global__ void diff_norms(const T* a, const T* ref, size_t n, double* out) {
  double num = 0, den = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double x = to_d(a[i]), y = to_d(ref[i]);
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

template <typename T>
double rel_err(const T* a, const T* ref, size_t n) {
  double* d;
  BENCH_CHECK_CUDA(cudaMalloc(&d, 2 * sizeof(double)));
  BENCH_CHECK_CUDA(cudaMemset(d, 0, 2 * sizeof(double)));
  diff_norms<<<1024, 256>>>(a, ref, n, d);
  BENCH_CHECK_CUDA(cudaGetLastError());
  double h[2];
  BENCH_CHECK_CUDA(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaFree(d));
  std::printf("  check: ||C - C_cublas||^2 = %.6e, ||C_cublas||^2 = %.6e over %zu values\n", h[0], h[1], n);
  return std::sqrt(h[0] / std::max(h[1], 1e-300));
}

double median_ms(const std::function<void()>& fn, int warmup = 5, int iters = 30) {
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  BENCH_CHECK_CUDA(cudaEventCreate(&a));
  BENCH_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> t(iters);
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK_CUDA(cudaEventRecord(a));
    fn();
    BENCH_CHECK_CUDA(cudaEventRecord(b));
    BENCH_CHECK_CUDA(cudaEventSynchronize(b));
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&t[i], a, b));
  }
  BENCH_CHECK_CUDA(cudaGetLastError());
  BENCH_CHECK_CUDA(cudaEventDestroy(a));
  BENCH_CHECK_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[iters / 2];
}

std::vector<int32_t> offsets_of(const std::vector<int>& sizes) {
  std::vector<int32_t> off(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) off[i + 1] = off[i] + sizes[i];
  return off;
}

std::vector<int> skewed_sizes(int E, int mean) {
  std::vector<int> s(E, 0);
  const int total = E * mean;
  s[0] = 4 * mean;          // one expert with 4x the mean
  const int empty = E / 4;  // a quarter empty: the last E/4
  const int rest = E - 1 - empty;
  int left = total - s[0];
  for (int e = 1; e <= rest; ++e) {
    s[e] = (e == rest) ? left : left / (rest - e + 1);
    left -= s[e];
  }
  return s;
}

std::map<std::string, double> read_torch_csv(const char* path) {
  std::map<std::string, double> m;  // key "form,N,K,groups" -> ms
  if (path == nullptr) return m;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::stringstream ss(line);
    std::string form, n, k, groups, ms;
    if (!std::getline(ss, form, ',') || !std::getline(ss, n, ',') || !std::getline(ss, k, ',') ||
        !std::getline(ss, groups, ',') || !std::getline(ss, ms, ','))
      continue;
    m[form + "," + n + "," + k + "," + groups] = std::atof(ms.c_str());
  }
  return m;
}

// Launch shapes of the engine compared in the same run (the main table uses the default tuning).
// gather: A rows read through an index (identity here, so the output must still equal cuBLAS's), the path
// of the layer's GEMMs that read a receive buffer; row_pointers: C rows stored through per-row addresses
// (again the identity), the path of the GEMMs that send rows home.
struct Variant {
  const char* name;
  GemmTuning tuning;
  bool gather = false;
  bool row_pointers = false;
};
GemmTuning tuning_of(int cluster, megamoe::kernels::GemmStoreMode store, int tile_n = 0) {
  GemmTuning t;
  t.cluster_size = cluster;
  t.store = store;
  t.tile_n = tile_n;
  return t;
}
std::vector<Variant> variants(bool with_row_pointers = false) {
  using megamoe::kernels::GemmStoreMode;
  std::vector<Variant> v = {{"threads", tuning_of(1, GemmStoreMode::kThreads)},
                            {"tma tile", tuning_of(1, GemmStoreMode::kTmaTile)},
                            {"c2 threads", tuning_of(2, GemmStoreMode::kThreads)},
                            {"c2 tma tile", tuning_of(2, GemmStoreMode::kTmaTile)},
                            {"n128 tma tile", tuning_of(1, GemmStoreMode::kTmaTile, 128)},
                            {"gathered A", tuning_of(1, GemmStoreMode::kDefault), true}};
  if (with_row_pointers) v.push_back({"row pointers", tuning_of(1, GemmStoreMode::kDefault), false, true});
  return v;
}

// Medians of several launch variants measured interleaved: round after round every variant runs
// `per_round` single timed launches, the first variant of a round rotating. Back-to-back medians of the
// very same kernel differed by up to 20% in run 8 (the clock/power state drifts from one measurement to the
// next); interleaving exposes every variant to the same drift, so their ratios are fair.
std::vector<double> interleaved_median_ms(const std::vector<std::function<void()>>& fns, int rounds = 20,
                                          int per_round = 3) {
  const size_t n = fns.size();
  for (const auto& f : fns) {
    f();
    f();
  }
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  BENCH_CHECK_CUDA(cudaEventCreate(&a));
  BENCH_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<std::vector<float>> t(n);
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i) {
      const size_t v = (i + static_cast<size_t>(r)) % n;
      for (int k = 0; k < per_round; ++k) {
        float ms = 0;
        BENCH_CHECK_CUDA(cudaEventRecord(a));
        fns[v]();
        BENCH_CHECK_CUDA(cudaEventRecord(b));
        BENCH_CHECK_CUDA(cudaEventSynchronize(b));
        BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
        t[v].push_back(ms);
      }
    }
  }
  BENCH_CHECK_CUDA(cudaGetLastError());
  BENCH_CHECK_CUDA(cudaEventDestroy(a));
  BENCH_CHECK_CUDA(cudaEventDestroy(b));
  std::vector<double> med(n);
  for (size_t v = 0; v < n; ++v) {
    std::sort(t[v].begin(), t[v].end());
    med[v] = t[v][t[v].size() / 2];
  }
  return med;
}

struct Comparison {
  std::string what;
  double flops;
  std::vector<std::string> names;
  std::vector<double> ms;
};

// TFLOP/s of every variant and its speed relative to the first (the previous default: threads, cluster 1).
void print_comparisons(const std::vector<Comparison>& cs) {
  std::printf("\nlaunch shapes, interleaved (TFLOP/s, x = speed vs the first column)\n");
  for (const auto& c : cs) {
    std::printf("%-34s", c.what.c_str());
    for (size_t i = 0; i < c.ms.size(); ++i) {
      std::printf(" | %s %6.1f x%.3f", c.names[i].c_str(), c.flops / (c.ms[i] * 1e-3) / 1e12, c.ms[0] / c.ms[i]);
    }
    std::printf("\n");
  }
}

// Every variant runs once into `out` (NaN-poisoned first, so unwritten values show) and is compared with
// `ref` (when given, n values), then all are timed interleaved.
template <typename T>
Comparison compare_variants(const std::string& what, double flops, const std::vector<Variant>& vs, T* out,
                            const T* ref, size_t n, const std::function<void(const Variant&)>& launch) {
  std::vector<std::function<void()>> fns;
  Comparison cmp{what, flops, {}, {}};
  for (const Variant& v : vs) {
    fns.push_back([&launch, v] { launch(v); });
    cmp.names.push_back(v.name);
    if (ref == nullptr) continue;
    BENCH_CHECK_CUDA(cudaMemset(out, 0xFF, n * sizeof(T)));
    fns.back()();
    const double e = rel_err(out, ref, n);
    if (e != 0.0) std::printf("  NOTE: %s, %s differs from cuBLAS: rel err %.3e\n", what.c_str(), v.name, e);
  }
  cmp.ms = interleaved_median_ms(fns);
  return cmp;
}

struct Row {
  std::string what;
  double flops;
  double engine_ms, cublas_ms, torch_ms;
  double err;
};

void print_rows(const std::vector<Row>& rows) {
  std::printf("\n%-50s %9s %8s %9s %8s %9s %8s %7s %7s %9s\n", "case", "engine_ms", "TFLOP/s", "cublas_ms", "TFLOP/s",
              "torch_ms", "TFLOP/s", "x_cubl", "x_torch", "rel_err");
  for (const auto& r : rows) {
    auto tf = [&](double ms) { return ms > 0 ? r.flops / (ms * 1e-3) / 1e12 : 0.0; };
    std::printf("%-50s %9.3f %8.1f %9.3f %8.1f %9.3f %8.1f %7.3f %7.3f %9.2e\n", r.what.c_str(), r.engine_ms,
                tf(r.engine_ms), r.cublas_ms, tf(r.cublas_ms), r.torch_ms, tf(r.torch_ms),
                r.cublas_ms > 0 ? r.cublas_ms / r.engine_ms : 0.0, r.torch_ms > 0 ? r.torch_ms / r.engine_ms : 0.0,
                r.err);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // --baseline PATH: the CSV of benchmarks/bench_gemm_torch.py from the same device session.
  // --profile: only a few single launches (cuBLAS, then the engine's threads and default store modes, on
  // NT (1536, 2048) and (3072, 4096)) for a profiler such as Nsight Compute to look at.
  const char* baseline = nullptr;
  bool profile = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--baseline" && i + 1 < argc) baseline = argv[i + 1];
    if (std::string(argv[i]) == "--profile") profile = true;
  }
  const auto torch = read_torch_csv(baseline);
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cublasHandle_t h;
  CB(cublasCreate(&h));
  const float one = 1.0f, zero = 0.0f;

  const int E = 16, rows_per = 8192, T = E * rows_per;
  const int shapes[4][2] = {{1536, 2048}, {2048, 768}, {3072, 4096}, {4096, 1536}};
  size_t max_elems_a = 0, max_elems_b = 0, max_elems_c = 0;
  for (auto& s : shapes) {
    max_elems_a = std::max(max_elems_a, size_t(T) * std::max(s[0], s[1]));
    max_elems_b = std::max(max_elems_b, size_t(E) * s[0] * s[1]);
    max_elems_c = std::max(max_elems_c, size_t(T) * std::max(s[0], s[1]));
  }
  max_elems_a = std::max(max_elems_a, size_t(8192) * 8192);
  bf16 *A, *B, *C, *Cref;
  float *C32, *C32ref;
  int32_t *off_bal, *off_skew, *off_dense;
  int* work_counter;  // dynamic scheduling (GemmTuning::work_counter)
  BENCH_CHECK_CUDA(cudaMalloc(&work_counter, sizeof(int)));
  BENCH_CHECK_CUDA(cudaMemset(work_counter, 0, sizeof(int)));  // once: every launch leaves it zero
  // Identity gather index and C row pointers (rebuilt for each output width by row_pointers_for).
  int32_t* identity_rows;
  void** c_rows;
  BENCH_CHECK_CUDA(cudaMalloc(&identity_rows, sizeof(int32_t) * T));
  BENCH_CHECK_CUDA(cudaMalloc(&c_rows, sizeof(void*) * T));
  {
    std::vector<int32_t> id(T);
    for (int i = 0; i < T; ++i) id[i] = i;
    BENCH_CHECK_CUDA(cudaMemcpy(identity_rows, id.data(), sizeof(int32_t) * T, cudaMemcpyHostToDevice));
  }
  auto row_pointers_for = [&](bf16* out, int width, int rows) {
    std::vector<void*> ptr(rows);
    for (int i = 0; i < rows; ++i) ptr[i] = out + int64_t(i) * width;
    BENCH_CHECK_CUDA(cudaMemcpy(c_rows, ptr.data(), sizeof(void*) * rows, cudaMemcpyHostToDevice));
  };
  // A launch of one variant: its tuning, and the identity gather / row pointers when it asks for them.
  auto gather_of = [&](const Variant& v, int64_t rows) {
    megamoe::kernels::GemmGather g;
    if (v.gather) {
      g.a_rows = identity_rows;
      g.a_source_rows = rows;
    }
    return g;
  };
  auto epilogue_of = [&](const Variant& v, GemmEpilogue e) {
    if (v.row_pointers) e.row_pointers = c_rows;
    return e;
  };
  BENCH_CHECK_CUDA(cudaMalloc(&A, max_elems_a * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&B, std::max(max_elems_b, size_t(T) * 4096) * 2));  // form 3 uses B as [T, N]
  BENCH_CHECK_CUDA(cudaMalloc(&C, max_elems_c * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&Cref, max_elems_c * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&C32, size_t(E) * 4096 * 4096 * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&C32ref, size_t(E) * 4096 * 4096 * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&off_bal, (E + 1) * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&off_skew, (E + 1) * 4));
  BENCH_CHECK_CUDA(cudaMalloc(&off_dense, 2 * 4));
  fill_random<<<4096, 256>>>(A, max_elems_a, 1, 1.0f);
  fill_random<<<4096, 256>>>(B, std::max(max_elems_b, size_t(T) * 4096), 2, 1.0f);
  BENCH_CHECK_CUDA(cudaGetLastError());
  const auto ob = offsets_of(std::vector<int>(E, rows_per));
  const auto skew = skewed_sizes(E, rows_per);
  const auto os = offsets_of(skew);
  const int32_t od[2] = {0, 8192};
  BENCH_CHECK_CUDA(cudaMemcpy(off_bal, ob.data(), ob.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK_CUDA(cudaMemcpy(off_skew, os.data(), os.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK_CUDA(cudaMemcpy(off_dense, od, sizeof(od), cudaMemcpyHostToDevice));
  if (profile) {
    for (int s : {0, 2}) {
      const int N = shapes[s][0], K = shapes[s][1];
      CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, rows_per, K, &one, B, CUDA_R_16BF, K,
                                    int64_t(N) * K, A, CUDA_R_16BF, K, int64_t(rows_per) * K, &zero, Cref, CUDA_R_16BF,
                                    N, int64_t(rows_per) * N, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      for (auto mode : {megamoe::kernels::GemmStoreMode::kThreads, megamoe::kernels::GemmStoreMode::kDefault}) {
        BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nt(A, B, C, off_bal, E, T, N, K, GemmEpilogue{}, nullptr,
                                                         tuning_of(1, mode)));
      }
      std::printf("profile: NT N=%d K=%d: cuBLAS, engine threads, engine default: rel err %.3e\n", N, K,
                  rel_err(C, Cref, size_t(T) * N));
    }
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    CB(cublasDestroy(h));
    return 0;
  }
  std::printf("skewed sizes:");
  for (int s : skew) std::printf(" %d", s);
  std::printf(" (total %d)\n", os[E]);

  std::vector<Row> rows;
  std::vector<Comparison> comparisons;
  auto torch_ms = [&](const char* form, int n, int k, const char* groups) {
    auto it = torch.find(std::string(form) + "," + std::to_string(n) + "," + std::to_string(k) + "," + groups);
    return it == torch.end() ? 0.0 : it->second;
  };

  for (auto& s : shapes) {
    const int N = s[0], K = s[1];
    const double flops = 2.0 * T * double(N) * K;
    char name[128];
    // ---- form 1: C[T, N] = A[T, K] . B[e][N, K]^T
    auto cublas_nt = [&] {
      CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, rows_per, K, &one, B, CUDA_R_16BF, K,
                                    int64_t(N) * K, A, CUDA_R_16BF, K, int64_t(rows_per) * K, &zero, Cref, CUDA_R_16BF,
                                    N, int64_t(rows_per) * N, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    auto eng_nt = [&](const int32_t* off) {
      BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nt(A, B, C, off, E, T, N, K, GemmEpilogue{}, nullptr));
    };
    const double t_cub = median_ms(cublas_nt);
    const double t_eng = median_ms([&] { eng_nt(off_bal); });
    const double err = rel_err(C, Cref, size_t(T) * N);
    std::snprintf(name, sizeof(name), "fwd NT  N=%d K=%d balanced", N, K);
    rows.push_back({name, flops, t_eng, t_cub, torch_ms("nt", N, K, "balanced"), err});
    const double t_skew = median_ms([&] { eng_nt(off_skew); });
    std::snprintf(name, sizeof(name), "fwd NT  N=%d K=%d skewed", N, K);
    rows.push_back({name, flops, t_skew, 0, torch_ms("nt", N, K, "skewed"), 0});
    // Every launch shape, interleaved; each one's output checked against cuBLAS first.
    std::snprintf(name, sizeof(name), "fwd NT  N=%d K=%d", N, K);
    row_pointers_for(C, N, T);
    comparisons.push_back(
        compare_variants<bf16>(name, flops, variants(true), C, Cref, size_t(T) * N, [&](const Variant& v) {
          BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nt(A, B, C, off_bal, E, T, N, K, epilogue_of(v, {}), nullptr,
                                                           v.tuning, gather_of(v, T)));
        }));

    // ---- form 1 + SwiGLU (N = 2I: gate rows, then up rows), a written N/2 wide
    {
      GemmEpilogue epi;
      epi.activation = GemmActivation::kSwiGLU;
      const double t =
          median_ms([&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nt(A, B, C, off_bal, E, T, N, K, epi, nullptr)); });
      std::snprintf(name, sizeof(name), "fwd NT+SwiGLU N=%d K=%d", N, K);
      rows.push_back({name, flops, t, 0, 0, 0});
      // No cuBLAS reference for the fused activation: timing only (correctness is in the GPU tests).
      comparisons.push_back(compare_variants<bf16>(name, flops, variants(), C, nullptr, 0, [&](const Variant& v) {
        BENCH_CHECK_OK(
            megamoe::kernels::grouped_gemm_nt(A, B, C, off_bal, E, T, N, K, epi, nullptr, v.tuning, gather_of(v, T)));
      }));
    }

    // ---- form 2: C[T, N] = A[T, K] . B[e][K, N]
    auto cublas_nn = [&] {
      CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, rows_per, K, &one, B, CUDA_R_16BF, N,
                                    int64_t(N) * K, A, CUDA_R_16BF, K, int64_t(rows_per) * K, &zero, Cref, CUDA_R_16BF,
                                    N, int64_t(rows_per) * N, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    {
      const double tc = median_ms(cublas_nn);
      const double te = median_ms(
          [&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nn(A, B, C, off_bal, E, T, N, K, GemmEpilogue{}, nullptr)); });
      const double e2 = rel_err(C, Cref, size_t(T) * N);
      std::snprintf(name, sizeof(name), "dgrad NN N=%d K=%d balanced", N, K);
      rows.push_back({name, flops, te, tc, torch_ms("nn", N, K, "balanced"), e2});
      std::snprintf(name, sizeof(name), "dgrad NN N=%d K=%d", N, K);
      comparisons.push_back(
          compare_variants<bf16>(name, flops, variants(true), C, Cref, size_t(T) * N, [&](const Variant& v) {
            BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nn(A, B, C, off_bal, E, T, N, K, epilogue_of(v, {}), nullptr,
                                                             v.tuning, gather_of(v, T)));
          }));
    }

    // ---- form 3: C[e][N, K] = A[rows_e, N]^T . B[rows_e, K]  (fp32 out; M = N, N = K)
    {
      const int Mw = N, Nw = K;
      auto cublas_tn = [&] {
        CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, Nw, Mw, rows_per, &one, B, CUDA_R_16BF, Nw,
                                      int64_t(rows_per) * Nw, A, CUDA_R_16BF, Mw, int64_t(rows_per) * Mw, &zero, C32ref,
                                      CUDA_R_32F, Nw, int64_t(Mw) * Nw, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      const double tc = median_ms(cublas_tn);
      const double te =
          median_ms([&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_tn(A, B, C32, off_bal, E, T, Mw, Nw, false, nullptr)); });
      const double e3 = rel_err(C32, C32ref, size_t(E) * Mw * Nw);
      std::snprintf(name, sizeof(name), "wgrad TN M=%d N=%d balanced", Mw, Nw);
      rows.push_back({name, flops, te, tc, torch_ms("tn", N, K, "balanced"), e3});
      const double ts =
          median_ms([&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_tn(A, B, C32, off_skew, E, T, Mw, Nw, false, nullptr)); });
      std::snprintf(name, sizeof(name), "wgrad TN M=%d N=%d skewed", Mw, Nw);
      rows.push_back({name, flops, ts, 0, torch_ms("tn", N, K, "skewed"), 0});
      GemmTuning dynamic;
      dynamic.work_counter = work_counter;
      const double tsd = median_ms(
          [&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_tn(A, B, C32, off_skew, E, T, Mw, Nw, false, nullptr, dynamic)); });
      std::snprintf(name, sizeof(name), "wgrad TN M=%d N=%d skewed, dynamic", Mw, Nw);
      rows.push_back({name, flops, tsd, 0, torch_ms("tn", N, K, "skewed"), 0});
      std::snprintf(name, sizeof(name), "wgrad TN M=%d N=%d", Mw, Nw);
      GemmTuning dynamic128 = dynamic;
      dynamic128.tile_n = 128;
      const std::vector<Variant> tn_variants = {{"cluster 1", GemmTuning{}},
                                                {"cluster 2", tuning_of(2, megamoe::kernels::GemmStoreMode::kDefault)},
                                                {"dynamic", dynamic},
                                                {"dynamic n128", dynamic128},
                                                {"dynamic gathered A+B", dynamic, true}};
      comparisons.push_back(
          compare_variants<float>(name, flops, tn_variants, C32, C32ref, size_t(E) * Mw * Nw, [&](const Variant& v) {
            megamoe::kernels::GemmGather g = gather_of(v, T);
            if (v.gather) {
              g.b_rows = identity_rows;
              g.b_source_rows = T;
            }
            BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_tn(A, B, C32, off_bal, E, T, Mw, Nw, false, nullptr, v.tuning, g));
          }));
      const double ta =
          median_ms([&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_tn(A, B, C32, off_bal, E, T, Mw, Nw, true, nullptr)); });
      std::snprintf(name, sizeof(name), "wgrad TN M=%d N=%d accumulate", Mw, Nw);
      rows.push_back({name, flops, ta, 0, 0, 0});
    }
  }

  // ---- dense 8192^3 through the same engine (one group)
  {
    const int n = 8192;
    const double flops = 2.0 * n * double(n) * n;
    auto cub = [&] {
      CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF, n, &zero, Cref,
                      CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double tc = median_ms(cub);
    const double te = median_ms(
        [&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nt(A, B, C, off_dense, 1, n, n, n, GemmEpilogue{}, nullptr)); });
    const double err = rel_err(C, Cref, size_t(n) * n);
    rows.push_back({"dense NT 8192^3", flops, te, tc, torch_ms("dense", n, n, "1"), err});
    comparisons.push_back(
        compare_variants<bf16>("dense NT 8192^3", flops, variants(), C, Cref, size_t(n) * n, [&](const Variant& v) {
          BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nt(A, B, C, off_dense, 1, n, n, n, GemmEpilogue{}, nullptr,
                                                           v.tuning, gather_of(v, n)));
        }));
    // The same product through forms 2 and 3 (B N-major; both operands MN-major, fp32 out).
    auto cub_nn = [&] {
      CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF, n, &zero, Cref,
                      CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double tc2 = median_ms(cub_nn);
    const double te2 = median_ms(
        [&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_nn(A, B, C, off_dense, 1, n, n, n, GemmEpilogue{}, nullptr)); });
    const double err2 = rel_err(C, Cref, size_t(n) * n);
    rows.push_back({"dense NN 8192^3", flops, te2, tc2, 0, err2});
    auto cub_tn = [&] {
      CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, n, n, n, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF, n, &zero, C32ref,
                      CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double tc3 = median_ms(cub_tn);
    const double te3 =
        median_ms([&] { BENCH_CHECK_OK(megamoe::kernels::grouped_gemm_tn(A, B, C32, off_dense, 1, n, n, n, false, nullptr)); });
    const double err3 = rel_err(C32, C32ref, size_t(n) * n);
    rows.push_back({"dense TN 8192^3 (fp32 out)", flops, te3, tc3, 0, err3});
  }
  print_rows(rows);
  print_comparisons(comparisons);
  CB(cublasDestroy(h));
  return 0;
}
