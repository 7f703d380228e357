// Times the expert-parallel layer (R = 1, T = 16384, 16 local experts, top-8, the benchmark configuration of
// docs/MODEL.md):
// forward and forward+backward, median of many runs with CUDA events, two input sets alternating.
// The PyTorch baseline of the same configs (benchmarks/bench_layer_torch.py) runs just before in the same
// gpu-check call; its CSV, given with --baseline, is printed next to ours with the ratios.
//   bench_layer [--out PATH.json] [--baseline PATH.csv] [--iters N]
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "kernels/hashed_fill.hpp"
#include "megamoe/layer.hpp"
#if MEGAMOE_BENCH_CUPTI
#include "kernel_profile.hpp"
#endif

namespace {

template <typename T>
T* device_alloc(int64_t count) {
  T* p = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&p, sizeof(T) * std::max<int64_t>(count, 1)));
  return p;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  int64_t hidden, intermediate;
  float forward_ms, total_ms;
  double forward_tflops, total_tflops;
  double gemm_ms = 0, other_ms = 0;  // kernel time per forward + backward, from the profile
  int kernels = 0;                   // kernels per forward + backward
};

// The layer's six GEMMs in launch order, with the FLOPs of each for P routed rows.
struct GemmStep {
  const char* name;
  double hi_per_row;  // multiply-adds per routed row, in units of H * I
};
constexpr GemmStep kGemmSteps[6] = {{"GEMM1 x.W13^T + SwiGLU (gathered x)", 2},
                                     {"GEMM2 a.W2^T -> combine slots", 1},
                                     {"dgrad d_out.W2 + SwiGLU bwd + d_topk", 1},
                                     {"dgrad dh.W13 -> combine slots", 2},
                                     {"wgrad dW2 = d_out^T (w a)", 1},
                                     {"wgrad dW13 = dh^T x", 2}};

#if MEGAMOE_BENCH_CUPTI
// Kernel time per forward + backward by kernel, and of each GEMM of the layer, averaged over `iters` runs.
void print_breakdown(const std::function<void(int)>& step, cudaStream_t stream, int iters, double pairs, int64_t H,
                     int64_t I, Result* r) {
  auto& profile = megamoe::bench::KernelProfile::instance();
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!profile.start()) return;
  for (int it = 0; it < iters; ++it) step(it);
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto records = profile.stop();
  std::map<std::string, std::pair<int, double>> by_name;
  std::vector<double> gemm_ms(6, 0.0);
  int gemm_index = 0;
  for (const auto& k : records) {
    auto& e = by_name[k.name];
    e.first += 1;
    e.second += k.ms();
    if (k.name == "grouped_gemm_kernel") gemm_ms[gemm_index++ % 6] += k.ms();
  }
  std::printf("  kernel time per forward + backward (CUPTI, mean of %d):\n", iters);
  std::printf("  %-44s %6s %9s\n", "kernel", "calls", "ms");
  double gemm = 0, other = 0;
  int calls = 0;
  for (const auto& [name, e] : by_name) {
    std::printf("  %-44s %6.1f %9.3f\n", name.c_str(), double(e.first) / iters, e.second / iters);
    (name == "grouped_gemm_kernel" ? gemm : other) += e.second / iters;
    calls += e.first;
  }
  std::printf("  %-44s %6s %9.3f\n  %-44s %6s %9.3f\n  %-44s %6.1f\n", "GEMMs", "", gemm, "everything else", "", other,
              "kernels", double(calls) / iters);
  std::printf("  %-44s %9s %8s\n", "GEMM", "ms", "TFLOP/s");
  for (int g = 0; g < 6; ++g) {
    const double ms = gemm_ms[g] / iters;
    const double flops = 2.0 * pairs * kGemmSteps[g].hi_per_row * static_cast<double>(H) * static_cast<double>(I);
    std::printf("  %-44s %9.3f %8.1f\n", kGemmSteps[g].name, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0);
  }
  r->gemm_ms = gemm;
  r->other_ms = other;
  r->kernels = calls / iters;
}
#endif

