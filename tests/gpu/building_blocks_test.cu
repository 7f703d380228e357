// GPU unit tests of the device building blocks (src/device/): the stage pipeline (every ring depth, many
// laps), the grouped tile numbering and the schedulers (every item exactly once, the same sequence for every
// role), the bounded signal/wait (including a wait that times out and is reported), and a GEMM whose tiles
// wait on row-block readiness counters set by another kernel while it runs.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda/ptx>

#include "device/comm/signal.cuh"
#include "device/pipeline.cuh"
#include "device/sched/grouped_tiles.cuh"
#include "device/sched/schedulers.cuh"
#include "gpu/gpu_test_util.hpp"
#include "kernels/grouped_gemm.hpp"

namespace megamoe::device {
namespace {

using megamoe::testing::DeviceBuffer;

std::mt19937_64& rng() {
  static std::mt19937_64 gen = [] {
    const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    std::printf("[building_blocks_test] random seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return gen;
}

// ---------------------------------------------------------------- pipeline

// Warp 0 produces `items` slots of 32 ints through a ring of kStages stages the way the engine fills its
// rings: lane 0 posts the byte count and one bulk copy (TMA, the async proxy) of item i's slot from
// `values` lands in the stage. Warps 1..kConsumers read every item with plain loads, check it and release
// it, every thread arriving for its own reads (the hand-over racecheck follows; the engine's consumers read
// through wgmma and release through one thread per warpgroup). errors[0] counts wrong values (a stage read
// before its copy landed or after it was refilled), errors[1] counts PipeState::advance(n) disagreeing with
// n single advances.
template <int kStages, int kConsumers>
__global__ void pipeline_kernel(const int* values, int items, int* errors) {
  constexpr uint32_t kSlotBytes = 32 * sizeof(int);
  __shared__ uint64_t full[kStages], empty[kStages];
  __shared__ alignas(128) int slots[kStages][32];
  const StagePipeline<kStages> pipe{full, empty};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    // Full: the producer's lane 0 with the copy's bytes; empty: every consumer thread.
    pipe.init(1, 32 * kConsumers);
    mbarrier_init_fence();
  }
  __syncthreads();
  PipeState<kStages> st;
  if (warp == 0) {
    if (lane != 0) return;
    for (int i = 0; i < items; ++i) {
      pipe.producer_acquire(st);
      pipe.producer_expect_tx(st, kSlotBytes);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, slots[st.index], values + i * 32,
                               kSlotBytes, pipe.full_barrier(st));
      st.advance();
    }
  } else {
    for (int i = 0; i < items; ++i) {
      pipe.consumer_wait(st);
      if (slots[st.index][lane] != values[i * 32 + lane]) atomicAdd(&errors[0], 1);
      mbarrier_arrive(&empty[st.index]);
      // advance(n) from a copy must land where n single steps land.
      PipeState<kStages> jump = st, walk = st;
      const int n = (i * 7 + lane) % (3 * kStages + 1);
      jump.advance(n);
      for (int k = 0; k < n; ++k) walk.advance();
      if (jump.index != walk.index || jump.phase != walk.phase) atomicAdd(&errors[1], 1);
      st.advance();
    }
  }
}

template <int kStages, int kConsumers>
void run_pipeline(int items) {
  // Every value distinct, so a stale or early read shows.
  std::vector<int> host(static_cast<size_t>(items) * 32);
  std::iota(host.begin(), host.end(), static_cast<int>(rng()() % 1000000));
  DeviceBuffer<int> values(host.size());
  values.upload(host);
  DeviceBuffer<int> errors(2);
  MEGAMOE_ASSERT_CUDA(cudaMemset(errors.get(), 0, 2 * sizeof(int)));
  pipeline_kernel<kStages, kConsumers><<<1, 32 * (1 + kConsumers)>>>(values.get(), items, errors.get());
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto e = errors.download();
  EXPECT_EQ(e[0], 0) << kStages << " stages: values seen out of order or overwritten";
  EXPECT_EQ(e[1], 0) << kStages << " stages: advance(n) disagrees";
}

TEST(BuildingBlocks, PipelineEveryDepthManyLaps) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run_pipeline<1, 1>(257);
  run_pipeline<2, 2>(1001);
  run_pipeline<3, 2>(1000);
  run_pipeline<4, 3>(999);
  run_pipeline<6, 1>(1234);
  run_pipeline<7, 2>(77);
}

// ---------------------------------------------------------------- tile numbering and schedulers

constexpr int kSchedBM = 128, kSchedBN = 256;

// Every CTA walks its schedule with two roles (thread 0 as the "producer" that draws dynamic items, thread
// 32 as a "consumer" that reads them), decodes each item and records it: hits[t] counts how often item t
// was taken (by the consumer role), seq_p / seq_c the per-CTA sequences, and tiles[t] the decoded tile.
template <int kCluster, bool kKGrouped>
__global__ void schedule_kernel(const int32_t* offsets, int E, int max_rows, int M, int N, int K, int* counter,
                                int longest_first, int* hits, int* seq_p, int* seq_c, int max_seq, TileCoord* tiles) {
  using Tiles = GroupedTiles<kSchedBM, kSchedBN, 64, kCluster, kKGrouped>;
  __shared__ typename Tiles::Storage storage;
  __shared__ typename DynamicSchedule<4>::Storage ring;
  const Tiles t{&storage, E, (N + kSchedBN - 1) / kSchedBN, M, K};
  const DynamicSchedule<4> dyn{&ring, counter};
  const bool dynamic = counter != nullptr;
  if (threadIdx.x == 0 && dynamic) {
    dyn.init(1);
    mbarrier_init_fence();
  }
  t.build(offsets, max_rows, longest_first != 0, threadIdx.x, blockDim.x);
  const int rank = kCluster == 1 ? 0 : static_cast<int>(blockIdx.x % kCluster);
  const StaticSchedule sched{static_cast<int>(blockIdx.x) / kCluster, static_cast<int>(gridDim.x) / kCluster};
  if (threadIdx.x != 0 && threadIdx.x != 32) return;
  const bool producer = threadIdx.x == 0;
  int* seq = (producer ? seq_p : seq_c) + blockIdx.x * max_seq;
  for (int j = 0;; ++j) {
    const int item = dynamic ? (producer ? dyn.draw(j) : dyn.read(j)) : sched.item(j);
    if (j < max_seq) seq[j] = item;
    if (item >= t.total()) break;
    if (!producer) {
      atomicAdd(&hits[item * kCluster + rank], 1);
      tiles[item * kCluster + rank] = t.decode(item, rank);
    }
  }
}

template <int kCluster, bool kKGrouped>
void check_schedule(const std::vector<int>& sizes, bool dynamic, bool longest_first) {
  const int E = static_cast<int>(sizes.size());
  std::vector<int32_t> off(E + 1, 0);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + sizes[e];
  const int max_rows = off[E] + 3;
  const int M = 392, N = 600, K = 136;  // 4 m-tiles (K-grouped), 3 n-tiles
  const int n_tiles = (N + kSchedBN - 1) / kSchedBN, k_mtiles = (M + kSchedBM - 1) / kSchedBM;
  // Expected item count and the set of (e, m, n) tiles.
  int expected = 0;
  std::vector<std::array<int, 3>> want;
  for (int e = 0; e < E; ++e) {
    const int m_tiles = kKGrouped ? k_mtiles : (sizes[e] + kSchedBM - 1) / kSchedBM;
    const int units = (m_tiles + kCluster - 1) / kCluster;
    expected += units * n_tiles;
    for (int u = 0; u < units; ++u)
      for (int c = 0; c < kCluster; ++c)
        for (int n = 0; n < n_tiles; ++n) want.push_back({e, u * kCluster + c, n});
  }
  const int grid = 6 * kCluster, max_seq = expected + 2;
  DeviceBuffer<int32_t> dOff(off.size());
  dOff.upload(off);
  DeviceBuffer<int> hits(size_t(std::max(expected, 1)) * kCluster), seq_p(size_t(grid) * max_seq),
      seq_c(size_t(grid) * max_seq), counter(1);
  DeviceBuffer<TileCoord> tiles(size_t(std::max(expected, 1)) * kCluster);
  MEGAMOE_ASSERT_CUDA(cudaMemset(hits.get(), 0, hits.size() * sizeof(int)));
  MEGAMOE_ASSERT_CUDA(cudaMemset(counter.get(), 0, sizeof(int)));
  // The dynamic schedule is per CTA: one CTA per "cluster" there (the engine allows it with clusters of 1).
  schedule_kernel<kCluster, kKGrouped><<<grid, 64>>>(dOff.get(), E, max_rows, M, N, K, dynamic ? counter.get() : nullptr,
                                                     longest_first ? 1 : 0, hits.get(), seq_p.get(), seq_c.get(),
                                                     max_seq, tiles.get());
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto h = hits.download(), sp = seq_p.download(), sc = seq_c.download();
  const auto got_tiles = tiles.download();
  for (int i = 0; i < expected * kCluster; ++i) ASSERT_EQ(h[i], 1) << "item " << i / kCluster << " taken " << h[i] << " times";
  // Every role of a CTA saw the same sequence, ending with the same end marker.
  for (int b = 0; b < grid; ++b) {
    for (int j = 0; j < max_seq; ++j) {
      ASSERT_EQ(sp[size_t(b) * max_seq + j], sc[size_t(b) * max_seq + j]) << "CTA " << b << " position " << j;
      if (sp[size_t(b) * max_seq + j] >= expected) break;
    }
  }
  // The decoded tiles are exactly the expected set (each once), with consistent rows.
  std::vector<std::array<int, 3>> seen;
  for (int i = 0; i < expected * kCluster; ++i) {
    const TileCoord& c = got_tiles[i];
    seen.push_back({c.e, c.m_idx, c.n_idx});
    if (kKGrouped) {
      ASSERT_EQ(c.row0, off[c.e]);
      ASSERT_EQ(c.rows, sizes[c.e]);
    } else {
      ASSERT_EQ(c.row0, off[c.e] + c.m_idx * kSchedBM);
      ASSERT_EQ(c.rows, std::min(kSchedBM, sizes[c.e] - c.m_idx * kSchedBM));
      int block = 0;  // row blocks numbered over the experts in order
      for (int e = 0; e < c.e; ++e) block += (sizes[e] + kSchedBM - 1) / kSchedBM;
      ASSERT_EQ(c.m_block, block + c.m_idx);
    }
  }
  std::sort(seen.begin(), seen.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(seen, want);
}

TEST(BuildingBlocks, SchedulersCoverEveryTileOnceInOneSequence) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  std::uniform_int_distribution<int> d(0, 700);
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<int> sizes(37 + rep);
    for (auto& v : sizes) v = d(rng());
    sizes[0] = 0;
    sizes[5] = 128;
    sizes[6] = 129;
    check_schedule<1, false>(sizes, false, false);
    check_schedule<1, false>(sizes, true, false);
    check_schedule<2, false>(sizes, false, false);
    check_schedule<1, true>(sizes, false, false);
    check_schedule<1, true>(sizes, true, true);
    check_schedule<2, true>(sizes, false, false);
  }
}

