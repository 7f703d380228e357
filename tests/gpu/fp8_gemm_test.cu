// GPU tests of the blockwise-scaled FP8 GEMM (src/kernels/fp8_gemm.hpp), dense and grouped.
//
// Inputs: random bf16-range values whose magnitude varies by a random power of two per 1 x 128 group of A and
// per 128 x 128 block of B (so a scale applied to the wrong row, group or block is a large error, not a
// rounding-level one), quantized on the CPU with the project's emulation (fp8::quantize_rows_1x128 /
// quantize_blocks_128x128). Expected values follow the arithmetic contract exactly, in double:
//     want[m, n] = sum_kb (sum_{k in kb} qa[m, k] * qb[n, k]) * sa[m, kb] * sb[n / 128, kb]
// (each block sum of e4m3 products is exact in double). Checks: no NaN (outputs are poisoned with NaN before
// the call, so unwritten elements fail), ||got - want|| / ||want|| <= 1e-2, and per element
//     |got - want| <= 2^-7 |want| + 2^-9 mag,   mag[m, n] = sum_kb (sum_k |qa qb|) * |sa sb|
// (bf16 rounding of the output, plus the FP8 tensor cores' limited-precision accumulation inside a K block,
// which is bounded relative to the magnitudes of the summed terms, not to the possibly cancelling sum).
// Rows past M (or outside every expert) are checked to be still poisoned. Fresh random inputs every run
// (the seed is printed).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "gpu/gpu_test_util.hpp"
#include "kernels/fp8_gemm.hpp"
#include "kernels/fp8_quantize.hpp"
#include "megamoe/fp8.hpp"

namespace megamoe::kernels {
namespace {

using bf16 = __nv_bfloat16;
using megamoe::testing::DeviceBuffer;
using megamoe::testing::bits_of;

constexpr double kFrobeniusTol = 1e-2;
constexpr double kRelTol = 1.0 / 128;  // 2^-7
constexpr double kMagTol = 1.0 / 512;  // 2^-9
constexpr int kGuardRows = 64;         // extra output rows that must stay poisoned

std::mt19937_64& rng() {
  static std::mt19937_64 gen = [] {
    const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    std::printf("[fp8_gemm_test] random seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return gen;
}

// A row-major [rows, cols] matrix of bf16-representable values: normal(0, 1) times 2^e, e drawn uniformly
// from [-spread, spread] per block of block_rows x 128 (1 for activation groups, 128 for weight blocks).
std::vector<float> random_blocks(int64_t rows, int64_t cols, int64_t block_rows, int spread) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-spread, spread);
  const int64_t row_blocks = (rows + block_rows - 1) / block_rows, col_blocks = cols / 128;
  std::vector<float> magnitude(static_cast<size_t>(row_blocks * col_blocks));
  for (auto& m : magnitude) m = std::ldexp(1.0f, exponent(rng()));
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float x = normal(rng()) * magnitude[(r / block_rows) * col_blocks + c / 128];
      v[r * cols + c] = __bfloat162float(__float2bfloat16(x));
    }
  return v;
}

// One operand, quantized: e4m3 bytes, their values, the scales.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> value;  // e4m3_to_float(q)
  std::vector<float> scale;
};

Quantized quantize_activations(const std::vector<float>& x, int64_t rows, int64_t cols) {
  Quantized out{std::vector<uint8_t>(x.size()), std::vector<float>(x.size()),
                std::vector<float>(static_cast<size_t>(rows * (cols / 128)))};
  fp8::quantize_rows_1x128(x.data(), rows, cols, out.q.data(), out.scale.data());
  for (size_t i = 0; i < x.size(); ++i) out.value[i] = fp8::e4m3_to_float(out.q[i]);
  return out;
}

Quantized quantize_weights(const std::vector<float>& w, int64_t rows, int64_t cols) {
  Quantized out{std::vector<uint8_t>(w.size()), std::vector<float>(w.size()),
                std::vector<float>(static_cast<size_t>((rows + 127) / 128 * (cols / 128)))};
  fp8::quantize_blocks_128x128(w.data(), rows, cols, out.q.data(), out.scale.data());
  for (size_t i = 0; i < w.size(); ++i) out.value[i] = fp8::e4m3_to_float(out.q[i]);
  return out;
}

// The A scales as the kernel takes them: K-block-major, sa[kb, m] at kb * fp8_scale_pitch(rows) + m; the
// padding is NaN, so a read of it would show.
std::vector<float> k_block_major(const Quantized& a, int64_t rows, int K) {
  const int kb_count = K / 128;
  const int64_t pitch = fp8_scale_pitch(rows);
  std::vector<float> out(static_cast<size_t>(kb_count * pitch), std::nanf(""));
  for (int64_t m = 0; m < rows; ++m)
    for (int kb = 0; kb < kb_count; ++kb) out[kb * pitch + m] = a.scale[m * kb_count + kb];
  return out;
}

