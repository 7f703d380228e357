// Times the expert-parallel layer (R = 1, T = 16384, 16 local experts, top-8, the benchmark configuration of
// docs/MODEL.md):
// forward and forward+backward, median of many runs with CUDA events, two input sets alternating; the
// modular path, the fused forward with the modular backward, both fused (LayerOptions::forward_path,
// backward_path), both fused with the backward recomputing h (recompute_h) and the blockwise FP8 forward
// (with its distance to the bf16 output) timed interleaved, run for run; and the cost
// of expert parallelism: E = 128 on 8 virtual ranks of 2048 tokens each against the same problem on one
// rank (E = 128, T = 16384), both paths.
// The PyTorch baseline of the same configs (benchmarks/bench_layer_torch.py) runs just before in the same
// gpu-check call; its CSV, given with --baseline, is printed next to ours with the ratios.
//   bench_layer [--out PATH.json] [--baseline PATH.csv] [--iters N] [--no-ep] [--fp8] [--bf16-grads]
// --no-ep leaves out the expert-parallel comparison; --fp8 times only the blockwise FP8 layer against the bf16
// modular one (no fused kernels, no settings that earlier runs settled), for a short device call.
// --bf16-grads: the weight gradients in bf16 (BackwardArgs::d_w13_bf16, d_w2_bf16, what the Python layer asks
// for by default), instead of fp32.
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench_check.hpp"
#include "kernels/hashed_fill.hpp"
#include "megamoe/device.hpp"
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

// The process-wide dependent-launch switch (megamoe/device.hpp) held at one value for a scope.
class DependentLaunchAs {
 public:
  explicit DependentLaunchAs(bool on) : saved_(megamoe::dependent_launch_enabled()) {
    megamoe::set_dependent_launch(on);
  }
  ~DependentLaunchAs() { megamoe::set_dependent_launch(saved_); }
  DependentLaunchAs(const DependentLaunchAs&) = delete;
  DependentLaunchAs& operator=(const DependentLaunchAs&) = delete;

 private:
  bool saved_;
};

constexpr std::array<int, 4> kWaveLags = {1, 2, 4, 16};  // 16: every first-GEMM item first (16 experts)

struct Result {
  int64_t hidden, intermediate;
  float forward_ms, total_ms;
  double forward_tflops, total_tflops;
  float fused_forward_ms = 0, fused_total_ms = 0;  // fused forward and backward, timed interleaved with the above
  float fused_forward_modular_backward_ms = 0;      // the fused forward, the modular backward
  float fused_recompute_total_ms = 0;               // both fused, the backward recomputing h (recompute_h)
  float fp8_forward_ms = 0;                         // the blockwise FP8 forward (modular), interleaved too
  float fp8_total_ms = -1;                          // its forward + backward (-1: the FP8 backward failed)
  float fp8_bf16_total_ms = 0;                      // the bf16 modular forward + backward run for run with it
  double fp8_out_distance = 0;                      // ||out_fp8 - out_bf16|| / ||out_bf16|| on the same inputs
  // Both fused kernels under each wave lag of kWaveLags (ExpertParallelLayer::set_fused_wave_lag), interleaved.
  std::array<float, 4> lag_forward_ms{}, lag_total_ms{};
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
// Kernel time per forward + backward by kernel, and of each GEMM launch of the layer, averaged over `iters`
// runs. [first_gemm, end_gemm): the steps of kGemmSteps that are launches of their own (from 2 with the fused
// forward, whose two GEMMs run inside its kernel; up to 2 for a forward alone). A GEMM launch is one of the
// engine's or of the FP8 GEMM.
bool is_gemm_kernel(const std::string& name) {
  return name.rfind("grouped_gemm_kernel", 0) == 0 || name.rfind("fp8_gemm_kernel", 0) == 0 ||
         name.rfind("fp8_wgrad_kernel", 0) == 0;
}

void print_breakdown(const std::function<void(int)>& step, cudaStream_t stream, int iters, double pairs, int64_t H,
                     int64_t I, Result* r, int first_gemm = 0, const char* per = "forward + backward",
                     int end_gemm = 6) {
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
    if (is_gemm_kernel(k.name) && first_gemm < end_gemm)
      gemm_ms[first_gemm + gemm_index++ % (end_gemm - first_gemm)] += k.ms();
  }
  std::printf("  kernel time per %s (CUPTI, mean of %d):\n", per, iters);
  std::printf("  %-44s %6s %9s\n", "kernel", "calls", "ms");
  double gemm = 0, other = 0;
  int calls = 0;
  for (const auto& [name, e] : by_name) {
    std::printf("  %-44s %6.1f %9.3f\n", name.c_str(), double(e.first) / iters, e.second / iters);
    (is_gemm_kernel(name) ? gemm : other) += e.second / iters;
    calls += e.first;
  }
  std::printf("  %-44s %6s %9.3f\n  %-44s %6s %9.3f\n  %-44s %6.1f\n", "GEMMs", "", gemm, "everything else", "", other,
              "kernels", double(calls) / iters);
  // Where the GPU idles between kernels (the steps run back to back here, so the host is not what it waits
  // for): each gap from the latest end so far to the next start, by the pair of kernels around it.
  if (!records.empty()) {
    std::map<std::string, std::pair<int, double>> gaps;
    uint64_t covered = records.front().end_ns;
    std::string last = records.front().name;
    double idle_ms = 0;
    int count = 0;
    // Gaps of 20 us and more one by one (kernel index, length): a gap that recurs every step differs from one
    // that a single step takes.
    std::string long_gaps;
    for (size_t i = 1; i < records.size(); ++i) {
      const auto& k = records[i];
      if (k.start_ns > covered) {
        const double ms = static_cast<double>(k.start_ns - covered) * 1e-6;
        if (ms >= 0.02 && long_gaps.size() < 400)
          long_gaps += " " + std::to_string(i) + ":" + std::to_string(static_cast<int>(ms * 1e3)) + "us";
        auto& g = gaps[last + " -> " + k.name];
        g.first += 1;
        g.second += ms;
        idle_ms += ms;
        ++count;
      }
      if (k.end_ns >= covered) {
        covered = k.end_ns;
        last = k.name;
      }
    }
    const double span_ms = static_cast<double>(covered - records.front().start_ns) * 1e-6;
    std::printf("  kernels' span %.3f ms per %s, of which idle between kernels %.3f ms (%.1f gaps, %.1f us each)\n",
                span_ms / iters, per, idle_ms / iters, double(count) / iters, count > 0 ? idle_ms / count * 1e3 : 0.0);
    if (!long_gaps.empty()) std::printf("    gaps of 20 us and more (kernel index: length):%s\n", long_gaps.c_str());
    // For the first such gap: when the host called the launch of the kernel after it, relative to the gap's
    // start (late: the host; early: the GPU), and the runtime calls of 10 us or more that overlap the gap.
    // (Recording the runtime calls also took away the gap of milliseconds that the kernel records alone found
    // after each profile's first kernel, docs/PERF.md runs 133-139.)
    const auto& apis = profile.api_records();
    uint64_t end_before = records.front().end_ns;
    for (size_t i = 1; i < records.size(); ++i) {
      const auto& k = records[i];
      if (k.start_ns > end_before && k.start_ns - end_before >= 20000) {
        const int64_t gap0 = static_cast<int64_t>(end_before);
        std::printf("    gap before kernel %zu (%s), %.1f us:\n", i, k.name.c_str(), (k.start_ns - end_before) * 1e-3);
        for (const auto& a : apis) {
          const bool launch = a.correlation == k.correlation;
          const bool overlaps = a.end_ns > end_before && a.start_ns < k.start_ns && a.end_ns - a.start_ns >= 10000;
          if (launch || overlaps)
            std::printf("      %s %s: from %+.1f to %+.1f us of the gap's start\n", launch ? "launch" : "call",
                        a.name.c_str(), (static_cast<int64_t>(a.start_ns) - gap0) * 1e-3,
                        (static_cast<int64_t>(a.end_ns) - gap0) * 1e-3);
        }
        break;
      }
      end_before = std::max(end_before, k.end_ns);
    }
    std::vector<std::pair<double, std::string>> widest;
    for (const auto& [pair, g] : gaps) widest.push_back({g.second / g.first * 1e3, pair});
    std::sort(widest.rbegin(), widest.rend());
    for (size_t i = 0; i < widest.size() && i < 6; ++i)
      std::printf("    gap %6.1f us  %s\n", widest[i].first, widest[i].second.c_str());
  }
  std::printf("  %-44s %9s %8s\n", "GEMM", "ms", "TFLOP/s");
  for (int g = first_gemm; g < end_gemm; ++g) {
    const double ms = gemm_ms[g] / iters;
    const double flops = 2.0 * pairs * kGemmSteps[g].hi_per_row * static_cast<double>(H) * static_cast<double>(I);
    std::printf("  %-44s %9.3f %8.1f\n", kGemmSteps[g].name, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0);
  }
  r->gemm_ms = gemm;
  r->other_ms = other;
  r->kernels = calls / iters;
}
#endif

