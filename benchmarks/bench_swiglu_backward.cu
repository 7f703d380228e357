// The FP8 backward's one-pass SwiGLU step (src/kernels/fp8_swiglu_backward.hpp) both ways of sharing a group
// of 128 routed rows out to blocks: one block of 512 threads a group, or a 2-CTA cluster of 256 threads a CTA.
// Config: the layer benchmark's (docs/MODEL.md): T = 16384 tokens, top-8, so 131072 routed rows over 16
// experts of 8192 each, at I = 768 and I = 1536; g and h random fp32.
// Timing: CUDA events around each launch, 5 warm-ups each, then 30 rounds in which each way runs once in turn
// (interleaved); the median of each. GB/s counts the bytes the step must move: g and h read (12 I bytes a row),
// the row-major dh and the token-major a and dh written (5 I bytes a row), scales and dots left out (< 1%).
// The two ways' outputs must be equal byte for byte.
//   bench_swiglu_backward   (--out / --baseline, which scripts/gpu-check.sh gives every benchmark, are ignored)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_check.hpp"
#include "kernels/fp8_layout.hpp"
#include "kernels/fp8_swiglu_backward.hpp"
#include "kernels/hashed_fill.hpp"

namespace {

using megamoe::kernels::SwigluBackwardBlocks;

__global__ void fill_normalish(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = megamoe::kernels::mix64(seed ^ megamoe::kernels::mix64(static_cast<uint64_t>(i)));
    p[i] = (static_cast<float>(bits >> 40) * (1.0f / 16777216.0f) - 0.5f) * 6.0f;
  }
}

template <typename T>
T* device_alloc(int64_t count) {
  T* p = nullptr;
  BENCH_CHECK_CUDA(cudaMalloc(&p, sizeof(T) * std::max<int64_t>(count, 1)));
  return p;
}

// Every output of the step for one way.
struct Outputs {
  uint8_t *dh_q, *at_q, *dht_q;
  float *dh_s, *at_s, *dht_s, *dots;
  float** dot_rows;
  int64_t bytes_q[3], bytes_s[3];
  megamoe::kernels::SwigluBackwardFp8Outputs view;

  Outputs(int64_t capacity, int64_t I, int experts) {
    const int64_t columns = megamoe::kernels::token_major_columns(capacity, experts);
    const int64_t pitch = megamoe::kernels::fp8_scale_pitch(capacity);
    bytes_q[0] = capacity * 2 * I;
    bytes_q[1] = I * columns;
    bytes_q[2] = 2 * I * columns;
    bytes_s[0] = 2 * I / 128 * pitch;
    bytes_s[1] = columns / 128 * I;
    bytes_s[2] = columns / 128 * 2 * I;
    dh_q = device_alloc<uint8_t>(bytes_q[0]);
    at_q = device_alloc<uint8_t>(bytes_q[1]);
    dht_q = device_alloc<uint8_t>(bytes_q[2]);
    dh_s = device_alloc<float>(bytes_s[0]);
    at_s = device_alloc<float>(bytes_s[1]);
    dht_s = device_alloc<float>(bytes_s[2]);
    dots = device_alloc<float>(capacity);
    dot_rows = device_alloc<float*>(capacity);
    std::vector<float*> rows(capacity);
    for (int64_t r = 0; r < capacity; ++r) rows[r] = dots + r;
    BENCH_CHECK_CUDA(cudaMemcpy(dot_rows, rows.data(), sizeof(float*) * capacity, cudaMemcpyHostToDevice));
    view.dh_q = dh_q;
    view.dh_s = dh_s;
    view.dh_scales_pitch = pitch;
    view.dot_rows = dot_rows;
    view.dot_parts = 1;
    view.at_q = at_q;
    view.at_s = at_s;
    view.dht_q = dht_q;
    view.dht_s = dht_s;
  }
  ~Outputs() {
    for (void* p : {static_cast<void*>(dh_q), static_cast<void*>(at_q), static_cast<void*>(dht_q),
                    static_cast<void*>(dh_s), static_cast<void*>(at_s), static_cast<void*>(dht_s),
                    static_cast<void*>(dots), static_cast<void*>(dot_rows)})
      cudaFree(p);
  }
  Outputs(const Outputs&) = delete;
  Outputs& operator=(const Outputs&) = delete;
};