// ---------------------------------------------------------------- signal / wait

__global__ void wait_kernel(const uint32_t* counter, uint32_t target, ep::DeviceError* record, uint64_t timeout_ns,
                            int64_t wait_id, int* result) {
  const WaitReport report{record, 3, timeout_ns};
  *result = wait_at_least<Scope::kSystem>(counter, target, report, wait_id) ? 1 : 0;
}

__global__ void signal_kernel(uint32_t* counter, int times, uint64_t delay_ns) {
  for (int i = 0; i < times; ++i) {
    const uint64_t start = global_timer_ns();
    while (global_timer_ns() - start < delay_ns) {
    }
    signal_add<Scope::kSystem>(counter, 1u);
  }
}

TEST(BuildingBlocks, SignalWaitSucceedsAcrossKernelsAndReportsATimeout) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<uint32_t> counter(1);
  DeviceBuffer<ep::DeviceError> record(1);
  DeviceBuffer<int> result(1);
  MEGAMOE_ASSERT_CUDA(cudaMemset(counter.get(), 0, sizeof(uint32_t)));
  MEGAMOE_ASSERT_CUDA(cudaMemset(record.get(), 0, sizeof(ep::DeviceError)));
  // Loaded up front: under lazy module loading the first launch of a kernel waits for running kernels, so
  // a signaller loaded while the waiter spins would only start after the waiter's timeout.
  cudaFuncAttributes attributes{};
  MEGAMOE_ASSERT_CUDA(cudaFuncGetAttributes(&attributes, wait_kernel));
  MEGAMOE_ASSERT_CUDA(cudaFuncGetAttributes(&attributes, signal_kernel));
  cudaStream_t waiter, signaller;
  MEGAMOE_ASSERT_CUDA(cudaStreamCreateWithFlags(&waiter, cudaStreamNonBlocking));
  MEGAMOE_ASSERT_CUDA(cudaStreamCreateWithFlags(&signaller, cudaStreamNonBlocking));
  // The waiter starts first; the signaller adds 5 times, 2 ms apart: the wait ends when all 5 have landed.
  wait_kernel<<<1, 1, 0, waiter>>>(counter.get(), 5, record.get(), 2'000'000'000ull, 17, result.get());
  signal_kernel<<<1, 1, 0, signaller>>>(counter.get(), 5, 2'000'000ull);
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(result.download()[0], 1);
  EXPECT_EQ(record.download()[0].code, 0);
  // A target nobody reaches: the wait gives up after its timeout and names itself.
  wait_kernel<<<1, 1, 0, waiter>>>(counter.get(), 6, record.get(), 50'000'000ull, 42, result.get());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(result.download()[0], 0);
  const ep::DeviceError e = record.download()[0];
  EXPECT_EQ(e.code, static_cast<int32_t>(StatusCode::kTimeout));
  EXPECT_EQ(e.what, ep::kErrorWaitTimeout);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.a, 42);
  EXPECT_EQ(e.b, 5);
  EXPECT_EQ(e.c, 6);
  // With the error recorded, a later wait gives up at once instead of waiting out its own timeout.
  cudaEvent_t start, stop;
  MEGAMOE_ASSERT_CUDA(cudaEventCreate(&start));
  MEGAMOE_ASSERT_CUDA(cudaEventCreate(&stop));
  MEGAMOE_ASSERT_CUDA(cudaEventRecord(start, waiter));
  wait_kernel<<<1, 1, 0, waiter>>>(counter.get(), 100, record.get(), 5'000'000'000ull, 43, result.get());
  MEGAMOE_ASSERT_CUDA(cudaEventRecord(stop, waiter));
  MEGAMOE_ASSERT_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  MEGAMOE_ASSERT_CUDA(cudaEventElapsedTime(&ms, start, stop));
  EXPECT_EQ(result.download()[0], 0);
  EXPECT_LT(ms, 1000.0f);
  EXPECT_EQ(record.download()[0].a, 42) << "the first error stays";
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(waiter);
  cudaStreamDestroy(signaller);
}