// The contract in double for rows [row0, row0 + rows) of A against one weight matrix (b_value [N, K],
// b_scale [ceil(N / 128), K / 128]); want and mag are [rows, N].
void expected(const Quantized& a, int64_t row0, int64_t rows, const float* b_value, const float* b_scale, int N,
              int K, std::vector<double>& want, std::vector<double>& mag) {
  const int kb_count = K / 128;
  want.assign(static_cast<size_t>(rows * N), 0.0);
  mag.assign(static_cast<size_t>(rows * N), 0.0);
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* qa = a.value.data() + (row0 + m) * K;
      const float* sa = a.scale.data() + (row0 + m) * kb_count;
      for (int n = 0; n < N; ++n) {
        const float* qb = b_value + static_cast<int64_t>(n) * K;
        const float* sb = b_scale + static_cast<int64_t>(n / 128) * kb_count;
        double w = 0.0, g = 0.0;
        for (int kb = 0; kb < kb_count; ++kb) {
          double s = 0.0, s_abs = 0.0;
          for (int k = kb * 128; k < kb * 128 + 128; ++k) {
            const double prod = static_cast<double>(qa[k]) * static_cast<double>(qb[k]);
            s += prod;
            s_abs += std::fabs(prod);
          }
          const double scale = static_cast<double>(sa[kb]) * static_cast<double>(sb[kb]);
          w += s * scale;
          g += s_abs * std::fabs(scale);
        }
        want[m * N + n] = w;
        mag[m * N + n] = g;
      }
    }
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), rows));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back(work, rows * t / threads, rows * (t + 1) / threads);
  for (auto& th : pool) th.join();
}

// Compares rows [row0, row0 + rows) of got (N wide) with want / mag of those rows.
struct Comparison {
  double rel_err = 0.0;
  int64_t nan = 0, bad = 0;
  std::string first_bad;
};

Comparison compare(const std::vector<bf16>& got, int64_t row0, int64_t rows, int N, const std::vector<double>& want,
                   const std::vector<double>& mag) {
  Comparison c;
  double num = 0.0, den = 0.0;
  for (int64_t m = 0; m < rows; ++m)
    for (int n = 0; n < N; ++n) {
      const double g = __bfloat162float(got[(row0 + m) * N + n]);
      const double w = want[m * N + n];
      if (std::isnan(g)) {
        ++c.nan;
        continue;
      }
      const double d = std::fabs(g - w);
      num += d * d;
      den += w * w;
      if (!(d <= kRelTol * std::fabs(w) + kMagTol * mag[m * N + n])) {
        if (c.bad++ == 0) {
          c.first_bad = "row " + std::to_string(row0 + m) + " col " + std::to_string(n) + ": got " +
                        std::to_string(g) + " want " + std::to_string(w) + " (mag " + std::to_string(mag[m * N + n]) +
                        ")";
        }
      }
    }
  c.rel_err = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

void expect_close(const Comparison& c, const std::string& what) {
  EXPECT_EQ(c.nan, 0) << what << ": NaN (unwritten or poisoned) outputs";
  EXPECT_LE(c.rel_err, kFrobeniusTol) << what;
  EXPECT_EQ(c.bad, 0) << what << ": first " << c.first_bad;
  std::printf("[fp8_gemm_test] %s: rel err %.3e\n", what.c_str(), c.rel_err);
}

int64_t count_not_nan(const std::vector<bf16>& got, int64_t from, int64_t to) {
  int64_t written = 0;
  for (int64_t i = from; i < to; ++i) written += !std::isnan(__bfloat162float(got[i]));
  return written;
}

// Elements whose bits differ between two downloads of the same buffer size.
int64_t count_bitwise_differences(const std::vector<bf16>& x, const std::vector<bf16>& y) {
  EXPECT_EQ(x.size(), y.size());
  int64_t differ = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    uint16_t a, b;
    std::memcpy(&a, &x[i], 2);
    std::memcpy(&b, &y[i], 2);
    differ += a != b;
  }
  return differ;
}