template <typename T>
bool same_bytes(const T* a, const T* b, int64_t count) {
  std::vector<T> x(count), y(count);
  BENCH_CHECK_CUDA(cudaMemcpy(x.data(), a, sizeof(T) * count, cudaMemcpyDeviceToHost));
  BENCH_CHECK_CUDA(cudaMemcpy(y.data(), b, sizeof(T) * count, cudaMemcpyDeviceToHost));
  return std::equal(x.begin(), x.end(), y.begin(), [](const T& u, const T& v) {
    return std::memcmp(&u, &v, sizeof(T)) == 0;
  });
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run(int64_t I) {
  constexpr int kExperts = 16, kRowsPerExpert = 8192, kWarmups = 5, kRounds = 30;
  const int64_t capacity = int64_t{kExperts} * kRowsPerExpert;
  float* g = device_alloc<float>(capacity * I);
  float* h = device_alloc<float>(capacity * 2 * I);
  float* w = device_alloc<float>(capacity);
  int32_t* offsets = device_alloc<int32_t>(kExperts + 1);
  fill_normalish<<<1024, 256>>>(g, capacity * I, 1);
  fill_normalish<<<1024, 256>>>(h, capacity * 2 * I, 2);
  fill_normalish<<<1024, 256>>>(w, capacity, 3);
  BENCH_CHECK_CUDA(cudaGetLastError());
  std::vector<int32_t> host_offsets(kExperts + 1);
  for (int e = 0; e <= kExperts; ++e) host_offsets[e] = e * kRowsPerExpert;
  BENCH_CHECK_CUDA(
      cudaMemcpy(offsets, host_offsets.data(), sizeof(int32_t) * (kExperts + 1), cudaMemcpyHostToDevice));

  const SwigluBackwardBlocks ways[2] = {SwigluBackwardBlocks::kOnePerGroup, SwigluBackwardBlocks::kPairPerGroup};
  const char* names[2] = {"one block a group", "2-CTA cluster a group"};
  Outputs out0(capacity, I, kExperts), out1(capacity, I, kExperts);
  Outputs* outs[2] = {&out0, &out1};
  const auto launch = [&](int way) {
    BENCH_CHECK_OK(megamoe::kernels::swiglu_backward_quantize_fp8(g, h, w, I, offsets, kExperts, capacity,
                                                                  outs[way]->view, nullptr, ways[way]));
  };
  cudaEvent_t start, stop;
  BENCH_CHECK_CUDA(cudaEventCreate(&start));
  BENCH_CHECK_CUDA(cudaEventCreate(&stop));
  const auto timed = [&](int way) {
    BENCH_CHECK_CUDA(cudaEventRecord(start));
    launch(way);
    BENCH_CHECK_CUDA(cudaEventRecord(stop));
    BENCH_CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  };
  for (int way = 0; way < 2; ++way)
    for (int i = 0; i < kWarmups; ++i) timed(way);
  std::vector<float> times[2];
  for (int round = 0; round < kRounds; ++round)
    for (int way = 0; way < 2; ++way) times[way].push_back(timed(way));

  const bool same = same_bytes(out0.dh_q, out1.dh_q, out0.bytes_q[0]) &&
                    same_bytes(out0.at_q, out1.at_q, out0.bytes_q[1]) &&
                    same_bytes(out0.dht_q, out1.dht_q, out0.bytes_q[2]) &&
                    same_bytes(out0.dh_s, out1.dh_s, out0.bytes_s[0]) &&
                    same_bytes(out0.at_s, out1.at_s, out0.bytes_s[1]) &&
                    same_bytes(out0.dht_s, out1.dht_s, out0.bytes_s[2]) && same_bytes(out0.dots, out1.dots, capacity);
  const double bytes = static_cast<double>(capacity) * 17.0 * static_cast<double>(I);
  const float base = median(times[0]);
  for (int way = 0; way < 2; ++way) {
    const float ms = median(times[way]);
    std::printf("| swiglu_backward I=%-5lld | %-22s | %8.3f ms | %7.1f GB/s | x%.3f |\n", static_cast<long long>(I),
                names[way], ms, bytes / (ms * 1e-3) / 1e9, ms / base);
  }
  std::printf("| swiglu_backward I=%-5lld | outputs of both ways   | %s |\n", static_cast<long long>(I),
              same ? "equal byte for byte" : "DIFFER");
  BENCH_CHECK_CUDA(cudaEventDestroy(start));
  BENCH_CHECK_CUDA(cudaEventDestroy(stop));
  for (void* p : {static_cast<void*>(g), static_cast<void*>(h), static_cast<void*>(w), static_cast<void*>(offsets)})
    cudaFree(p);
  if (!same) std::exit(1);
}

}  // namespace

int main() {
  std::printf("| step | blocks | median | rate | vs one block |\n|---|---|---|---|---|\n");
  run(768);
  run(1536);
  return 0;
}