// ---------------------------------------------------------------- readiness-gated GEMM

// Writes the A rows of each 128-row block from `src` (block order reversed, a pause between blocks), then
// signals the block's counter (release): the gated GEMM must see the rows, never the stale values.
__global__ void produce_rows_kernel(const __nv_bfloat16* src, __nv_bfloat16* a, const int32_t* block_row0,
                                    const int32_t* block_rows, int blocks, int K, uint32_t* counters,
                                    uint64_t pause_ns) {
  for (int b = blocks - 1; b >= 0; --b) {
    const int64_t first = block_row0[b], n = int64_t(block_rows[b]) * K;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) a[first * K + i] = src[first * K + i];
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      signal_add<Scope::kGpu>(&counters[b], 1u);
      const uint64_t start = global_timer_ns();
      while (global_timer_ns() - start < pause_ns) {
      }
    }
    __syncthreads();
  }
}

TEST(BuildingBlocks, ReadinessGatedGemmWaitsForItsRowsAndReportsAMissingBlock) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  using bf16 = __nv_bfloat16;
  ASSERT_TRUE(kernels::grouped_gemm_preload().is_ok());
  cudaFuncAttributes attributes{};  // loaded up front, see the signal/wait test
  MEGAMOE_ASSERT_CUDA(cudaFuncGetAttributes(&attributes, produce_rows_kernel));
  const int E = 5, N = 384, K = 256;
  const std::vector<int> sizes = {300, 0, 129, 512, 77};
  std::vector<int32_t> off(E + 1, 0), block_row0, block_rows;
  for (int e = 0; e < E; ++e) {
    off[e + 1] = off[e] + sizes[e];
    for (int r = 0; r < sizes[e]; r += 128) {
      block_row0.push_back(off[e] + r);
      block_rows.push_back(std::min(128, sizes[e] - r));
    }
  }
  const int rows = off[E], blocks = static_cast<int>(block_row0.size());
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<bf16> a(size_t(rows) * K), b(size_t(E) * N * K);
  for (auto& v : a) v = __float2bfloat16(dist(rng()));
  for (auto& v : b) v = __float2bfloat16(dist(rng()));
  DeviceBuffer<bf16> dSrc(a.size()), dA(a.size()), dB(b.size()), dC(size_t(rows) * N), dRef(size_t(rows) * N);
  DeviceBuffer<int32_t> dOff(off.size()), dRow0(block_row0.size()), dRows(block_rows.size());
  DeviceBuffer<uint32_t> counters(blocks);
  DeviceBuffer<ep::DeviceError> record(1);
  dSrc.upload(a);
  dB.upload(b);
  dOff.upload(off);
  dRow0.upload(block_row0);
  dRows.upload(block_rows);
  // Reference: the ungated product over the final A.
  ASSERT_TRUE(kernels::grouped_gemm_nt(dSrc.get(), dB.get(), dRef.get(), dOff.get(), E, rows, N, K, {}, nullptr).is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto ref = dRef.download();

  cudaStream_t gemm_stream, producer_stream;
  MEGAMOE_ASSERT_CUDA(cudaStreamCreateWithFlags(&gemm_stream, cudaStreamNonBlocking));
  MEGAMOE_ASSERT_CUDA(cudaStreamCreateWithFlags(&producer_stream, cudaStreamNonBlocking));
  kernels::GemmTuning tuning;
  tuning.max_ctas = 32;  // leave SMs for the producer kernel, which must run at the same time
  kernels::GemmReadiness ready;
  ready.counters = counters.get();
  ready.target = 1;
  ready.error = record.get();
  ready.rank = 0;
  ready.timeout_ns = 5'000'000'000ull;
  MEGAMOE_ASSERT_CUDA(cudaMemset(counters.get(), 0, blocks * sizeof(uint32_t)));
  MEGAMOE_ASSERT_CUDA(cudaMemset(record.get(), 0, sizeof(ep::DeviceError)));
  dC.poison();
  dA.poison();  // NaN until the producer writes a block: a tile that loaded early would carry NaN
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_TRUE(kernels::grouped_gemm_nt(dA.get(), dB.get(), dC.get(), dOff.get(), E, rows, N, K, {}, gemm_stream, tuning,
                                       {}, ready)
                  .is_ok());
  produce_rows_kernel<<<1, 256, 0, producer_stream>>>(dSrc.get(), dA.get(), dRow0.get(), dRows.get(), blocks, K,
                                                      counters.get(), 1'000'000ull);
  MEGAMOE_ASSERT_CUDA(cudaGetLastError());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(record.download()[0].code, 0);
  const auto got = dC.download();
  EXPECT_EQ(std::memcmp(got.data(), ref.data(), got.size() * sizeof(bf16)), 0) << "gated GEMM differs";

  // Block 2 is never signalled: its tiles give up after the timeout, the error names the block, no hang.
  std::vector<uint32_t> preset(blocks, 1);
  preset[2] = 0;
  counters.upload(preset);
  MEGAMOE_ASSERT_CUDA(cudaMemset(record.get(), 0, sizeof(ep::DeviceError)));
  ready.timeout_ns = 100'000'000ull;
  ASSERT_TRUE(kernels::grouped_gemm_nt(dSrc.get(), dB.get(), dC.get(), dOff.get(), E, rows, N, K, {}, gemm_stream, tuning,
                                       {}, ready)
                  .is_ok());
  MEGAMOE_ASSERT_CUDA(cudaStreamSynchronize(gemm_stream));
  const ep::DeviceError e = record.download()[0];
  EXPECT_EQ(e.code, static_cast<int32_t>(StatusCode::kTimeout));
  EXPECT_EQ(e.what, ep::kErrorWaitTimeout);
  EXPECT_EQ(e.a, 2);
  EXPECT_EQ(e.b, 0);
  cudaStreamDestroy(gemm_stream);
  cudaStreamDestroy(producer_stream);
}

}  // namespace
}  // namespace megamoe::device