Result run(int64_t H, int64_t I, int iters) {
  megamoe::LayerConfig c;
  c.hidden = H;
  c.intermediate = I;
  c.num_experts = 16;
  c.top_k = 8;
  c.num_ranks = 1;
  c.max_tokens_per_rank = 16384;
  const int64_t T = c.max_tokens_per_rank, K = c.top_k, E = c.num_experts;
  std::unique_ptr<megamoe::VirtualRankGroup> group;
  BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c, megamoe::LayerOptions{}, &group));
  cudaStream_t stream = group->stream(0);

  constexpr int kSets = 2;  // alternate two token sets so x and d_out are not L2-resident between runs
  __nv_bfloat16 *x[kSets], *d_out[kSets];
  int64_t* idx[kSets];
  float* weights[kSets];
  std::mt19937_64 rng(1234);
  for (int s = 0; s < kSets; ++s) {
    x[s] = device_alloc<__nv_bfloat16>(T * H);
    d_out[s] = device_alloc<__nv_bfloat16>(T * H);
    if (!megamoe::kernels::fill_hashed_bf16(x[s], T * H, 10 + s, 0, 1.0f) ||
        !megamoe::kernels::fill_hashed_bf16(d_out[s], T * H, 20 + s, 0, 1.0f))
      std::exit(1);
    std::vector<int64_t> h_idx(T * K);
    std::vector<float> h_w(T * K);
    std::vector<int64_t> experts(E);
    for (int64_t e = 0; e < E; ++e) experts[e] = e;
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int64_t j = 0; j < K; ++j) {
        h_idx[t * K + j] = experts[j];
        h_w[t * K + j] = 1.0f / static_cast<float>(K);
      }
    }
    idx[s] = device_alloc<int64_t>(T * K);
    weights[s] = device_alloc<float>(T * K);
    BENCH_CHECK_CUDA(cudaMemcpy(idx[s], h_idx.data(), 8 * T * K, cudaMemcpyHostToDevice));
    BENCH_CHECK_CUDA(cudaMemcpy(weights[s], h_w.data(), 4 * T * K, cudaMemcpyHostToDevice));
  }
  auto* w13 = device_alloc<__nv_bfloat16>(E * 2 * I * H);
  auto* w2 = device_alloc<__nv_bfloat16>(E * H * I);
  if (!megamoe::kernels::fill_hashed_bf16(w13, E * 2 * I * H, 30, 0, 0.03f) ||
      !megamoe::kernels::fill_hashed_bf16(w2, E * H * I, 31, 0, 0.03f))
    std::exit(1);
  auto* out = device_alloc<__nv_bfloat16>(T * H);
  auto* d_x = device_alloc<__nv_bfloat16>(T * H);
  auto* d_weights = device_alloc<float>(T * K);
  auto* d_w13 = device_alloc<float>(E * 2 * I * H);
  auto* d_w2 = device_alloc<float>(E * H * I);
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());

  auto forward = [&](int s) {
    megamoe::ForwardArgs f;
    f.num_tokens = T;
    f.x = x[s];
    f.topk_idx = idx[s];
    f.topk_weights = weights[s];
    f.w13 = w13;
    f.w2 = w2;
    f.out = out;
    BENCH_CHECK_OK(group->layer(0).forward(f));
  };
  auto backward = [&](int s) {
    megamoe::BackwardArgs b;
    b.d_out = d_out[s];
    b.d_x = d_x;
    b.d_topk_weights = d_weights;
    b.d_w13 = d_w13;
    b.d_w2 = d_w2;
    BENCH_CHECK_OK(group->layer(0).backward(b));
  };
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> fwd, total;
  for (int it = -3; it < iters; ++it) {
    const int s = (it + 3) % kSets;
    float ms = 0;
    BENCH_CHECK_CUDA(cudaEventRecord(start, stream));
    forward(s);
    BENCH_CHECK_CUDA(cudaEventRecord(stop, stream));
    BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (it >= 0) fwd.push_back(ms);
    BENCH_CHECK_CUDA(cudaEventRecord(start, stream));
    forward(s);
    backward(s);
    BENCH_CHECK_CUDA(cudaEventRecord(stop, stream));
    BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (it >= 0) total.push_back(ms);
  }
  BENCH_CHECK_OK(group->synchronize_and_check());
  Result r{H, I, median(fwd), median(total), 0, 0};