// A dense problem, run on the GPU and checked; then again (bitwise the same), and in 2-CTA clusters into a
// freshly poisoned buffer (bitwise the same everywhere, rows past M untouched included). spread: the
// exponent range of the per-group / per-block magnitudes.
void run_dense(int64_t M, int N, int K, int spread) {
  const std::string what = "dense M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
  const Quantized a = quantize_activations(random_blocks(M, K, 1, spread), M, K);
  const Quantized b = quantize_weights(random_blocks(N, K, 128, spread), N, K);
  const std::vector<float> sa = k_block_major(a, M, K);
  DeviceBuffer<uint8_t> dA(a.q.size()), dB(b.q.size());
  DeviceBuffer<float> dsa(sa.size()), dsb(b.scale.size());
  DeviceBuffer<bf16> dD(static_cast<size_t>((M + kGuardRows) * N));  // NaN-poisoned
  dA.upload(a.q);
  dB.upload(b.q);
  dsa.upload(sa);
  dsb.upload(b.scale);
  const Status s = fp8_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), M, N, K, nullptr);
  ASSERT_TRUE(s.is_ok()) << what << ": " << s.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<bf16> got = dD.download();
  std::vector<double> want, mag;
  expected(a, 0, M, b.value.data(), b.scale.data(), N, K, want, mag);
  expect_close(compare(got, 0, M, N, want, mag), what);
  EXPECT_EQ(count_not_nan(got, M * N, (M + kGuardRows) * N), 0) << what << ": rows past M were written";

  // Deterministic: a second run gives bitwise the same output.
  const Status again = fp8_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), M, N, K, nullptr);
  ASSERT_TRUE(again.is_ok()) << again.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<bf16> got2 = dD.download();
  EXPECT_EQ(count_bitwise_differences(got, got2), 0) << what << ": two runs differ";

  dD.poison();
  const Status paired = fp8_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), M, N, K, nullptr, Fp8GemmTuning{2, 0});
  ASSERT_TRUE(paired.is_ok()) << what << ", 2-CTA clusters: " << paired.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(count_bitwise_differences(got, dD.download()), 0) << what << ": 2-CTA clusters differ from single CTAs";

  // The promotion overlapped with the next block's wgmma (two partial sums), single CTAs and pairs: the same
  // blocks promoted in the same order, so bitwise the same. Also with 4 CTAs, each walking many tiles (one K
  // block a tile at K = 128, an odd count at 384: every tail form of the overlapped loop, with the ring's
  // phases carried across tiles; rows past M untouched).
  for (const int max_ctas : {0, 4}) {
    for (const int cluster : {1, 2}) {
      dD.poison();
      Fp8GemmTuning overlapped{cluster, max_ctas};
      overlapped.overlap_promotion = true;
      const Status o = fp8_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), M, N, K, nullptr, overlapped);
      ASSERT_TRUE(o.is_ok()) << what << ", overlapped promotion: " << o.to_string();
      MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<bf16> got_o = dD.download();
      EXPECT_EQ(count_bitwise_differences(got, got_o), 0) << what << ": overlapped promotion (cluster " << cluster
                                                           << ", max_ctas " << max_ctas << ") differs from the plain loop";
      EXPECT_EQ(count_not_nan(got_o, M * N, (M + kGuardRows) * N), 0)
          << what << ": overlapped promotion (cluster " << cluster << ", max_ctas " << max_ctas
          << ") wrote rows past M";
    }
  }
}

class Fp8GemmShapes : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(Fp8GemmShapes, DenseMatchesContract) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const auto [M, N, K] = GetParam();
  run_dense(M, N, K, 4);
}

INSTANTIATE_TEST_SUITE_P(Fp8Gemm, Fp8GemmShapes,
                         ::testing::Combine(::testing::Values(1, 100, 128, 300, 1024), ::testing::Values(128, 256, 768),
                                            ::testing::Values(128, 512, 2048)));

// Scales spanning 2^-12 .. 2^12 between rows, groups and blocks: a scale applied to the wrong row, K block
// or weight block is off by orders of magnitude.
TEST(Fp8Gemm, StronglyVaryingScales) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run_dense(300, 384, 1024, 12);
}

// More tiles than SMs (256 tiles of 128 x 128): CTAs walk several tiles, the ring's phases carry over tiles.
TEST(Fp8Gemm, SeveralTilesPerCta) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run_dense(4096, 1024, 384, 4);
}

// One and two K blocks a tile, partial last tiles in both directions, CTAs with many tiles (run_dense's
// max_ctas 4): the overlapped loop's shortest forms.
TEST(Fp8Gemm, ShortTiles) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run_dense(1000, 200, 128, 4);
  run_dense(1000, 200, 256, 4);
}

// N not a multiple of the 128-wide tile: the last tile's weight block has 72 rows.
TEST(Fp8Gemm, PartialLastColumnTile) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  run_dense(300, 200, 256, 4);
}

