// The main job: runs the MoE layer on its default configuration and says what it did.
//   megamoe_run [--tokens T] [--ranks R] [--iters N] [--cpu] [--help]   (run_usage() in run_options.hpp)
// With a GPU: the Qwen3-30B-A3B layer shape (H=2048, I=768, E=128, K=8) on R virtual ranks of one GPU,
// forward + backward timed. Without one (or with --cpu): the CPU reference, bf16-exact and FP8 blockwise,
// on a small configuration. The flags mean the same on both paths; only their defaults differ.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/device.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/reference_fp8.hpp"
#include "run_options.hpp"

#if MEGAMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <memory>

#include "megamoe/layer.hpp"
#endif

namespace {

using megamoe::tool::RunOptions;

int64_t or_default(int64_t given, int64_t fallback) { return given > 0 ? given : fallback; }

std::string cuda_version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// The CUDA runtime reports a machine without any NVIDIA driver as "CUDA driver version is insufficient",
// the same error as a driver that is merely too old; the driver's version (0 when there is no driver)
// tells the two apart.
std::string why_no_gpu(const megamoe::DeviceInfo& device) {
#if MEGAMOE_WITH_CUDA
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  if (driver == 0) return "no NVIDIA driver is installed (no GPU on this machine)";
  if (runtime > 0 && driver < runtime)
    return "the NVIDIA driver supports CUDA " + cuda_version_text(driver) + ", older than the CUDA " +
           cuda_version_text(runtime) + " runtime this build uses: update the driver";
  if (err == cudaErrorNoDevice || (err == cudaSuccess && devices == 0))
    return "the NVIDIA driver (CUDA " + cuda_version_text(driver) + ") sees no GPU";
  return device.why_unavailable;
#else
  return device.why_unavailable + " (configure with -DMEGAMOE_ENABLE_CUDA=ON for the GPU layer)";
#endif
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

int run_cpu_reference(const RunOptions& o) {
  using namespace megamoe;
  LayerConfig c;
  c.hidden = 256;
  c.intermediate = 128;
  c.num_ranks = or_default(o.ranks, tool::kCpuDefaultRanks);
  c.num_experts = 4 * c.num_ranks;  // 4 per rank: every R divides E, and two slots can pick distinct experts
  c.top_k = 2;
  c.max_tokens_per_rank = or_default(o.tokens, tool::kCpuDefaultTokens);
  const int64_t iters = or_default(o.iters, tool::kCpuDefaultIters);
  if (Status s = validate(c); !s.is_ok()) {
    std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
    return 2;
  }
  std::printf("CPU reference on a small configuration: %s, %lld run(s)\n", c.to_string().c_str(),
              static_cast<long long>(iters));
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> expert(0, c.num_experts - 1);
  std::vector<reference::RankInputs<float>> ranks(static_cast<size_t>(c.num_ranks));
  std::vector<std::vector<float>> d_out(static_cast<size_t>(c.num_ranks));
  const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, EL = c.experts_per_rank();
  for (auto& r : ranks) {
    r.num_tokens = c.max_tokens_per_rank;
    for (int64_t i = 0; i < r.num_tokens * H; ++i) r.x.push_back(normal(rng));
    for (int64_t t = 0; t < r.num_tokens; ++t) {
      const int64_t first = expert(rng);
      r.topk_idx.push_back(first);
      r.topk_idx.push_back((first + 1 + expert(rng) % (c.num_experts - 1)) % c.num_experts);
      r.topk_weights.push_back(0.6f);
      r.topk_weights.push_back(0.4f);
    }
    for (int64_t i = 0; i < EL * 2 * I * H; ++i) r.w13.push_back(normal(rng) / std::sqrt(static_cast<float>(H)));
    for (int64_t i = 0; i < EL * H * I; ++i) r.w2.push_back(normal(rng) / std::sqrt(static_cast<float>(I)));
  }
  for (auto& d : d_out)
    for (int64_t i = 0; i < c.max_tokens_per_rank * H; ++i) d.push_back(normal(rng));
  std::vector<std::vector<float>> out, out_fp8;
  std::vector<reference::RankGradients<float>> grads, grads_fp8;
  std::vector<double> times;
  for (int64_t it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    for (Status s : {reference::forward(c, ranks, &out), reference::backward(c, ranks, d_out, &grads),
                     reference::forward_fp8(c, ranks, &out_fp8),
                     reference::backward_fp8(c, ranks, d_out, &grads_fp8)})
      if (!s.is_ok()) {
        std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
        return 1;
      }
    times.push_back(seconds_since(t0));
  }
  std::sort(times.begin(), times.end());
  const int64_t pairs = c.num_ranks * c.max_tokens_per_rank * K;
  std::printf("forward + backward, exact and FP8 blockwise, %lld tokens x top-%lld on %lld rank(s) (%lld routed "
              "token-expert pairs): median %.3f s over %lld run(s)\n",
              static_cast<long long>(c.num_ranks * c.max_tokens_per_rank), static_cast<long long>(K),
              static_cast<long long>(c.num_ranks), static_cast<long long>(pairs), times[times.size() / 2],
              static_cast<long long>(iters));
  for (size_t r = 0; r < ranks.size(); ++r)
    std::printf("rank %zu: |out| %.4g  |d_x| %.4g  |d_w13| %.4g  |d_w2| %.4g   FP8 vs exact: out %.2e  d_x %.2e  "
                "d_w13 %.2e\n",
                r, norm(out[r]), norm(grads[r].d_x), norm(grads[r].d_w13), norm(grads[r].d_w2),
                relative_difference(out_fp8[r], out[r]), relative_difference(grads_fp8[r].d_x, grads[r].d_x),
                relative_difference(grads_fp8[r].d_w13, grads[r].d_w13));
  return 0;
}

#if MEGAMOE_WITH_CUDA
int run_gpu_layer(const RunOptions& o) {
  using namespace megamoe;
  LayerConfig c = LayerConfig::qwen3_30b_a3b();
  c.num_ranks = or_default(o.ranks, tool::kGpuDefaultRanks);
  c.max_tokens_per_rank = or_default(o.tokens, tool::kGpuDefaultTokens);
  const int iters = static_cast<int>(or_default(o.iters, tool::kGpuDefaultIters));
  if (Status s = validate(c); !s.is_ok()) {
    std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
    return 2;
  }
  std::printf("GPU layer (bf16, modular path) on %lld virtual rank(s): %s\n", static_cast<long long>(c.num_ranks),
              c.to_string().c_str());
  std::unique_ptr<VirtualRankGroup> group;
  if (Status s = VirtualRankGroup::create(c, LayerOptions{}, &group); !s.is_ok()) {
    std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
    return 1;
  }
  const int64_t T = c.max_tokens_per_rank, H = c.hidden, I = c.intermediate, K = c.top_k, EL = c.experts_per_rank();
  std::mt19937_64 rng(7);
  struct Rank {
    void *x, *idx, *w, *w13, *w2, *out, *d_out, *d_x, *d_w, *d_w13, *d_w2;
  };
  std::vector<Rank> rk(c.num_ranks);
  auto alloc = [](void** p, size_t bytes) {
    if (cudaMalloc(p, bytes) != cudaSuccess) {
      std::fprintf(stderr, "megamoe_run: cudaMalloc of %zu bytes failed\n", bytes);
      std::exit(1);
    }
  };
  auto upload_random_bf16 = [&](void* dst, int64_t count, float scale) {
    std::vector<uint16_t> host(count);
    std::normal_distribution<float> normal(0.0f, scale);
    for (auto& v : host) {
      const float f = normal(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      v = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to nearest even
    }
    cudaMemcpy(dst, host.data(), count * 2, cudaMemcpyHostToDevice);
  };
  for (auto& r : rk) {
    alloc(&r.x, T * H * 2);
    alloc(&r.d_out, T * H * 2);
    alloc(&r.idx, T * K * 8);
    alloc(&r.w, T * K * 4);
    alloc(&r.w13, EL * 2 * I * H * 2);
    alloc(&r.w2, EL * H * I * 2);
    alloc(&r.out, T * H * 2);
    alloc(&r.d_x, T * H * 2);
    alloc(&r.d_w, T * K * 4);
    alloc(&r.d_w13, EL * 2 * I * H * 4);
    alloc(&r.d_w2, EL * H * I * 4);
    upload_random_bf16(r.x, T * H, 1.0f);
    upload_random_bf16(r.d_out, T * H, 1.0f);
    upload_random_bf16(r.w13, EL * 2 * I * H, 0.02f);
    upload_random_bf16(r.w2, EL * H * I, 0.02f);
    std::vector<int64_t> idx(T * K);
    std::vector<float> w(T * K, 1.0f / static_cast<float>(K));
    std::vector<int64_t> experts(c.num_experts);
    for (int64_t e = 0; e < c.num_experts; ++e) experts[e] = e;
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      std::copy(experts.begin(), experts.begin() + K, idx.begin() + t * K);
    }
    cudaMemcpy(r.idx, idx.data(), idx.size() * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(r.w, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
  }
  std::vector<float> times;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int it = -2; it < iters; ++it) {
    cudaEventRecord(start, group->stream(0));
    for (int64_t r = 0; r < c.num_ranks; ++r) {
      ForwardArgs f;
      f.num_tokens = T;
      f.x = static_cast<const __nv_bfloat16*>(rk[r].x);
      f.topk_idx = rk[r].idx;
      f.topk_weights = static_cast<const float*>(rk[r].w);
      f.w13 = static_cast<const __nv_bfloat16*>(rk[r].w13);
      f.w2 = static_cast<const __nv_bfloat16*>(rk[r].w2);
      f.out = static_cast<__nv_bfloat16*>(rk[r].out);
      if (r > 0) cudaStreamWaitEvent(group->stream(static_cast<int>(r)), start);
      if (Status s = group->layer(static_cast<int>(r)).forward(f); !s.is_ok()) {
        std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
        return 1;
      }
    }
    for (int64_t r = 0; r < c.num_ranks; ++r) {
      BackwardArgs b;
      b.d_out = static_cast<const __nv_bfloat16*>(rk[r].d_out);
      b.d_x = static_cast<__nv_bfloat16*>(rk[r].d_x);
      b.d_topk_weights = static_cast<float*>(rk[r].d_w);
      b.d_w13 = static_cast<float*>(rk[r].d_w13);
      b.d_w2 = static_cast<float*>(rk[r].d_w2);
      if (Status s = group->layer(static_cast<int>(r)).backward(b); !s.is_ok()) {
        std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
        return 1;
      }
    }
    if (Status s = group->synchronize_and_check(); !s.is_ok()) {
      std::fprintf(stderr, "megamoe_run: %s\n", s.to_string().c_str());
      return 1;
    }
    cudaEventRecord(stop, group->stream(0));
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (it >= 0) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  const double ms = times[times.size() / 2];
  const int64_t pairs = c.num_ranks * T * K;
  const double flops = c.forward_flops(pairs) + c.backward_flops(pairs);
  std::vector<uint16_t> out(T * H);
  cudaMemcpy(out.data(), rk[0].out, out.size() * 2, cudaMemcpyDeviceToHost);
  int64_t nans = 0;
  for (uint16_t v : out) nans += (v & 0x7F80) == 0x7F80 && (v & 0x7F) != 0;
  std::printf("forward + backward of %lld tokens x top-%lld on %lld rank(s): median %.3f ms over %d runs "
              "(%.1f TFLOP/s, wall clock incl. host enqueue and the error check), rank 0 output NaNs: %lld\n",
              static_cast<long long>(T * c.num_ranks), static_cast<long long>(K), static_cast<long long>(c.num_ranks), ms,
              iters, flops / (ms * 1e-3) / 1e12, static_cast<long long>(nans));
  std::printf("correctness against the CPU reference: run the GPU tests (scripts/gpu-check.sh)\n");
  return nans == 0 ? 0 : 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const megamoe::tool::ParsedOptions parsed = megamoe::tool::parse_run_options(argc, argv);
  if (!parsed.ok) {
    const std::string usage = megamoe::tool::run_usage();
    std::fprintf(stderr, "megamoe_run: %s\n%s(megamoe_run --help says what each flag does)\n", parsed.error.c_str(),
                 usage.substr(0, usage.find('\n') + 1).c_str());
    return 2;
  }
  const RunOptions& o = parsed.options;
  if (o.help) {
    std::fputs(megamoe::tool::run_usage().c_str(), stdout);
    return 0;
  }
  if (o.cpu) return run_cpu_reference(o);
  const megamoe::DeviceInfo device = megamoe::query_device();
  if (!device.available) {
    std::printf("megamoe_run: no GPU found: %s; running the CPU reference instead\n", why_no_gpu(device).c_str());
    return run_cpu_reference(o);
  }
  std::printf("GPU: %s (compute %d.%d, %d SMs)\n", device.name.c_str(), device.compute_major, device.compute_minor,
              device.multiprocessors);
  if (!device.is_hopper()) {
    std::printf("megamoe_run: the kernels are built for Hopper (sm_90a); this GPU is not one: running the CPU "
                "reference instead\n");
    return run_cpu_reference(o);
  }
#if MEGAMOE_WITH_CUDA
  return run_gpu_layer(o);
#else
  return run_cpu_reference(o);
#endif
}