#if MEGAMOE_BENCH_CUPTI
  print_breakdown(
      [&](int it) {
        forward(it % kSets);
        backward(it % kSets);
      },
      stream, 10, static_cast<double>(T * K), H, I, &r);
  BENCH_CHECK_OK(group->synchronize_and_check());
#endif
  const double pairs = static_cast<double>(T * K);
  r.forward_tflops = c.forward_flops(static_cast<int64_t>(pairs)) / (r.forward_ms * 1e-3) / 1e12;
  r.total_tflops = (c.forward_flops(static_cast<int64_t>(pairs)) + c.backward_flops(static_cast<int64_t>(pairs))) /
                   (r.total_ms * 1e-3) / 1e12;
  for (int s = 0; s < kSets; ++s) {
    cudaFree(x[s]);
    cudaFree(d_out[s]);
    cudaFree(idx[s]);
    cudaFree(weights[s]);
  }
  cudaFree(w13);
  cudaFree(w2);
  cudaFree(out);
  cudaFree(d_x);
  cudaFree(d_weights);
  cudaFree(d_w13);
  cudaFree(d_w2);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  const char* baseline_path = nullptr;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--baseline") && i + 1 < argc) baseline_path = argv[++i];
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_layer: no CUDA device, nothing to time\n");
    return 0;
  }
  std::vector<Result> results;
  for (auto [H, I] : {std::pair<int64_t, int64_t>{2048, 768}, {4096, 1536}}) {
    std::printf("bench_layer: H=%lld I=%lld E=16 K=8 T=16384 R=1 ...\n", static_cast<long long>(H),
                static_cast<long long>(I));
    std::fflush(stdout);
    results.push_back(run(H, I, iters));
  }
  // Baseline rows "hidden,intermediate,forward_ms,total_ms" from bench_layer_torch.py.
  std::vector<std::array<double, 4>> baseline;
  if (baseline_path != nullptr) {
    if (FILE* f = std::fopen(baseline_path, "r")) {
      std::array<double, 4> row{};
      while (std::fscanf(f, "%lf,%lf,%lf,%lf", &row[0], &row[1], &row[2], &row[3]) == 4) baseline.push_back(row);
      std::fclose(f);
    }
  }
  std::printf("| layer H, I (bf16) | megamoe fwd ms | TFLOP/s | torch fwd ms | fwd speedup | megamoe fwd+bwd ms | "
              "TFLOP/s | torch fwd+bwd ms | fwd+bwd speedup |\n");
  for (const Result& r : results) {
    double torch_fwd = 0, torch_total = 0;
    for (const auto& b : baseline)
      if (static_cast<int64_t>(b[0]) == r.hidden && static_cast<int64_t>(b[1]) == r.intermediate)
        torch_fwd = b[2], torch_total = b[3];
    std::printf("| %lld, %lld | %.3f | %.1f | %.3f | %.2fx | %.3f | %.1f | %.3f | %.2fx |\n",
                static_cast<long long>(r.hidden), static_cast<long long>(r.intermediate), r.forward_ms,
                r.forward_tflops, torch_fwd, torch_fwd > 0 ? torch_fwd / r.forward_ms : 0.0, r.total_ms,
                r.total_tflops, torch_total, torch_total > 0 ? torch_total / r.total_ms : 0.0);
  }
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) return 1;
    std::fprintf(f, "[");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "%s{\"hidden\": %lld, \"intermediate\": %lld, \"forward_ms\": %.4f, \"total_ms\": %.4f, "
                   "\"forward_tflops\": %.2f, \"total_tflops\": %.2f, \"gemm_kernel_ms\": %.4f, "
                   "\"other_kernel_ms\": %.4f, \"kernels\": %d}",
                   i ? ", " : "", static_cast<long long>(r.hidden), static_cast<long long>(r.intermediate),
                   r.forward_ms, r.total_ms, r.forward_tflops, r.total_tflops, r.gemm_ms, r.other_ms, r.kernels);
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