constexpr int kPhases = 8;  // the timeline's moments; then the producer's gate wait (ns) and items

// Where one fused forward's time goes, from the kernel's own per-CTA stamps (set_fused_timeline): when each
// phase ended (median and last CTA, from the first CTA's entry), and the GEMM window (the first CTA to start
// its GEMM items to the last to finish them) with the forward's GEMM FLOPs over it.
// `call` runs the kernel to look at last (the forward, or a forward then the backward); `names` are its phases.
void print_fused_timeline(megamoe::ExpertParallelLayer& layer, const std::function<void()>& call, cudaStream_t stream,
                          double gemm_flops, const char* what, const char* const* names) {
  constexpr int kStamps = megamoe::ExpertParallelLayer::kFusedTimelineStamps;
  const int ctas = layer.fused_forward_ctas();
  uint64_t* stamps = device_alloc<uint64_t>(int64_t{kStamps} * ctas);
  BENCH_CHECK_OK(layer.set_fused_timeline(stamps));
  call();
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  BENCH_CHECK_OK(layer.set_fused_timeline(nullptr));
  std::vector<uint64_t> t(static_cast<size_t>(kStamps) * ctas);
  BENCH_CHECK_CUDA(cudaMemcpy(t.data(), stamps, t.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  cudaFree(stamps);
  uint64_t t0 = UINT64_MAX;
  for (int c = 0; c < ctas; ++c) t0 = std::min(t0, t[c * kStamps]);
  std::printf("  fused %s timeline (%d CTAs; us from the first entry): phase, median CTA, last CTA\n", what, ctas);
  for (int k = 0; k < kPhases; ++k) {
    std::vector<float> at(ctas);
    for (int c = 0; c < ctas; ++c) at[c] = static_cast<float>(t[c * kStamps + k] - t0) * 1e-3f;
    const float last = *std::max_element(at.begin(), at.end());
    std::printf("  %-28s %9.1f %9.1f\n", names[k], median(at), last);
  }
  uint64_t gemm_begin = UINT64_MAX, gemm_end = 0;
  for (int c = 0; c < ctas; ++c) {
    gemm_begin = std::min(gemm_begin, std::max(t[c * kStamps + 3], t[c * kStamps + 4]));
    gemm_end = std::max(gemm_end, t[c * kStamps + 5]);
  }
  const double window_s = static_cast<double>(gemm_end - gemm_begin) * 1e-9;
  // How much of the GEMM phase the producers spent waiting at readiness gates, and how the items spread.
  std::vector<float> waited(ctas), items(ctas);
  for (int c = 0; c < ctas; ++c) {
    waited[c] = static_cast<float>(t[c * kStamps + kPhases]) * 1e-3f;
    items[c] = static_cast<float>(t[c * kStamps + kPhases + 1]);
  }
  std::printf("  producers at readiness gates: median %.1f us, most %.1f us per CTA; items per CTA: median %.0f, "
              "%.0f .. %.0f\n",
              median(waited), *std::max_element(waited.begin(), waited.end()), median(items),
              *std::min_element(items.begin(), items.end()), *std::max_element(items.begin(), items.end()));
  std::printf("  GEMM window %.1f us: %.1f TFLOP/s of the fused %s's two GEMMs inside the kernel\n", window_s * 1e6,
              window_s > 0 ? gemm_flops / window_s / 1e12 : 0.0, what);
}
constexpr const char* kForwardPhases[kPhases] = {
    "entry", "layout numbered", "dispatch done", "counts in, work numbered",
    "routing done", "GEMM items done", "tokens combined", "end"};
constexpr const char* kBackwardPhases[kPhases] = {
    "entry", "(the forward's layout)", "d_out dispatched", "offsets, work numbered",
    "arrivals counted", "dgrad items done", "d_x combined", "end"};

bool g_fp8_only = false;    // --fp8
bool g_bf16_grads = false;  // --bf16-grads

Result run(int64_t H, int64_t I, int iters) {
  megamoe::LayerConfig c;
  c.hidden = H;
  c.intermediate = I;
  c.num_experts = 16;
  c.top_k = 8;
  c.num_ranks = 1;
  c.max_tokens_per_rank = 16384;
  const int64_t T = c.max_tokens_per_rank, K = c.top_k, E = c.num_experts;
  std::unique_ptr<megamoe::VirtualRankGroup> group, fused_group, half_group, recompute_group;
  BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c, megamoe::LayerOptions{}, &group));
  if (!g_fp8_only) {
    megamoe::LayerOptions fused_options;
    fused_options.forward_path = megamoe::ForwardPath::kFused;
    BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c, fused_options, &half_group));
    fused_options.backward_path = megamoe::BackwardPath::kFused;
    BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c, fused_options, &fused_group));
    fused_options.recompute_h = true;
    BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c, fused_options, &recompute_group));
  }
  std::unique_ptr<megamoe::VirtualRankGroup> fp8_group;  // the blockwise FP8 layer (modular)
  megamoe::LayerConfig c8 = c;
  c8.precision = megamoe::Precision::kFP8Blockwise;
  BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c8, megamoe::LayerOptions{}, &fp8_group));
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
  // The weight gradients in the precision asked for; the other pair stays null.
  float* d_w13 = g_bf16_grads ? nullptr : device_alloc<float>(E * 2 * I * H);
  float* d_w2 = g_bf16_grads ? nullptr : device_alloc<float>(E * H * I);
  __nv_bfloat16* d_w13_bf16 = g_bf16_grads ? device_alloc<__nv_bfloat16>(E * 2 * I * H) : nullptr;
  __nv_bfloat16* d_w2_bf16 = g_bf16_grads ? device_alloc<__nv_bfloat16>(E * H * I) : nullptr;
  BENCH_CHECK_CUDA(cudaDeviceSynchronize());

  auto forward_on = [&](megamoe::VirtualRankGroup& g, int s) {
    megamoe::ForwardArgs f;
    f.num_tokens = T;
    f.x = x[s];
    f.topk_idx = idx[s];
    f.topk_weights = weights[s];
    f.w13 = w13;
    f.w2 = w2;
    f.out = out;
    BENCH_CHECK_OK(g.layer(0).forward(f));
  };
  // The backward's status, for a caller that must survive a failing one (the FP8 timing below).
  auto try_backward_on = [&](megamoe::VirtualRankGroup& g, int s) {
    megamoe::BackwardArgs b;
    b.d_out = d_out[s];
    b.d_x = d_x;
    b.d_topk_weights = d_weights;
    b.d_w13 = d_w13;
    b.d_w2 = d_w2;
    b.d_w13_bf16 = d_w13_bf16;
    b.d_w2_bf16 = d_w2_bf16;
    return g.layer(0).backward(b);
  };
  auto backward_on = [&](megamoe::VirtualRankGroup& g, int s) { BENCH_CHECK_OK(try_backward_on(g, s)); };
  auto step_on = [&](megamoe::VirtualRankGroup& g, int s) {
    forward_on(g, s);
    backward_on(g, s);
  };
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  // One timed region on a group's stream.
  auto timed = [&](megamoe::VirtualRankGroup& g, const std::function<void()>& body) {
    cudaStream_t st = g.stream(0);
    float ms = 0;
    BENCH_CHECK_CUDA(cudaEventRecord(start, st));
    body();
    BENCH_CHECK_CUDA(cudaEventRecord(stop, st));
    BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  };
  // Modular and fused interleaved run for run, so that clock drift falls on both alike.
  std::vector<float> fwd, total, fused_fwd, fused_total, half_total, recompute_total, fp8_fwd;
  for (int it = -3; it < iters; ++it) {
    const int s = (it + 3) % kSets;
    const float f_mod = timed(*group, [&] { forward_on(*group, s); });
    const float f_fp8 = timed(*fp8_group, [&] { forward_on(*fp8_group, s); });
    const float t_mod = timed(*group, [&] { step_on(*group, s); });
    if (g_fp8_only) {
      if (it < 0) continue;
      fwd.push_back(f_mod);
      total.push_back(t_mod);
      fp8_fwd.push_back(f_fp8);
      continue;
    }
    const float f_fus = timed(*fused_group, [&] { forward_on(*fused_group, s); });
    const float t_fus = timed(*fused_group, [&] { step_on(*fused_group, s); });
    const float t_half = timed(*half_group, [&] { step_on(*half_group, s); });
    const float t_rec = timed(*recompute_group, [&] { step_on(*recompute_group, s); });
    if (it < 0) continue;
    fp8_fwd.push_back(f_fp8);
    half_total.push_back(t_half);
    recompute_total.push_back(t_rec);
    fwd.push_back(f_mod);
    fused_fwd.push_back(f_fus);
    total.push_back(t_mod);
    fused_total.push_back(t_fus);
  }
  BENCH_CHECK_OK(group->synchronize_and_check());
  BENCH_CHECK_OK(fp8_group->synchronize_and_check());
  Result r{H, I, median(fwd), median(total), 0, 0};
  r.fp8_forward_ms = median(fp8_fwd);
  if (!g_fp8_only) {
    BENCH_CHECK_OK(fused_group->synchronize_and_check());
    BENCH_CHECK_OK(half_group->synchronize_and_check());
    BENCH_CHECK_OK(recompute_group->synchronize_and_check());
    print_fused_timeline(fused_group->layer(0), [&] { forward_on(*fused_group, 0); }, fused_group->stream(0),
                         c.forward_flops(T * K), "forward", kForwardPhases);
    // dgrad1 (H I per row) and dgrad2 (2 H I per row): 6 H I flops per routed row.
    print_fused_timeline(
        fused_group->layer(0), [&] { step_on(*fused_group, 0); }, fused_group->stream(0),
        6.0 * static_cast<double>(T * K) * static_cast<double>(H * I), "backward", kBackwardPhases);
    BENCH_CHECK_OK(fused_group->synchronize_and_check());
    r.fused_forward_ms = median(fused_fwd);
    r.fused_total_ms = median(fused_total);
    r.fused_forward_modular_backward_ms = median(half_total);
    r.fused_recompute_total_ms = median(recompute_total);
    {
      // The order of the expert waves (issue: is the fused GEMM window's loss in how GEMM1 and GEMM2 items share
      // the L2?): each lag in turn, run for run.
      std::array<std::vector<float>, kWaveLags.size()> lag_fwd, lag_total;
      for (int it = -1; it < iters; ++it) {
        const int s = (it + 1) % kSets;
        for (size_t l = 0; l < kWaveLags.size(); ++l) {
          BENCH_CHECK_OK(fused_group->layer(0).set_fused_wave_lag(kWaveLags[l]));
          const float f = timed(*fused_group, [&] { forward_on(*fused_group, s); });
          const float t = timed(*fused_group, [&] { step_on(*fused_group, s); });
          if (it < 0) continue;
          lag_fwd[l].push_back(f);
          lag_total[l].push_back(t);
        }
      }
      BENCH_CHECK_OK(fused_group->layer(0).set_fused_wave_lag(1));
      BENCH_CHECK_OK(fused_group->synchronize_and_check());
      for (size_t l = 0; l < kWaveLags.size(); ++l) {
        r.lag_forward_ms[l] = median(lag_fwd[l]);
        r.lag_total_ms[l] = median(lag_total[l]);
      }
    }
  }  // !g_fp8_only
  {
    // The FP8 forward + backward after the bf16 modular step, run for run. Its backward is the newest code
    // here: one trial step first, and an error leaves fp8_total_ms at -1 instead of ending the benchmark.
    auto fp8_step = [&](int s) {
      forward_on(*fp8_group, s);
      return try_backward_on(*fp8_group, s);
    };
    const megamoe::Status trial = [&] {
      const megamoe::Status step = fp8_step(0);
      return step.is_ok() ? fp8_group->synchronize_and_check() : step;
    }();
    if (!trial.is_ok()) {
      std::printf("  fp8 forward + backward not timed: %s\n", trial.to_string().c_str());
    } else {
      std::vector<float> bf16_total, fp8_total;
      for (int it = 0; it < iters; ++it) {
        const int s = it % kSets;
        bf16_total.push_back(timed(*group, [&] { step_on(*group, s); }));
        fp8_total.push_back(timed(*fp8_group, [&] { BENCH_CHECK_OK(fp8_step(s)); }));
      }
      BENCH_CHECK_OK(fp8_group->synchronize_and_check());
      r.fp8_total_ms = median(fp8_total);
      r.fp8_bf16_total_ms = median(bf16_total);
      // The FP8 GEMMs' overlapped promotion (ExpertParallelLayer::set_fp8_overlap_promotion): the default (on
      // the GEMMs whose A rows come by TMA) against the plain loops and against it on every FP8 GEMM, step for
      // step.
      using megamoe::Fp8PromotionOverlap;
      std::vector<float> plain_total, default_total, all_total;
      const auto overlap = [&](Fp8PromotionOverlap where) {
        for (int rank = 0; rank < fp8_group->num_ranks(); ++rank) fp8_group->layer(rank).set_fp8_overlap_promotion(where);
      };
      for (int it = 0; it < (g_fp8_only ? 0 : iters); ++it) {
        const int s = it % kSets;
        overlap(Fp8PromotionOverlap::kNone);
        plain_total.push_back(timed(*fp8_group, [&] { BENCH_CHECK_OK(fp8_step(s)); }));
        overlap(Fp8PromotionOverlap::kTmaOperands);
        default_total.push_back(timed(*fp8_group, [&] { BENCH_CHECK_OK(fp8_step(s)); }));
        overlap(Fp8PromotionOverlap::kAll);
        all_total.push_back(timed(*fp8_group, [&] { BENCH_CHECK_OK(fp8_step(s)); }));
      }
      overlap(Fp8PromotionOverlap::kTmaOperands);
      BENCH_CHECK_OK(fp8_group->synchronize_and_check());
      if (!g_fp8_only)
        std::printf("  fp8 forward + backward, overlapped promotion on the TMA-operand GEMMs (default): %.3f ms, on "
                  "none: %.3f (default x %.3f), on all: %.3f (default x %.3f)\n",
                  median(default_total), median(plain_total), median(plain_total) / median(default_total),
                  median(all_total), median(all_total) / median(default_total));
      // The timings above wait for each step, so the GPU idles while the host enqueues the next one's first
      // kernels and between kernels the host enqueues late. Here: the host's time to enqueue a step (median),
      // and back_to_back steps enqueued before one wait (per step), the GPU-bound figure a training loop whose
      // host runs ahead sees. bf16 and FP8 alternate.
      // Then the same steps with the kernels in plain stream order (no dependent launch), step for step.
      // MEGAMOE_BENCH_STEPS_PER_WAIT changes the count (a cost paid once per wait shows as a per-step time that
      // falls with it).
      const char* per_wait = std::getenv("MEGAMOE_BENCH_STEPS_PER_WAIT");
      const int parsed_per_wait = per_wait != nullptr ? std::atoi(per_wait) : 0;
      const int back_to_back = parsed_per_wait > 0 ? parsed_per_wait : 10;
      std::vector<float> bf16_host, fp8_host, bf16_b2b, fp8_b2b, bf16_b2b_plain, fp8_b2b_plain;
      const auto host_ms = [](const std::function<void()>& body) {
        const auto t0 = std::chrono::steady_clock::now();
        body();
        return std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - t0).count();
      };
      const auto bf16_steps = [&](int s) {
        return timed(*group, [&] {
                 for (int k = 0; k < back_to_back; ++k) step_on(*group, (s + k) % kSets);
               }) / back_to_back;
      };
      const auto fp8_steps = [&](int s) {
        return timed(*fp8_group, [&] {
                 for (int k = 0; k < back_to_back; ++k) BENCH_CHECK_OK(fp8_step((s + k) % kSets));
               }) / back_to_back;
      };
      for (int it = 0; it < iters; ++it) {
        const int s = it % kSets;
        float h = 0;
        timed(*group, [&] { h = host_ms([&] { step_on(*group, s); }); });
        bf16_host.push_back(h);
        timed(*fp8_group, [&] { h = host_ms([&] { BENCH_CHECK_OK(fp8_step(s)); }); });
        fp8_host.push_back(h);
        if (!g_fp8_only) {
          const DependentLaunchAs dependent(true);
          bf16_b2b.push_back(bf16_steps(s));
          fp8_b2b.push_back(fp8_steps(s));
        }
        const DependentLaunchAs plain(false);
        bf16_b2b_plain.push_back(bf16_steps(s));
        fp8_b2b_plain.push_back(fp8_steps(s));
      }
      BENCH_CHECK_OK(fp8_group->synchronize_and_check());
      if (g_fp8_only) {
        bf16_b2b = bf16_b2b_plain;  // plain stream order only
        fp8_b2b = fp8_b2b_plain;
      }
      std::printf("  forward + backward, %d steps back to back (per step, median of %d): bf16 %.3f ms, fp8 %.3f ms "
                  "(bf16 / fp8 %.3fx); host time to enqueue one step: bf16 %.3f ms, fp8 %.3f ms\n",
                  back_to_back, iters, median(bf16_b2b), median(fp8_b2b), median(bf16_b2b) / median(fp8_b2b),
                  median(bf16_host), median(fp8_host));
      if (!g_fp8_only)
        std::printf("  the same in plain stream order (dependent launch on above): bf16 %.3f ms (x %.3f of plain), "
                  "fp8 %.3f ms (x %.3f of plain)\n",
                  median(bf16_b2b_plain), median(bf16_b2b) / median(bf16_b2b_plain), median(fp8_b2b_plain),
                  median(fp8_b2b) / median(fp8_b2b_plain));
#if MEGAMOE_BENCH_CUPTI
      // Kernel times in plain stream order: a kernel launched early would count its wait for the one before.
      const DependentLaunchAs plain(false);
      const auto breakdown = [&](const char* setting) {
        std::printf("  fp8 forward + backward%s:\n", setting);
        Result kernels = r;
        print_breakdown([&](int it) { BENCH_CHECK_OK(fp8_step(it % kSets)); }, fp8_group->stream(0), 10,
                        static_cast<double>(T * K), H, I, &kernels);
        BENCH_CHECK_OK(fp8_group->synchronize_and_check());
      };
      breakdown("");
      if (!g_fp8_only) {
        // The plain loops everywhere: what the overlapped promotion gains GEMM by GEMM.
        overlap(Fp8PromotionOverlap::kNone);
        breakdown(", plain loops");
        overlap(Fp8PromotionOverlap::kTmaOperands);
        // With dependent launch: the kernels' times include their early waits, the span and idle time are the
        // step's.
        const DependentLaunchAs dependent(true);
        breakdown(", dependent launch");
      }
#endif
    }
  }
  {
    // How far the FP8 forward lands from the bf16 one on the same inputs (set 0).
    std::vector<__nv_bfloat16> a(T * H), b(T * H);
    forward_on(*group, 0);
    BENCH_CHECK_OK(group->synchronize_and_check());
    BENCH_CHECK_CUDA(cudaMemcpy(a.data(), out, 2 * T * H, cudaMemcpyDeviceToHost));
    forward_on(*fp8_group, 0);
    BENCH_CHECK_OK(fp8_group->synchronize_and_check());
    BENCH_CHECK_CUDA(cudaMemcpy(b.data(), out, 2 * T * H, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int64_t i = 0; i < T * H; ++i) {
      const double d = static_cast<double>(__bfloat162float(b[i])) - __bfloat162float(a[i]);
      num += d * d;
      den += static_cast<double>(__bfloat162float(a[i])) * __bfloat162float(a[i]);
    }
    r.fp8_out_distance = std::sqrt(num / std::max(den, 1e-300));
  }
#if MEGAMOE_BENCH_CUPTI
  const DependentLaunchAs plain(false);  // kernel times without early waits (see the FP8 breakdown above)
  print_breakdown([&](int it) { step_on(*group, it % kSets); }, stream, 10, static_cast<double>(T * K), H, I, &r);
  BENCH_CHECK_OK(group->synchronize_and_check());
  // The fused groups: their first GEMM launch of their own is the modular backward's dgrad (2), or the
  // weight gradients after the fused backward (4).
  Result fused_breakdown = r;
  for (auto [g, what, first_gemm] : {std::tuple{half_group.get(), "fused forward + modular backward", 2},
                                     std::tuple{fused_group.get(), "fused forward + fused backward", 4}}) {
    if (g == nullptr) continue;  // --fp8 makes no fused groups
    std::printf("  %s:\n", what);
    print_breakdown([&, g = g](int it) { step_on(*g, it % kSets); }, g->stream(0), 10, static_cast<double>(T * K), H,
                    I, &fused_breakdown, first_gemm);
    BENCH_CHECK_OK(g->synchronize_and_check());
  }
  std::printf("  fp8 forward:\n");
  print_breakdown([&](int it) { forward_on(*fp8_group, it % kSets); }, fp8_group->stream(0), 10,
                  static_cast<double>(T * K), H, I, &fused_breakdown, 0, "FP8 forward", 2);
  BENCH_CHECK_OK(fp8_group->synchronize_and_check());
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
  cudaFree(d_w13_bf16);
  cudaFree(d_w2_bf16);
  return r;
}