TEST(Fp8Gemm, GroupedByExpert) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int N = 256, K = 512;
  // An empty expert, a one-row expert, tile-straddling sizes; rows past the last expert must stay untouched.
  const std::vector<int> sizes = {130, 0, 1, 257, 64, 300};
  const int E = static_cast<int>(sizes.size());
  std::vector<int32_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + sizes[e];
  const int64_t rows = offsets[E];
  const int64_t max_rows = rows + kGuardRows + 1;  // not a multiple of 4: the scales' row padding is exercised
  const Quantized a = quantize_activations(random_blocks(max_rows, K, 1, 4), max_rows, K);
  std::vector<uint8_t> qb;
  std::vector<float> vb, sb;
  for (int e = 0; e < E; ++e) {
    const Quantized b = quantize_weights(random_blocks(N, K, 128, 4), N, K);
    qb.insert(qb.end(), b.q.begin(), b.q.end());
    vb.insert(vb.end(), b.value.begin(), b.value.end());
    sb.insert(sb.end(), b.scale.begin(), b.scale.end());
  }
  const size_t sb_per_expert = sb.size() / E;
  const std::vector<float> sa = k_block_major(a, max_rows, K);
  DeviceBuffer<uint8_t> dA(a.q.size()), dB(qb.size());
  DeviceBuffer<float> dsa(sa.size()), dsb(sb.size());
  DeviceBuffer<int32_t> doff(offsets.size());
  DeviceBuffer<bf16> dD(static_cast<size_t>(max_rows * N));
  dA.upload(a.q);
  dB.upload(qb);
  dsa.upload(sa);
  dsb.upload(sb);
  doff.upload(offsets);
  const Status s =
      fp8_grouped_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), doff.get(), E, max_rows, N, K, nullptr);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<bf16> got = dD.download();
  for (int e = 0; e < E; ++e) {
    if (sizes[e] == 0) continue;
    std::vector<double> want, mag;
    expected(a, offsets[e], sizes[e], vb.data() + static_cast<size_t>(e) * N * K, sb.data() + e * sb_per_expert, N, K,
             want, mag);
    expect_close(compare(got, offsets[e], sizes[e], N, want, mag), "grouped expert " + std::to_string(e));
  }
  EXPECT_EQ(count_not_nan(got, rows * N, max_rows * N), 0) << "rows outside every expert were written";

  // 2-CTA clusters (odd tile counts leave a CTA of a pair past its expert's rows): bitwise the same, the
  // rows outside every expert untouched.
  dD.poison();
  const Status paired = fp8_grouped_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), doff.get(), E,
                                            max_rows, N, K, nullptr, Fp8GemmTuning{2, 0});
  ASSERT_TRUE(paired.is_ok()) << paired.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(count_bitwise_differences(got, dD.download()), 0) << "2-CTA clusters differ from single CTAs";

  // The overlapped promotion (empty experts), and both loops on CTAs that take several tiles (max_ctas 3 and 4:
  // each tile starts where the previous one left the ring, and its slices leave through TMA or, the
  // tile-straddling experts' partial ones, through the threads, tile after tile through the same staging boxes):
  // bitwise the whole grid's plain loop; the rows outside every expert untouched.
  for (const bool overlap : {true, false}) {
    for (const auto& [cluster, max_ctas] : {std::pair{1, 0}, std::pair{2, 0}, std::pair{1, 3}, std::pair{2, 4}}) {
      if (!overlap && max_ctas == 0) continue;  // the calls above
      dD.poison();
      Fp8GemmTuning tuning{cluster, max_ctas};
      tuning.overlap_promotion = overlap;
      const Status o = fp8_grouped_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), doff.get(), E,
                                           max_rows, N, K, nullptr, tuning);
      ASSERT_TRUE(o.is_ok()) << o.to_string();
      MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<bf16> o_out = dD.download();
      const char* loop = overlap ? "overlapped promotion" : "the plain loop";
      EXPECT_EQ(count_bitwise_differences(got, o_out), 0)
          << loop << " (cluster " << cluster << ", max_ctas " << max_ctas << ") differs from the whole grid's plain loop";
      EXPECT_EQ(count_not_nan(o_out, rows * N, max_rows * N), 0)
          << loop << " (cluster " << cluster << ", max_ctas " << max_ctas << ") wrote rows outside every expert";
    }
  }

  // Rows by index, as the layer runs it: A's rows (and their scales, row-major) gathered from a shuffled,
  // larger source, D's rows stored through a pointer each into a shuffled destination. Every expert row must
  // come out bitwise as above; destination rows no pointer names stay poisoned.
  const int64_t source_rows = max_rows + 7;
  std::vector<int32_t> order(static_cast<size_t>(source_rows));
  for (int64_t i = 0; i < source_rows; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), rng());
  std::vector<int32_t> a_rows(static_cast<size_t>(max_rows)), dest(static_cast<size_t>(max_rows));
  std::vector<uint8_t> source_q(static_cast<size_t>(source_rows * K), 0);
  std::vector<float> source_scale(static_cast<size_t>(source_rows * (K / 128)), std::nanf(""));
  for (int64_t r = 0; r < max_rows; ++r) {
    a_rows[r] = order[r];
    dest[r] = order[source_rows - 1 - r];  // another permutation of the rows
    std::copy_n(a.q.begin() + r * K, K, source_q.begin() + int64_t{order[r]} * K);
    std::copy_n(a.scale.begin() + r * (K / 128), K / 128, source_scale.begin() + int64_t{order[r]} * (K / 128));
  }
  DeviceBuffer<uint8_t> dSq(source_q.size());
  DeviceBuffer<float> dSs(source_scale.size());
  DeviceBuffer<int32_t> dRows(a_rows.size());
  DeviceBuffer<bf16> dOut(static_cast<size_t>(source_rows * N));  // NaN-poisoned
  dSq.upload(source_q);
  dSs.upload(source_scale);
  dRows.upload(a_rows);
  std::vector<void*> pointers(static_cast<size_t>(max_rows), nullptr);
  for (int64_t r = 0; r < rows; ++r) pointers[r] = dOut.get() + int64_t{dest[r]} * N;
  DeviceBuffer<void*> dPointers(pointers.size());
  dPointers.upload(pointers);
  Fp8GemmRows by_index;
  by_index.a_rows = dRows.get();
  by_index.a_source_rows = source_rows;
  by_index.d_rows = dPointers.get();
  const Status gathered = fp8_grouped_gemm_nt(dSq.get(), dSs.get(), dB.get(), dsb.get(), nullptr, doff.get(), E,
                                              max_rows, N, K, nullptr, Fp8GemmTuning{}, by_index);
  ASSERT_TRUE(gathered.is_ok()) << gathered.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<bf16> out = dOut.download();
  std::vector<bf16> want(out), seen(out);  // the named rows of both, in row order; the rest dropped
  std::vector<bool> named(static_cast<size_t>(source_rows), false);
  for (int64_t r = 0; r < rows; ++r) named[dest[r]] = true;
  want.resize(static_cast<size_t>(rows * N));
  seen.resize(static_cast<size_t>(rows * N));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(got.begin() + r * N, N, want.begin() + r * N);
    std::copy_n(out.begin() + int64_t{dest[r]} * N, N, seen.begin() + r * N);
  }
  EXPECT_EQ(count_bitwise_differences(want, seen), 0)
      << "gathered A rows / D rows through pointers differ from the contiguous call";
  int64_t unnamed_written = 0;
  for (int64_t d = 0; d < source_rows; ++d) {
    if (!named[d]) unnamed_written += count_not_nan(out, d * N, (d + 1) * N);
  }
  EXPECT_EQ(unnamed_written, 0) << "rows no pointer names were written";

  // The call on single CTAs, max_ctas of them (the layer's tuning), with the overlapped promotion (or the plain
  // loop), on A and sa.
  const auto single_cta_call = [&](int max_ctas, const uint8_t* A, const float* sa, const Fp8GemmRows& rows_by,
                                   bool overlap = true) {
    Fp8GemmTuning tuning{1, max_ctas};
    tuning.overlap_promotion = overlap;
    return fp8_grouped_gemm_nt(A, sa, dB.get(), dsb.get(), nullptr, doff.get(), E, max_rows, N, K, nullptr, tuning,
                               rows_by);
  };

  // The same gathered call with the overlapped promotion (and with CTAs that take several tiles): bitwise the
  // same rows.
  for (const int max_ctas : {0, 3}) {
    dOut.poison();
    const Status gathered_o = single_cta_call(max_ctas, dSq.get(), dSs.get(), by_index);
    ASSERT_TRUE(gathered_o.is_ok()) << gathered_o.to_string();
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<bf16> out_o = dOut.download();
    for (int64_t r = 0; r < rows; ++r) std::copy_n(out_o.begin() + int64_t{dest[r]} * N, N, seen.begin() + r * N);
    EXPECT_EQ(count_bitwise_differences(want, seen), 0)
        << "gathered rows with the overlapped promotion differ (max_ctas " << max_ctas << ")";
  }

  // D rows through their pointers from the contiguous A, as the layer's GEMM2 and dgrad run it, with either
  // loop and with CTAs that take several tiles (every slice leaves through the threads): bitwise the
  // contiguous call's rows; rows no pointer names stay untouched.
  for (const bool overlap : {true, false}) {
    for (const int max_ctas : {0, 3}) {
      dOut.poison();
      Fp8GemmRows rows_only;
      rows_only.d_rows = dPointers.get();
      const Status by_pointer = single_cta_call(max_ctas, dA.get(), dsa.get(), rows_only, overlap);
      ASSERT_TRUE(by_pointer.is_ok()) << by_pointer.to_string();
      MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<bf16> out_p = dOut.download();
      for (int64_t r = 0; r < rows; ++r) std::copy_n(out_p.begin() + int64_t{dest[r]} * N, N, seen.begin() + r * N);
      EXPECT_EQ(count_bitwise_differences(want, seen), 0) << "D rows through pointers from the contiguous A differ ("
                                                          << (overlap ? "overlapped" : "plain") << " loop, max_ctas "
                                                          << max_ctas << ")";
      int64_t unnamed = 0;
      for (int64_t d = 0; d < source_rows; ++d) {
        if (!named[d]) unnamed += count_not_nan(out_p, d * N, (d + 1) * N);
      }
      EXPECT_EQ(unnamed, 0) << "rows no pointer names were written (" << (overlap ? "overlapped" : "plain")
                            << " loop, max_ctas " << max_ctas << ")";
    }
  }

  // D in fp32 (gathered A as above): rounded to bf16 it gives the bf16 call's bits; rows outside every
  // expert stay untouched.
  DeviceBuffer<float> dD32(static_cast<size_t>(max_rows * N));  // NaN-poisoned
  Fp8GemmRows unrounded;
  unrounded.a_rows = dRows.get();
  unrounded.a_source_rows = source_rows;
  unrounded.d_fp32 = dD32.get();
  const Status wide = fp8_grouped_gemm_nt(dSq.get(), dSs.get(), dB.get(), dsb.get(), nullptr, doff.get(), E, max_rows,
                                          N, K, nullptr, Fp8GemmTuning{}, unrounded);
  ASSERT_TRUE(wide.is_ok()) << wide.to_string();
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> d32 = dD32.download();
  std::vector<bf16> rounded(static_cast<size_t>(rows * N));
  for (int64_t i = 0; i < rows * N; ++i) rounded[i] = __float2bfloat16(d32[i]);
  std::vector<bf16> got_rows(got.begin(), got.begin() + rows * N);
  EXPECT_EQ(count_bitwise_differences(got_rows, rounded), 0) << "fp32 D, rounded, differs from the bf16 D";
  int64_t written_outside = 0;
  for (int64_t i = rows * N; i < max_rows * N; ++i) written_outside += !std::isnan(d32[i]);
  EXPECT_EQ(written_outside, 0) << "fp32 D rows outside every expert were written";

  // fp32 D from the contiguous A through TMA, as the layer's dgrad runs it (whole slices leave in TMA boxes,
  // the rest through the threads), with the overlapped promotion, and with CTAs that take several tiles (the
  // staging boxes reused while earlier stores drain): bitwise the gathered call's fp32 D.
  for (const int max_ctas : {0, 3}) {
    dD32.poison();
    Fp8GemmRows fp32_only;
    fp32_only.d_fp32 = dD32.get();
    const Status contiguous = single_cta_call(max_ctas, dA.get(), dsa.get(), fp32_only);
    ASSERT_TRUE(contiguous.is_ok()) << contiguous.to_string();
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> d32_tma = dD32.download();
    int64_t differ = 0, outside = 0;
    for (int64_t i = 0; i < rows * N; ++i) differ += bits_of(d32_tma[i]) != bits_of(d32[i]);
    for (int64_t i = rows * N; i < max_rows * N; ++i) outside += !std::isnan(d32_tma[i]);
    EXPECT_EQ(differ, 0) << "fp32 D from the contiguous A differs (max_ctas " << max_ctas << ")";
    EXPECT_EQ(outside, 0) << "fp32 D rows outside every expert were written (max_ctas " << max_ctas << ")";
  }
}