// ---- the cost of expert parallelism ----

// One group of R virtual ranks with its inputs and outputs: the Qwen3-30B shape, E experts, top-8, uniform
// random routing, T tokens per rank.
struct RankedLayer {
  std::unique_ptr<megamoe::VirtualRankGroup> group;
  int R = 0;
  int64_t T = 0;
  std::vector<__nv_bfloat16*> x, d_out, out, d_x, w13, w2;
  std::vector<int64_t*> idx;
  std::vector<float*> weights, d_weights, d_w13, d_w2;

  RankedLayer(int ranks, int64_t tokens, int64_t experts, megamoe::ForwardPath path) : R(ranks), T(tokens) {
    megamoe::LayerConfig c = megamoe::LayerConfig::qwen3_30b_a3b();
    c.num_experts = experts;
    c.num_ranks = ranks;
    c.max_tokens_per_rank = tokens;
    megamoe::LayerOptions o;
    o.forward_path = path;
    if (path == megamoe::ForwardPath::kFused) o.backward_path = megamoe::BackwardPath::kFused;
    BENCH_CHECK_OK(megamoe::VirtualRankGroup::create(c, o, &group));
    const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, EL = experts / ranks;
    std::mt19937_64 rng(4321);
    std::vector<int64_t> all(experts);
    for (int64_t e = 0; e < experts; ++e) all[e] = e;
    for (int r = 0; r < ranks; ++r) {
      x.push_back(device_alloc<__nv_bfloat16>(T * H));
      d_out.push_back(device_alloc<__nv_bfloat16>(T * H));
      out.push_back(device_alloc<__nv_bfloat16>(T * H));
      d_x.push_back(device_alloc<__nv_bfloat16>(T * H));
      w13.push_back(device_alloc<__nv_bfloat16>(EL * 2 * I * H));
      w2.push_back(device_alloc<__nv_bfloat16>(EL * H * I));
      d_w13.push_back(device_alloc<float>(EL * 2 * I * H));
      d_w2.push_back(device_alloc<float>(EL * H * I));
      d_weights.push_back(device_alloc<float>(T * K));
      if (!megamoe::kernels::fill_hashed_bf16(x[r], T * H, 40 + r, 0, 1.0f) ||
          !megamoe::kernels::fill_hashed_bf16(d_out[r], T * H, 60 + r, 0, 1.0f) ||
          !megamoe::kernels::fill_hashed_bf16(w13[r], EL * 2 * I * H, 80 + r, 0, 0.03f) ||
          !megamoe::kernels::fill_hashed_bf16(w2[r], EL * H * I, 100 + r, 0, 0.03f))
        std::exit(1);
      std::vector<int64_t> h_idx(T * K);
      std::vector<float> h_w(T * K, 1.0f / static_cast<float>(K));
      for (int64_t t = 0; t < T; ++t) {
        std::shuffle(all.begin(), all.end(), rng);
        for (int64_t j = 0; j < K; ++j) h_idx[t * K + j] = all[j];
      }
      idx.push_back(device_alloc<int64_t>(T * K));
      weights.push_back(device_alloc<float>(T * K));
      BENCH_CHECK_CUDA(cudaMemcpy(idx[r], h_idx.data(), 8 * T * K, cudaMemcpyHostToDevice));
      BENCH_CHECK_CUDA(cudaMemcpy(weights[r], h_w.data(), 4 * T * K, cudaMemcpyHostToDevice));
    }
    BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  }
  ~RankedLayer() {
    for (auto* v : {&x, &d_out, &out, &d_x, &w13, &w2})
      for (auto* q : *v) cudaFree(q);
    for (auto* v : {&weights, &d_weights, &d_w13, &d_w2})
      for (auto* q : *v) cudaFree(q);
    for (auto* q : idx) cudaFree(q);
  }
  void forward(int r) {
    megamoe::ForwardArgs f;
    f.num_tokens = T;
    f.x = x[r];
    f.topk_idx = idx[r];
    f.topk_weights = weights[r];
    f.w13 = w13[r];
    f.w2 = w2[r];
    f.out = out[r];
    BENCH_CHECK_OK(group->layer(r).forward(f));
  }
  void backward(int r) {
    megamoe::BackwardArgs b;
    b.d_out = d_out[r];
    b.d_x = d_x[r];
    b.d_topk_weights = d_weights[r];
    b.d_w13 = d_w13[r];
    b.d_w2 = d_w2[r];
    BENCH_CHECK_OK(group->layer(r).backward(b));
  }
  // From one start to the end of every rank's work (each rank on its own stream).
  float time_all(bool with_backward, cudaStream_t main, cudaEvent_t start, cudaEvent_t stop,
                 std::vector<cudaEvent_t>& done) {
    BENCH_CHECK_CUDA(cudaEventRecord(start, main));
    for (int r = 0; r < R; ++r) BENCH_CHECK_CUDA(cudaStreamWaitEvent(group->stream(r), start, 0));
    for (int r = 0; r < R; ++r) forward(r);
    if (with_backward)
      for (int r = 0; r < R; ++r) backward(r);
    for (int r = 0; r < R; ++r) {
      BENCH_CHECK_CUDA(cudaEventRecord(done[r], group->stream(r)));
      BENCH_CHECK_CUDA(cudaStreamWaitEvent(main, done[r], 0));
    }
    BENCH_CHECK_CUDA(cudaEventRecord(stop, main));
    BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }
};

struct EpResult {
  float forward_ms[2], total_ms[2];  // [0]: one rank of 16384 tokens, [1]: 8 virtual ranks of 2048
};

// E = 128, top-8 at the Qwen3-30B shape: 8 virtual ranks of 2048 tokens against one rank of 16384, the two
// timed interleaved, run for run.
EpResult run_ep(megamoe::ForwardPath path, int iters) {
  RankedLayer one(1, 16384, 128, path), eight(8, 2048, 128, path);
  cudaStream_t main = nullptr;
  BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<cudaEvent_t> done(8);
  for (auto& e : done) BENCH_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::vector<float> f1, f8, t1, t8;
  for (int it = -3; it < iters; ++it) {
    const float a = one.time_all(false, main, start, stop, done);
    const float b = eight.time_all(false, main, start, stop, done);
    const float c = one.time_all(true, main, start, stop, done);
    const float d = eight.time_all(true, main, start, stop, done);
    if (it < 0) continue;
    f1.push_back(a);
    f8.push_back(b);
    t1.push_back(c);
    t8.push_back(d);
  }
  BENCH_CHECK_OK(one.group->synchronize_and_check());
  BENCH_CHECK_OK(eight.group->synchronize_and_check());
  for (auto& e : done) cudaEventDestroy(e);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(main);
  return EpResult{{median(f1), median(f8)}, {median(t1), median(t8)}};
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  const char* baseline_path = nullptr;
  int iters = 20;
  bool with_ep = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--baseline") && i + 1 < argc) baseline_path = argv[++i];
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--no-ep")) with_ep = false;
    else if (!std::strcmp(argv[i], "--fp8")) g_fp8_only = true, with_ep = false;
    else if (!std::strcmp(argv[i], "--bf16-grads")) g_bf16_grads = true;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_layer: no CUDA device, nothing to time\n");
    return 0;
  }
  std::vector<Result> results;
  for (auto [H, I] : {std::pair<int64_t, int64_t>{2048, 768}, {4096, 1536}}) {
    std::printf("bench_layer: H=%lld I=%lld E=16 K=8 T=16384 R=1, weight gradients in %s ...\n",
                static_cast<long long>(H), static_cast<long long>(I), g_bf16_grads ? "bf16" : "fp32");
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
  if (!g_fp8_only) {
    std::printf("fused forward vs modular (interleaved, median of %d):\n", iters);
    std::printf("| layer H, I (bf16) | modular fwd ms | fused fwd ms | TFLOP/s | fused / modular | modular fwd+bwd ms | "
                "fused fwd + modular bwd ms | fused fwd+bwd ms | TFLOP/s | fused / modular | "
                "fused fwd+bwd, recompute h ms |\n");
    for (const Result& r : results) {
      const double fused_tflops = r.forward_tflops * r.forward_ms / r.fused_forward_ms;
      const double fused_total_tflops = r.total_tflops * r.total_ms / r.fused_total_ms;
      std::printf("| %lld, %lld | %.3f | %.3f | %.1f | %.3fx | %.3f | %.3f | %.3f | %.1f | %.3fx | %.3f |\n",
                  static_cast<long long>(r.hidden), static_cast<long long>(r.intermediate), r.forward_ms,
                  r.fused_forward_ms, fused_tflops, r.fused_forward_ms / r.forward_ms, r.total_ms,
                  r.fused_forward_modular_backward_ms, r.fused_total_ms, fused_total_tflops,
                  r.fused_total_ms / r.total_ms, r.fused_recompute_total_ms);
    }
    std::printf("both fused kernels by wave lag (GEMM2 of expert e after GEMM1 of e + lag; interleaved, median of %d):\n",
                iters);
    std::printf("| layer H, I | lag | fused fwd ms | fused fwd+bwd ms |\n");
    for (const Result& r : results) {
      for (size_t l = 0; l < kWaveLags.size(); ++l) {
        std::printf("| %lld, %lld | %d | %.3f | %.3f |\n", static_cast<long long>(r.hidden),
                    static_cast<long long>(r.intermediate), kWaveLags[l], r.lag_forward_ms[l], r.lag_total_ms[l]);
      }
    }
  }  // !g_fp8_only
  std::printf("blockwise FP8 forward (modular) vs bf16 modular forward (interleaved, median of %d):\n", iters);
  std::printf("| layer H, I | bf16 fwd ms | fp8 fwd ms | TFLOP/s | bf16 / fp8 | "
              "||out_fp8 - out_bf16|| / ||out_bf16|| |\n");
  for (const Result& r : results) {
    std::printf("| %lld, %lld | %.3f | %.3f | %.1f | %.3fx | %.3e |\n", static_cast<long long>(r.hidden),
                static_cast<long long>(r.intermediate), r.forward_ms, r.fp8_forward_ms,
                r.forward_tflops * r.forward_ms / r.fp8_forward_ms, r.forward_ms / r.fp8_forward_ms,
                r.fp8_out_distance);
  }
  std::printf("blockwise FP8 forward + backward (modular) vs bf16 modular (run for run, median of %d):\n", iters);
  std::printf("| layer H, I | bf16 fwd+bwd ms | fp8 fwd+bwd ms | TFLOP/s | bf16 / fp8 |\n");
  for (const Result& r : results) {
    if (r.fp8_total_ms < 0) {
      std::printf("| %lld, %lld | %.3f | failed | | |\n", static_cast<long long>(r.hidden),
                  static_cast<long long>(r.intermediate), r.fp8_bf16_total_ms);
      continue;
    }
    std::printf("| %lld, %lld | %.3f | %.3f | %.1f | %.3fx |\n", static_cast<long long>(r.hidden),
                static_cast<long long>(r.intermediate), r.fp8_bf16_total_ms, r.fp8_total_ms,
                r.total_tflops * r.total_ms / r.fp8_total_ms, r.fp8_bf16_total_ms / r.fp8_total_ms);
  }
  if (with_ep) {
    std::printf("cost of expert parallelism: Qwen3-30B shape, E=128, top-8; 8 virtual ranks x 2048 tokens vs "
                "1 rank x 16384 (interleaved, median of %d)\n", iters);
    std::printf("| paths (fwd and bwd) | R=1 fwd ms | R=8 fwd ms | ratio | R=1 fwd+bwd ms | R=8 fwd+bwd ms | ratio |\n");
    for (auto path : {megamoe::ForwardPath::kModular, megamoe::ForwardPath::kFused}) {
      const EpResult e = run_ep(path, iters);
      std::printf("| %s | %.3f | %.3f | %.2fx | %.3f | %.3f | %.2fx |\n",
                  path == megamoe::ForwardPath::kFused ? "fused" : "modular", e.forward_ms[0], e.forward_ms[1],
                  e.forward_ms[1] / e.forward_ms[0], e.total_ms[0], e.total_ms[1], e.total_ms[1] / e.total_ms[0]);
    }
  }
  std::printf("| layer H, I (bf16) | megamoe fwd ms | TFLOP/s | torch fwd ms | fwd speedup | megamoe fwd+bwd ms | "
              "TFLOP/s | torch fwd+bwd ms | fwd+bwd speedup |\n");
  for (const Result& r : results) {
    double torch_fwd = 0, torch_total = 0;
    for (const auto& b : baseline)
      if (static_cast<int64_t>(b[0]) == r.hidden && static_cast<int64_t>(b[1]) == r.intermediate)
        torch_fwd = b[2], torch_total = b[3];
    // Without a baseline row (no --baseline, or none of this shape) the torch columns say so, not 0.
    const auto torch_cell = [](double torch, const char* format, double value) {
      if (!(torch > 0)) return std::string("-");
      char text[32];
      std::snprintf(text, sizeof(text), format, value);
      return std::string(text);
    };
    std::printf("| %lld, %lld | %.3f | %.1f | %s | %s | %.3f | %.1f | %s | %s |\n",
                static_cast<long long>(r.hidden), static_cast<long long>(r.intermediate), r.forward_ms,
                r.forward_tflops, torch_cell(torch_fwd, "%.3f", torch_fwd).c_str(),
                torch_cell(torch_fwd, "%.2fx", torch_fwd / r.forward_ms).c_str(), r.total_ms, r.total_tflops,
                torch_cell(torch_total, "%.3f", torch_total).c_str(),
                torch_cell(torch_total, "%.2fx", torch_total / r.total_ms).c_str());
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
                   "\"other_kernel_ms\": %.4f, \"kernels\": %d, \"fused_forward_ms\": %.4f, "
                   "\"fused_total_ms\": %.4f, \"fused_forward_modular_backward_ms\": %.4f, "
                   "\"fused_recompute_total_ms\": %.4f, \"fp8_forward_ms\": %.4f, \"fp8_out_distance\": %.4e, "
                   "\"fp8_total_ms\": %.4f}",
                   i ? ", " : "", static_cast<long long>(r.hidden), static_cast<long long>(r.intermediate),
                   r.forward_ms, r.total_ms, r.forward_tflops, r.total_tflops, r.gemm_ms, r.other_ms, r.kernels,
                   r.fused_forward_ms, r.fused_total_ms, r.fused_forward_modular_backward_ms,
                   r.fused_recompute_total_ms, r.fp8_forward_ms, r.fp8_out_distance, r.fp8_total_ms);
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  return 0;
}