// GEMM1 of the FP8 layer with its SwiGLU epilogue (Fp8GemmRows::swiglu_a_q): W13 [E, 2I, K] of gate rows then
// up rows. Its h must be bitwise the plain fp32 call's (itself checked against the contract above), and its a
// codes and scales bitwise swiglu_quantize_rows_1x128 of that h (checked against the exact activation in
// fp8_quantize_test.cu); rows outside every expert stay poisoned in h, a and the scales. Experts: empty,
// one row, tile-straddling; I of one, three and six 128-channel groups; both K loops, single CTAs and 2-CTA
// pairs (an odd tile count leaves a CTA of a pair past its expert's rows); CTAs that take one item and CTAs that
// take several (staging boxes and the ring reused across items).
TEST(Fp8Gemm, SwigluEpilogueEmitsQuantizedA) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int K = 256;
  const std::vector<int> sizes = {130, 0, 1, 257, 64, 300};
  const int E = static_cast<int>(sizes.size());
  std::vector<int32_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + sizes[e];
  const int64_t rows = offsets[E];
  const int64_t max_rows = rows + kGuardRows + 1;
  const int64_t pitch = fp8_scale_pitch(max_rows);
  const Quantized a = quantize_activations(random_blocks(max_rows, K, 1, 4), max_rows, K);
  const std::vector<float> sa = k_block_major(a, max_rows, K);
  DeviceBuffer<uint8_t> dA(a.q.size());
  DeviceBuffer<float> dsa(sa.size());
  DeviceBuffer<int32_t> doff(offsets.size());
  dA.upload(a.q);
  dsa.upload(sa);
  doff.upload(offsets);
  for (const int I : {128, 384, 768}) {
    SCOPED_TRACE("I " + std::to_string(I));
    const int N = 2 * I;
    std::vector<uint8_t> qb;
    std::vector<float> sb;
    for (int e = 0; e < E; ++e) {
      const Quantized b = quantize_weights(random_blocks(N, K, 128, 4), N, K);
      qb.insert(qb.end(), b.q.begin(), b.q.end());
      sb.insert(sb.end(), b.scale.begin(), b.scale.end());
    }
    DeviceBuffer<uint8_t> dB(qb.size());
    DeviceBuffer<float> dsb(sb.size());
    dB.upload(qb);
    dsb.upload(sb);
    // The twin: h from the plain call, a from the separate kernel over the expert rows.
    DeviceBuffer<float> h_twin(static_cast<size_t>(max_rows * N));
    DeviceBuffer<uint8_t> aq_twin(static_cast<size_t>(max_rows * I));
    DeviceBuffer<float> as_twin(static_cast<size_t>(pitch * (I / 128)));
    Fp8GemmRows plain;
    plain.d_fp32 = h_twin.get();
    const Status twin = fp8_grouped_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), nullptr, doff.get(), E,
                                            max_rows, N, K, nullptr, Fp8GemmTuning{}, plain);
    ASSERT_TRUE(twin.is_ok()) << twin.to_string();
    ASSERT_TRUE(swiglu_quantize_rows_1x128(h_twin.get(), max_rows, I, doff.get() + E, aq_twin.get(), as_twin.get(),
                                           pitch, nullptr)
                    .is_ok());
    MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> h_want = h_twin.download();
    const std::vector<uint8_t> aq_want = aq_twin.download();
    const std::vector<float> as_want = as_twin.download();
    int64_t zero_scales = 0;  // a scale of 1 from an all-zero group would hide a wrong group; expect none
    for (int64_t r = 0; r < rows; ++r) zero_scales += as_want[r] == 1.0f;
    EXPECT_EQ(zero_scales, 0);

    DeviceBuffer<float> h(static_cast<size_t>(max_rows * N));
    DeviceBuffer<uint8_t> aq(static_cast<size_t>(max_rows * I));
    DeviceBuffer<float> as(static_cast<size_t>(pitch * (I / 128)));
    for (const auto& [cluster, max_ctas] : {std::pair{1, 0}, std::pair{1, 3}, std::pair{2, 0}, std::pair{2, 4}})
      for (const bool overlap : {false, true}) {
        SCOPED_TRACE(std::string(overlap ? "overlapped" : "plain") + " loop, cluster " + std::to_string(cluster) +
                     ", max_ctas " + std::to_string(max_ctas));
        h.poison();
        aq.poison();
        as.poison();
        Fp8GemmTuning tuning{cluster, max_ctas};
        tuning.overlap_promotion = overlap;
        Fp8GemmRows fused;
        fused.d_fp32 = h.get();
        fused.swiglu_a_q = aq.get();
        fused.swiglu_a_s = as.get();
        fused.swiglu_a_s_pitch = pitch;
        const Status st = fp8_grouped_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), nullptr, doff.get(), E,
                                              max_rows, N, K, nullptr, tuning, fused);
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
        const std::vector<float> h_got = h.download();
        const std::vector<uint8_t> aq_got = aq.download();
        const std::vector<float> as_got = as.download();
        int64_t h_differ = 0, h_outside = 0, aq_differ = 0, aq_outside = 0, as_differ = 0, as_outside = 0;
        for (int64_t i = 0; i < rows * N; ++i) h_differ += bits_of(h_got[i]) != bits_of(h_want[i]);
        for (int64_t i = rows * N; i < max_rows * N; ++i) h_outside += !std::isnan(h_got[i]);
        for (int64_t i = 0; i < rows * I; ++i) aq_differ += aq_got[i] != aq_want[i];
        for (int64_t i = rows * I; i < max_rows * I; ++i) aq_outside += aq_got[i] != 0xFF;
        for (int q = 0; q < I / 128; ++q) {
          for (int64_t r = 0; r < rows; ++r) as_differ += bits_of(as_got[q * pitch + r]) != bits_of(as_want[q * pitch + r]);
          for (int64_t r = rows; r < pitch; ++r) as_outside += !std::isnan(as_got[q * pitch + r]);
        }
        EXPECT_EQ(h_differ, 0) << "h differs from the plain fp32 call";
        EXPECT_EQ(aq_differ, 0) << "a's codes differ from swiglu_quantize_rows_1x128";
        EXPECT_EQ(as_differ, 0) << "a's scales differ from swiglu_quantize_rows_1x128";
        EXPECT_EQ(h_outside + aq_outside + as_outside, 0) << "rows outside every expert were written";
      }
  }
}

TEST(Fp8Gemm, EmptyInputsAreNoOps) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int N = 128, K = 128;
  DeviceBuffer<uint8_t> dB(N * K);
  DeviceBuffer<float> dsb(1);
  DeviceBuffer<bf16> dD(N);
  EXPECT_TRUE(fp8_gemm_nt(nullptr, nullptr, dB.get(), dsb.get(), nullptr, 0, N, K, nullptr).is_ok());
  DeviceBuffer<uint8_t> dA(N * K);
  DeviceBuffer<float> dsa(fp8_scale_pitch(1));
  DeviceBuffer<int32_t> doff(2);
  doff.upload({0, 0});
  EXPECT_TRUE(
      fp8_grouped_gemm_nt(dA.get(), dsa.get(), dB.get(), dsb.get(), dD.get(), doff.get(), 1, 1, N, K, nullptr).is_ok());
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(count_not_nan(dD.download(), 0, N), 0) << "an empty expert wrote its output";
}

TEST(Fp8Gemm, RejectsBadArguments) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int M = 128, N = 128, K = 256;
  DeviceBuffer<uint8_t> dA(M * K), dB(N * K);
  DeviceBuffer<float> dsa(fp8_scale_pitch(M) * 2), dsb(2);
  DeviceBuffer<bf16> dD(M * N);
  DeviceBuffer<int32_t> doff(2);
  doff.upload({0, M});
  auto expect_invalid = [](const Status& s, const char* fragment) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
  };
  uint8_t* A = dA.get();
  uint8_t* B = dB.get();
  float* sa = dsa.get();
  float* sb = dsb.get();
  bf16* D = dD.get();
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, M, N, 200, nullptr), "multiple of 128");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, M, N, 0, nullptr), "multiple of 128");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, M, 100, K, nullptr), "multiple of 8");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, M, 0, K, nullptr), "multiple of 8");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, -1, N, K, nullptr), "M must be");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, int64_t{1} << 31, N, K, nullptr), "M must be");
  expect_invalid(fp8_gemm_nt(nullptr, sa, B, sb, D, M, N, K, nullptr), "A is null");
  expect_invalid(fp8_gemm_nt(A, nullptr, B, sb, D, M, N, K, nullptr), "sa is null");
  expect_invalid(fp8_gemm_nt(A, sa, nullptr, sb, D, M, N, K, nullptr), "B is null");
  expect_invalid(fp8_gemm_nt(A, sa, B, nullptr, D, M, N, K, nullptr), "sb is null");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, nullptr, M, N, K, nullptr), "D is null");
  expect_invalid(fp8_gemm_nt(A + 1, sa, B, sb, D, M, N, K, nullptr), "A must be 16-byte aligned");
  expect_invalid(fp8_gemm_nt(A, sa + 1, B, sb, D, M, N, K, nullptr), "sa must be 16-byte aligned");
  expect_invalid(fp8_gemm_nt(A, sa, B + 8, sb, D, M, N, K, nullptr), "B must be 16-byte aligned");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb + 2, D, M, N, K, nullptr), "sb must be 16-byte aligned");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D + 4, M, N, K, nullptr), "D must be 16-byte aligned");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 0, M, N, K, nullptr), "num_experts");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1025, M, N, K, nullptr), "num_experts");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, nullptr, 1, M, N, K, nullptr), "expert_offsets is null");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N, 64, nullptr), "multiple of 128");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, -5, N, K, nullptr), "max_rows must be");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, M, N, K, nullptr, Fp8GemmTuning{3, 0}), "cluster_size must be 1 or 2");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N, K, nullptr, Fp8GemmTuning{0, 0}),
                 "cluster_size must be 1 or 2");
  expect_invalid(fp8_gemm_nt(A, sa, B, sb, D, M, N, K, nullptr, Fp8GemmTuning{1, -1}), "max_ctas");
  Fp8GemmRows gather;
  gather.a_rows = doff.get();
  gather.a_source_rows = 0;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N, K, nullptr, Fp8GemmTuning{}, gather), "a_source_rows");
  gather.a_source_rows = M;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N, K, nullptr, Fp8GemmTuning{2, 0}, gather),
                 "gathered A rows need cluster_size 1");
  const float* sa_odd = reinterpret_cast<const float*>(reinterpret_cast<const char*>(sa) + 2);
  expect_invalid(fp8_grouped_gemm_nt(A, sa_odd, B, sb, D, doff.get(), 1, M, N, K, nullptr, Fp8GemmTuning{}, gather),
                 "sa must be 4-byte aligned");
  expect_invalid(fp8_grouped_gemm_nt(A, nullptr, B, sb, D, doff.get(), 1, M, N, K, nullptr, Fp8GemmTuning{}, gather),
                 "sa is null");
  // The SwiGLU epilogue's outputs and what it needs (N = 2I below holds I = 64: not a 128-channel group).
  DeviceBuffer<float> dh(static_cast<size_t>(M) * 2 * N);
  DeviceBuffer<uint8_t> daq(static_cast<size_t>(M) * N);
  DeviceBuffer<float> das(static_cast<size_t>(fp8_scale_pitch(M)) * 2);
  Fp8GemmRows swiglu;
  swiglu.d_fp32 = dh.get();
  swiglu.swiglu_a_q = daq.get();
  swiglu.swiglu_a_s = das.get();
  swiglu.swiglu_a_s_pitch = M;
  const int N2 = 2 * N;
  Fp8GemmRows bad = swiglu;
  bad.swiglu_a_s = nullptr;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N2, K, nullptr, Fp8GemmTuning{}, bad), "go together");
  bad = swiglu;
  bad.d_fp32 = nullptr;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N2, K, nullptr, Fp8GemmTuning{}, bad), "needs d_fp32");
  bad = swiglu;
  bad.swiglu_a_q = daq.get() + 4;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N2, K, nullptr, Fp8GemmTuning{}, bad),
                 "swiglu_a_q must be 16-byte aligned");
  bad = swiglu;
  bad.swiglu_a_s = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(das.get()) + 2);
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N2, K, nullptr, Fp8GemmTuning{}, bad),
                 "swiglu_a_s must be 4-byte aligned");
  bad = swiglu;
  bad.swiglu_a_s_pitch = M - 1;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N2, K, nullptr, Fp8GemmTuning{}, bad), "swiglu_a_s_pitch");
  bad = swiglu;
  bad.a_rows = doff.get();
  bad.a_source_rows = M;
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N2, K, nullptr, Fp8GemmTuning{}, bad), "no a_rows");
  expect_invalid(fp8_grouped_gemm_nt(A, sa, B, sb, D, doff.get(), 1, M, N, K, nullptr, Fp8GemmTuning{}, swiglu),
                 "I a multiple of 128");
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  {
    const std::vector<float> h_after = dh.download();
    int64_t touched = 0;
    for (const float v : h_after) touched += !std::isnan(v);
    EXPECT_EQ(touched, 0) << "a refused SwiGLU call wrote h";
  }
  // Nothing above may have launched anything: the poisoned output is untouched.
  MEGAMOE_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(count_not_nan(dD.download(), 0, int64_t{M} * N), 0);
}

}  // namespace
}  // namespace megamoe::kernels
