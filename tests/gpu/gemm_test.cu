// GPU correctness tests of the grouped-GEMM engine (src/kernels/grouped_gemm.hpp), all three forms and
// every epilogue. Reference: a naive fp32 GPU kernel (one thread per output element, sequential sum over
// K), itself checked against a CPU double reference on small sizes; epilogues are applied on the host in
// double from the reference's fp32 result. Fresh random inputs every run (the seed is printed), outputs
// poisoned with NaN (0xFF bytes) before every run, random group sizes including 0 and sizes that are not
// multiples of the 128-row tile, rel err ||C - ref|| / ||ref|| <= 1e-2, NaN never passes, and rows the
// engine must not write are checked to be still poisoned.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "gpu/gpu_test_util.hpp"
#include "kernels/grouped_gemm.hpp"

namespace megamoe::kernels {
namespace {

using bf16 = __nv_bfloat16;
using megamoe::testing::DeviceBuffer;

constexpr double kTol = 1e-2;

std::mt19937_64& rng() {
  static std::mt19937_64 gen = [] {
    const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    std::printf("[gemm_test] random seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return gen;
}

std::vector<bf16> random_bf16(size_t n, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = __float2bfloat16(dist(rng()));
  return v;
}

std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// Random group sizes: some zero, most not multiples of 128.
std::vector<int> random_groups(int E, int max_rows_per_group) {
  std::uniform_int_distribution<int> dist(1, max_rows_per_group);
  std::vector<int> sizes(E);
  for (int e = 0; e < E; ++e) sizes[e] = dist(rng());
  sizes[0] = 0;                 // an empty first expert
  if (E > 3) sizes[E / 2] = 0;  // and one in the middle
  if (E > 4) sizes[E - 2] = 1;  // a single row
  if (E > 5) sizes[1] = 128;    // exactly one tile
  if (E > 6) sizes[2] = 129;    // one tile and one row
  std::shuffle(sizes.begin() + 3, sizes.end(), rng());
  return sizes;
}

std::vector<int32_t> prefix(const std::vector<int>& sizes) {
  std::vector<int32_t> off(sizes.size() + 1, 0);
  for (size_t e = 0; e < sizes.size(); ++e) off[e + 1] = off[e] + sizes[e];
  return off;
}

struct Err {
  double rel = 0;
  int64_t nan = 0;
  int64_t count = 0;
};

void accumulate_err(Err& err, double& num, double& den, double got, double ref) {
  if (!std::isfinite(got)) ++err.nan;
  num += (got - ref) * (got - ref);
  den += ref * ref;
  ++err.count;
}

// ---------------------------------------------------------------- naive GPU reference

// Form 1 (b_kmajor) / form 2: out[r, n] = sum_k A[r, k] * B[e(r)][n, k] (or B[e(r)][k, n]), fp32.
__global__ void ref_m_grouped(const bf16* A, const bf16* B, float* out, const int32_t* off, int E, int N, int K,
                              bool b_kmajor) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (n >= N || r >= off[E]) return;
  int e = 0;
  while (e + 1 < E && off[e + 1] <= r) ++e;
  const bf16* a = A + static_cast<int64_t>(r) * K;
  const bf16* b = B + static_cast<int64_t>(e) * N * K;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) {
    const float bv = b_kmajor ? __bfloat162float(b[static_cast<int64_t>(n) * K + k])
                              : __bfloat162float(b[static_cast<int64_t>(k) * N + n]);
    acc = fmaf(__bfloat162float(a[k]), bv, acc);
  }
  out[static_cast<int64_t>(r) * N + n] = acc;
}

// Form 3: out[e, m, n] = sum over rows r of e of A[r, m] * B[r, n], fp32.
__global__ void ref_k_grouped(const bf16* A, const bf16* B, float* out, const int32_t* off, int M, int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  const int m = blockIdx.y;
  const int e = blockIdx.z;
  if (n >= N) return;
  float acc = 0.0f;
  for (int r = off[e]; r < off[e + 1]; ++r) {
    acc = fmaf(__bfloat162float(A[static_cast<int64_t>(r) * M + m]),
               __bfloat162float(B[static_cast<int64_t>(r) * N + n]), acc);
  }
  out[(static_cast<int64_t>(e) * M + m) * N + n] = acc;
}

std::vector<float> run_ref_m(const DeviceBuffer<bf16>& A, const DeviceBuffer<bf16>& B, const DeviceBuffer<int32_t>& off,
                             int E, int total_rows, int N, int K, bool b_kmajor) {
  DeviceBuffer<float> out(static_cast<size_t>(std::max(total_rows, 1)) * N);
  if (total_rows > 0) {
    dim3 grid((N + 127) / 128, total_rows);
    ref_m_grouped<<<grid, 128>>>(A.get(), B.get(), out.get(), off.get(), E, N, K, b_kmajor);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto v = out.download();
  v.resize(static_cast<size_t>(total_rows) * N);
  return v;
}

std::vector<float> run_ref_k(const DeviceBuffer<bf16>& A, const DeviceBuffer<bf16>& B, const DeviceBuffer<int32_t>& off,
                             int E, int M, int N) {
  DeviceBuffer<float> out(static_cast<size_t>(E) * M * N);
  dim3 grid((N + 127) / 128, M, E);
  ref_k_grouped<<<grid, 128>>>(A.get(), B.get(), out.get(), off.get(), M, N);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out.download();
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

bool is_poisoned_bf16(bf16 v) {
  uint16_t bits;
  std::memcpy(&bits, &v, 2);
  return bits == 0xFFFF;
}

// ---------------------------------------------------------------- the reference checks itself

TEST(GroupedGemm, NaiveReferenceMatchesCpuDouble) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int E = 3, N = 40, K = 24, M = 16;
  const std::vector<int> sizes = {5, 0, 70};
  const auto off = prefix(sizes);
  const int rows = off[E];
  const auto a = random_bf16(static_cast<size_t>(rows) * K), b = random_bf16(static_cast<size_t>(E) * N * K);
  DeviceBuffer<bf16> dA(a.size()), dB(b.size());
  DeviceBuffer<int32_t> dOff(off.size());
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  const auto fa = to_float(a), fb = to_float(b);
  for (bool kmajor : {true, false}) {
    const auto got = run_ref_m(dA, dB, dOff, E, rows, N, K, kmajor);
    for (int e = 0; e < E; ++e)
      for (int r = off[e]; r < off[e + 1]; ++r)
        for (int n = 0; n < N; ++n) {
          double s = 0;
          for (int k = 0; k < K; ++k)
            s += double(fa[size_t(r) * K + k]) *
                 (kmajor ? fb[(size_t(e) * N + n) * K + k] : fb[(size_t(e) * K + k) * N + n]);
          ASSERT_NEAR(got[size_t(r) * N + n], s, 1e-4 * (1 + std::fabs(s)));
        }
  }
  // form 3 reference: A [rows, M], B [rows, N]
  const auto a3 = random_bf16(static_cast<size_t>(rows) * M), b3 = random_bf16(static_cast<size_t>(rows) * N);
  DeviceBuffer<bf16> dA3(a3.size()), dB3(b3.size());
  dA3.upload(a3);
  dB3.upload(b3);
  const auto got3 = run_ref_k(dA3, dB3, dOff, E, M, N);
  const auto fa3 = to_float(a3), fb3 = to_float(b3);
  for (int e = 0; e < E; ++e)
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        double s = 0;
        for (int r = off[e]; r < off[e + 1]; ++r) s += double(fa3[size_t(r) * M + m]) * fb3[size_t(r) * N + n];
        ASSERT_NEAR(got3[(size_t(e) * M + m) * N + n], s, 1e-4 * (1 + std::fabs(s)));
      }
}

// ---------------------------------------------------------------- forms 1 and 2, plain / scale / scatter

struct MGroupedCase {
  int E, max_per_group, N, K;
  bool scale, scatter;
};

// Every launch shape of forms 1 and 2: tile 256 with clusters of 1 and 2 and tile 128, each store mode
// (they must give the same C).
std::vector<GemmTuning> all_tunings() {
  std::vector<GemmTuning> t;
  for (int tile_n : {256, 128})
    for (int cluster : {1, 2})
      for (GemmStoreMode m : {GemmStoreMode::kThreads, GemmStoreMode::kTmaTile}) {
        if (tile_n == 128 && cluster == 2) continue;
        GemmTuning g;
        g.cluster_size = cluster;
        g.store = m;
        g.tile_n = tile_n;
        t.push_back(g);
      }
  return t;
}

// A's rows scattered into a larger source tensor by a random permutation, and the index that gathers them
// back: a GEMM over the gathered rows must give bitwise the result over A itself.
struct GatheredRows {
  std::vector<bf16> source;
  std::vector<int32_t> index;
};
GatheredRows scatter_rows_randomly(const std::vector<bf16>& a, int rows, int cols, int extra_rows) {
  GatheredRows g;
  const int source_rows = rows + extra_rows;
  std::vector<int32_t> perm(source_rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng());
  g.source = random_bf16(size_t(source_rows) * cols);  // rows no index points at hold other values
  g.index.assign(perm.begin(), perm.begin() + rows);
  for (int r = 0; r < rows; ++r)
    std::memcpy(&g.source[size_t(perm[r]) * cols], &a[size_t(r) * cols], size_t(cols) * sizeof(bf16));
  return g;
}

// The same on the device: the source tensor, the index, and the gather they make for an A operand.
struct DeviceGatheredRows {
  DeviceBuffer<bf16> source;
  DeviceBuffer<int32_t> index;
  int64_t source_rows = 0;
  GemmGather as_a() const {
    GemmGather g;
    g.a_rows = index.get();
    g.a_source_rows = source_rows;
    return g;
  }
};
DeviceGatheredRows upload_rows_randomly(const std::vector<bf16>& a, int rows, int cols, int extra_rows) {
  const GatheredRows g = scatter_rows_randomly(a, rows, cols, extra_rows);
  DeviceGatheredRows d{DeviceBuffer<bf16>(g.source.size()), DeviceBuffer<int32_t>(g.index.size()), rows + extra_rows};
  d.source.upload(g.source);
  d.index.upload(g.index);
  return d;
}

void run_m_grouped_plain(bool nt, const MGroupedCase& c, const GemmTuning& tuning) {
  const auto sizes = random_groups(c.E, c.max_per_group);
  const auto off = prefix(sizes);
  const int rows = off[c.E];
  const int max_rows = rows + 37;  // capacity beyond the routed rows: never read into outputs, never written
  auto a = random_bf16(static_cast<size_t>(max_rows) * c.K);
  // Poison the unused capacity rows of A with NaN: they are loaded by the last tile but must never be stored.
  for (size_t i = static_cast<size_t>(rows) * c.K; i < a.size(); ++i) a[i] = __float2bfloat16(NAN);
  const auto b = random_bf16(static_cast<size_t>(c.E) * c.N * c.K);
  std::vector<float> scale(max_rows);
  std::uniform_real_distribution<float> sd(0.25f, 2.0f);
  for (auto& s : scale) s = sd(rng());
  std::vector<int32_t> scatter(max_rows, -1);
  const int dst_rows = rows + 5;
  if (c.scatter) {
    std::vector<int32_t> perm(dst_rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    for (int r = 0; r < rows; ++r) scatter[r] = (r % 7 == 3) ? -1 : perm[r];  // some rows dropped
  }

  DeviceBuffer<bf16> dA(a.size()), dB(b.size()), dC(static_cast<size_t>(std::max(dst_rows, max_rows)) * c.N);
  DeviceBuffer<int32_t> dOff(off.size()), dScatter(scatter.size());
  DeviceBuffer<float> dScale(scale.size());
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  dScatter.upload(scatter);
  dScale.upload(scale);

  GemmEpilogue epi;
  if (c.scale) epi.row_scale = dScale.get();
  if (c.scatter) epi.scatter_rows = dScatter.get();
  dC.poison();
  const Status st =
      nt ? grouped_gemm_nt(dA.get(), dB.get(), dC.get(), dOff.get(), c.E, max_rows, c.N, c.K, epi, nullptr, tuning)
         : grouped_gemm_nn(dA.get(), dB.get(), dC.get(), dOff.get(), c.E, max_rows, c.N, c.K, epi, nullptr, tuning);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = dC.download();
  const auto ref = run_ref_m(dA, dB, dOff, c.E, rows, c.N, c.K, nt);

  Err err;
  double num = 0, den = 0;
  std::vector<char> written(dC.size() / c.N, 0);
  for (int r = 0; r < rows; ++r) {
    const int dst = c.scatter ? scatter[r] : r;
    if (dst < 0) continue;
    written[dst] = 1;
    const double s = c.scale ? scale[r] : 1.0;
    for (int n = 0; n < c.N; ++n)
      accumulate_err(err, num, den, __bfloat162float(got[size_t(dst) * c.N + n]), s * ref[size_t(r) * c.N + n]);
  }
  err.rel = std::sqrt(num / std::max(den, 1e-30));
  int64_t overwritten = 0;
  for (size_t row = 0; row < written.size(); ++row)
    if (!written[row])
      for (int n = 0; n < c.N; ++n) overwritten += !is_poisoned_bf16(got[row * c.N + n]);
  EXPECT_EQ(err.nan, 0) << "unwritten or non-finite outputs";
  EXPECT_LE(err.rel, kTol);
  EXPECT_EQ(overwritten, 0) << "elements written outside the routed rows";
  std::printf(
      "[gemm_test] %s cluster=%d tile_n=%d store=%d E=%d rows=%d N=%d K=%d scale=%d scatter=%d: rel err %.3e over %lld "
      "values\n",
      nt ? "NT" : "NN", tuning.cluster_size, tuning.tile_n, static_cast<int>(tuning.store), c.E, rows, c.N, c.K, c.scale,
      c.scatter, err.rel, static_cast<long long>(err.count));
  if (tuning.cluster_size != 1) return;

  // The same product with A's rows gathered by index from a shuffled source: bitwise the same C.
  const DeviceGatheredRows g = upload_rows_randomly(a, max_rows, c.K, 17);
  dC.poison();
  const Status gs = nt ? grouped_gemm_nt(g.source.get(), dB.get(), dC.get(), dOff.get(), c.E, max_rows, c.N, c.K, epi,
                                         nullptr, tuning, g.as_a())
                       : grouped_gemm_nn(g.source.get(), dB.get(), dC.get(), dOff.get(), c.E, max_rows, c.N, c.K, epi,
                                         nullptr, tuning, g.as_a());
  ASSERT_TRUE(gs.is_ok()) << gs.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_gathered = dC.download();
  EXPECT_EQ(std::memcmp(got.data(), got_gathered.data(), got.size() * sizeof(bf16)), 0) << "gathered A differs";

  // C rows through per-row pointers into a second buffer, in reverse row order: the same bits per row.
  if (c.scatter) return;
  DeviceBuffer<bf16> dD(size_t(max_rows) * c.N);
  std::vector<bf16*> ptrs(max_rows);
  for (int r = 0; r < max_rows; ++r) ptrs[r] = dD.get() + size_t(max_rows - 1 - r) * c.N;
  DeviceBuffer<bf16*> dPtrs(ptrs.size());
  dPtrs.upload(ptrs);
  GemmEpilogue by_pointer = epi;
  by_pointer.row_pointers = reinterpret_cast<void* const*>(dPtrs.get());
  const Status ps = nt ? grouped_gemm_nt(dA.get(), dB.get(), dD.get(), dOff.get(), c.E, max_rows, c.N, c.K, by_pointer,
                                         nullptr, tuning)
                       : grouped_gemm_nn(dA.get(), dB.get(), dD.get(), dOff.get(), c.E, max_rows, c.N, c.K, by_pointer,
                                         nullptr, tuning);
  ASSERT_TRUE(ps.is_ok()) << ps.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_d = dD.download();
  for (int r = 0; r < max_rows; ++r) {
    const bf16* row = &got_d[size_t(max_rows - 1 - r) * c.N];
    if (r < rows) {
      ASSERT_EQ(std::memcmp(row, &got[size_t(r) * c.N], c.N * sizeof(bf16)), 0) << "row pointers, row " << r;
    } else {
      for (int n = 0; n < c.N; ++n) ASSERT_TRUE(is_poisoned_bf16(row[n])) << "row pointers wrote capacity row " << r;
    }
  }
}

TEST(GroupedGemm, MGroupedKMajorPlain) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (const GemmTuning& t : all_tunings()) {
    run_m_grouped_plain(true, {9, 400, 384, 200, false, false}, t);
    run_m_grouped_plain(true, {4, 700, 512, 512, false, false}, t);
    run_m_grouped_plain(true, {3, 300, 264, 136, true, false}, t);  // last n-tile: one 8-column box
    // Tiles of one and two stages (fewer stages than the tile's output boxes).
    run_m_grouped_plain(true, {6, 300, 512, 64, false, false}, t);
    run_m_grouped_plain(true, {5, 300, 520, 128, true, true}, t);
    // A grid of one or four clusters: every CTA walks many tiles, its staging boxes reused tile after tile.
    for (const int max_ctas : {1, 4}) {
      GemmTuning few = t;
      few.max_ctas = max_ctas * t.cluster_size;
      run_m_grouped_plain(true, {6, 300, 512, 64, false, false}, few);
      run_m_grouped_plain(true, {5, 300, 520, 200, true, true}, few);
    }
  }
}

TEST(GroupedGemm, MGroupedKMajorScaleScatter) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (const GemmTuning& t : all_tunings()) {
    run_m_grouped_plain(true, {7, 300, 256, 136, true, false}, t);
    run_m_grouped_plain(true, {7, 300, 264, 136, true, true}, t);
  }
}

TEST(GroupedGemm, MGroupedNMajorPlain) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  for (const GemmTuning& t : all_tunings()) {
    run_m_grouped_plain(false, {9, 400, 320, 200, false, false}, t);
    run_m_grouped_plain(false, {5, 600, 768, 264, true, true}, t);
    run_m_grouped_plain(false, {4, 300, 512, 64, true, false}, t);  // one stage a tile
    GemmTuning few = t;  // every CTA walks many tiles
    few.max_ctas = 2 * t.cluster_size;
    run_m_grouped_plain(false, {5, 400, 520, 136, true, true}, few);
  }
}

// The store modes and cluster sizes change how C is written, never its bits.
TEST(GroupedGemm, LaunchShapesAgreeBitwise) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int E = 5, N = 576, K = 320;
  const auto sizes = random_groups(E, 500);
  const auto off = prefix(sizes);
  const int rows = off[E];
  const auto a = random_bf16(size_t(rows) * K), b = random_bf16(size_t(E) * N * K);
  std::vector<float> scale(rows);
  std::uniform_real_distribution<float> sd(0.25f, 2.0f);
  for (auto& s : scale) s = sd(rng());
  DeviceBuffer<bf16> dA(a.size()), dB(b.size()), dC(size_t(rows) * N);
  DeviceBuffer<int32_t> dOff(off.size());
  DeviceBuffer<float> dScale(scale.size());
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  dScale.upload(scale);
  GemmEpilogue epi;
  epi.row_scale = dScale.get();
  for (bool nt : {true, false}) {
    std::vector<bf16> first;
    for (const GemmTuning& t : all_tunings()) {
      dC.poison();
      const Status st = nt ? grouped_gemm_nt(dA.get(), dB.get(), dC.get(), dOff.get(), E, rows, N, K, epi, nullptr, t)
                           : grouped_gemm_nn(dA.get(), dB.get(), dC.get(), dOff.get(), E, rows, N, K, epi, nullptr, t);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto got = dC.download();
      for (const auto& v : got) ASSERT_FALSE(is_poisoned_bf16(v)) << "unwritten output";
      if (first.empty()) {
        first = std::move(got);
      } else {
        EXPECT_EQ(std::memcmp(first.data(), got.data(), got.size() * sizeof(bf16)), 0)
            << (nt ? "NT" : "NN") << " cluster=" << t.cluster_size << " store=" << static_cast<int>(t.store);
      }
    }
  }
}

TEST(GroupedGemm, DenseSingleGroup) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  // E = 1 through the same engine; random_groups would zero the only group, so build it by hand.
  const int rows = 1000, N = 512, K = 384;
  const std::vector<int32_t> off = {0, rows};
  const auto a = random_bf16(size_t(rows) * K), b = random_bf16(size_t(N) * K);
  DeviceBuffer<bf16> dA(a.size()), dB(b.size()), dC(size_t(rows) * N);
  DeviceBuffer<int32_t> dOff(2);
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  ASSERT_TRUE(grouped_gemm_nt(dA.get(), dB.get(), dC.get(), dOff.get(), 1, rows, N, K, {}, nullptr).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = dC.download();
  const auto ref = run_ref_m(dA, dB, dOff, 1, rows, N, K, true);
  Err err;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) accumulate_err(err, num, den, __bfloat162float(got[i]), ref[i]);
  err.rel = std::sqrt(num / den);
  EXPECT_EQ(err.nan, 0);
  EXPECT_LE(err.rel, kTol);
  std::printf("[gemm_test] dense 1000x512x384: rel err %.3e\n", err.rel);
}

TEST(GroupedGemm, AllGroupsEmptyWritesNothing) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int E = 4, N = 256, K = 128, max_rows = 300;
  const std::vector<int32_t> off(E + 1, 0);
  const auto a = random_bf16(size_t(max_rows) * K), b = random_bf16(size_t(E) * N * K);
  DeviceBuffer<bf16> dA(a.size()), dB(b.size()), dC(size_t(max_rows) * N);
  DeviceBuffer<int32_t> dOff(off.size());
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  ASSERT_TRUE(grouped_gemm_nt(dA.get(), dB.get(), dC.get(), dOff.get(), E, max_rows, N, K, {}, nullptr).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const auto& v : dC.download()) ASSERT_TRUE(is_poisoned_bf16(v));
}

// ---------------------------------------------------------------- SwiGLU forward (form 1)

// W13 in the public order [E, 2I, H]: each tile loads gate rows and the matching up rows, so a = silu(g) * u
// leaves the epilogue with no permuted copy of the weights; h (aux) comes out in the public column order.
TEST(GroupedGemm, SwiGLUForwardFromPublicW13) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int E = 6, I = 384, H = 264;  // 2I = 768: three 256-wide tiles, six 128-wide ones
  const int N = 2 * I;
  const auto sizes = random_groups(E, 350);
  const auto off = prefix(sizes);
  const int rows = off[E];
  const auto x = random_bf16(size_t(rows) * H);
  const auto w13 = random_bf16(size_t(E) * N * H);
  std::vector<float> scale(rows);
  std::uniform_real_distribution<float> sd(0.25f, 2.0f);
  for (auto& v : scale) v = sd(rng());

  DeviceBuffer<bf16> dX(x.size()), dW(w13.size()), dA(size_t(rows) * I), dH(size_t(rows) * N);
  DeviceBuffer<int32_t> dOff(off.size());
  DeviceBuffer<float> dScale(scale.size());
  dX.upload(x);
  dW.upload(w13);
  dOff.upload(off);
  dScale.upload(scale);
  const auto h_ref = run_ref_m(dX, dW, dOff, E, rows, N, H, true);

  GemmEpilogue epi;
  epi.activation = GemmActivation::kSwiGLU;
  epi.row_scale = dScale.get();
  epi.aux_out = dH.get();
  std::vector<bf16> first_a;
  for (const GemmTuning& t : all_tunings()) {
    dA.poison();
    dH.poison();
    ASSERT_TRUE(grouped_gemm_nt(dX.get(), dW.get(), dA.get(), dOff.get(), E, rows, N, H, epi, nullptr, t).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got_a = dA.download(), got_h = dH.download();
    Err ea, eh;
    double na = 0, da = 0, nh = 0, dh = 0;
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < I; ++i) {
        const double g = h_ref[size_t(r) * N + i], u = h_ref[size_t(r) * N + I + i];
        accumulate_err(ea, na, da, __bfloat162float(got_a[size_t(r) * I + i]), scale[r] * silu(g) * u);
      }
      for (int q = 0; q < N; ++q)
        accumulate_err(eh, nh, dh, __bfloat162float(got_h[size_t(r) * N + q]), h_ref[size_t(r) * N + q]);
    }
    ea.rel = std::sqrt(na / da);
    eh.rel = std::sqrt(nh / dh);
    EXPECT_EQ(ea.nan, 0);
    EXPECT_EQ(eh.nan, 0);
    EXPECT_LE(ea.rel, kTol);
    EXPECT_LE(eh.rel, kTol);
    // Every launch shape computes the same bits.
    if (first_a.empty()) first_a = got_a;
    EXPECT_EQ(std::memcmp(first_a.data(), got_a.data(), got_a.size() * sizeof(bf16)), 0)
        << "cluster=" << t.cluster_size << " tile_n=" << t.tile_n << " store=" << static_cast<int>(t.store);
    std::printf("[gemm_test] SwiGLU fwd cluster=%d tile_n=%d store=%d rows=%d I=%d H=%d: a rel err %.3e, h %.3e\n",
                t.cluster_size, t.tile_n, static_cast<int>(t.store), rows, I, H, ea.rel, eh.rel);
  }
  // The layer's GEMM1: x rows gathered by index from a shuffled receive buffer; the same bits.
  const DeviceGatheredRows g = upload_rows_randomly(x, rows, H, 9);
  dA.poison();
  ASSERT_TRUE(
      grouped_gemm_nt(g.source.get(), dW.get(), dA.get(), dOff.get(), E, rows, N, H, epi, nullptr, {}, g.as_a()).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_gathered = dA.download();
  EXPECT_EQ(std::memcmp(first_a.data(), got_gathered.data(), got_gathered.size() * sizeof(bf16)), 0);
}

// ---------------------------------------------------------------- SwiGLU backward (form 2)

// acc = da = dy . W2 (W2 read N-major); dh = SwiGLU'(w * da) from h in the public column order; aux = w * a;
// the per-tile partials of <da, a> sum to the routing-weight gradient.
TEST(GroupedGemm, SwiGLUBackwardNMajor) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int E = 5, I = 320, H = 200;  // N = I = 320: the second 256-wide n-tile is partly full; K = H = 200
  const auto sizes = random_groups(E, 400);
  const auto off = prefix(sizes);
  const int rows = off[E];
  const auto dy = random_bf16(size_t(rows) * H);
  const auto w2 = random_bf16(size_t(E) * H * I);          // public W2 [E, H, I]: B[e] = [K=H, N=I], N-major
  const auto h = random_bf16(size_t(rows) * 2 * I, 3.0f);  // [rows, 2I]: gate columns, then up columns
  std::vector<float> scale(rows);
  std::uniform_real_distribution<float> sd(0.25f, 2.0f);
  for (auto& v : scale) v = sd(rng());
  std::vector<int32_t> scatter(rows);
  for (int r = 0; r < rows; ++r) scatter[r] = (r % 5 == 1) ? -1 : r;
  DeviceBuffer<bf16> dDy(dy.size()), dW2(w2.size()), dHin(h.size()), dDh(size_t(rows) * 2 * I), dAout(size_t(rows) * I);
  DeviceBuffer<int32_t> dOff(off.size()), dScatter(scatter.size());
  DeviceBuffer<float> dScale(scale.size());
  dDy.upload(dy);
  dW2.upload(w2);
  dHin.upload(h);
  dOff.upload(off);
  dScatter.upload(scatter);
  dScale.upload(scale);
  const auto da = run_ref_m(dDy, dW2, dOff, E, rows, I, H, false);
  const auto fh = to_float(h);
  // dh and w * a of the first launch shape, per scatter mode: every tile width (256 wide: written over the h
  // stages; 128 wide: staged) and 2-CTA pairs compute the same bits.
  std::vector<bf16> first_dh[2], first_a[2];
  for (const auto& [tile_n, cluster] : {std::pair{256, 1}, std::pair{128, 1}, std::pair{256, 2}}) {
    for (bool scattered : {false, true}) {
      GemmTuning t;
      t.tile_n = tile_n;
      t.cluster_size = cluster;
      const int parts = grouped_gemm_n_tiles(I, t);
      DeviceBuffer<float> dDots(size_t(rows) * parts);
      std::vector<float*> dot_rows(rows);
      for (int r = 0; r < rows; ++r) dot_rows[r] = dDots.get() + size_t(r) * parts;
      DeviceBuffer<float*> dDotRows(dot_rows.size());
      dDotRows.upload(dot_rows);
      GemmEpilogue epi;
      epi.activation = GemmActivation::kSwiGLUBackward;
      epi.h_in = dHin.get();
      epi.aux_out = dAout.get();
      epi.row_scale = dScale.get();
      epi.row_dots = dDotRows.get();
      if (scattered) epi.scatter_rows = dScatter.get();
      dDh.poison();
      dAout.poison();
      ASSERT_TRUE(grouped_gemm_nn(dDy.get(), dW2.get(), dDh.get(), dOff.get(), E, rows, I, H, epi, nullptr, t).is_ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got_dh = dDh.download(), got_a = dAout.download();
      const auto got_dots = dDots.download();
      Err e1, e2, e3;
      double n1 = 0, d1 = 0, n2 = 0, d2 = 0, n3 = 0, d3 = 0;
      int64_t overwritten = 0;
      for (int r = 0; r < rows; ++r) {
        const bool stored = !scattered || scatter[r] >= 0;
        if (!stored) {
          for (int q = 0; q < 2 * I; ++q) overwritten += !is_poisoned_bf16(got_dh[size_t(r) * 2 * I + q]);
          for (int i = 0; i < I; ++i) overwritten += !is_poisoned_bf16(got_a[size_t(r) * I + i]);
        }
        double dot = 0;
        for (int i = 0; i < I; ++i) {
          const double g = fh[size_t(r) * 2 * I + i], u = fh[size_t(r) * 2 * I + I + i];
          const double d = da[size_t(r) * I + i];
          const double sg = sigmoid(g);
          dot += d * silu(g) * u;
          if (!stored) continue;
          const double w = scale[r];
          accumulate_err(e1, n1, d1, __bfloat162float(got_dh[size_t(r) * 2 * I + i]), w * d * u * sg * (1 + g * (1 - sg)));
          accumulate_err(e1, n1, d1, __bfloat162float(got_dh[size_t(r) * 2 * I + I + i]), w * d * silu(g));
          accumulate_err(e2, n2, d2, __bfloat162float(got_a[size_t(r) * I + i]), w * silu(g) * u);
        }
        double sum = 0;  // the partials, summed in n-tile order
        for (int p = 0; p < parts; ++p) sum += got_dots[size_t(r) * parts + p];
        accumulate_err(e3, n3, d3, sum, dot);
      }
      e1.rel = std::sqrt(n1 / d1);
      e2.rel = std::sqrt(n2 / d2);
      e3.rel = std::sqrt(n3 / d3);
      EXPECT_EQ(e1.nan + e2.nan + e3.nan, 0);
      EXPECT_LE(e1.rel, kTol);
      EXPECT_LE(e2.rel, kTol);
      EXPECT_LE(e3.rel, kTol);
      EXPECT_EQ(overwritten, 0);
      if (first_dh[scattered].empty()) {
        first_dh[scattered] = got_dh;
        first_a[scattered] = got_a;
      } else {
        EXPECT_EQ(0, std::memcmp(first_dh[scattered].data(), got_dh.data(), got_dh.size() * sizeof(bf16)))
            << "dh, tile_n=" << tile_n << " cluster=" << cluster << " scatter=" << scattered;
        EXPECT_EQ(0, std::memcmp(first_a[scattered].data(), got_a.data(), got_a.size() * sizeof(bf16)))
            << "w*a, tile_n=" << tile_n << " cluster=" << cluster << " scatter=" << scattered;
      }
      std::printf(
          "[gemm_test] SwiGLU bwd tile_n=%d cluster=%d scatter=%d rows=%d I=%d H=%d: dh %.3e, w*a %.3e, <da,a> %.3e\n",
          tile_n, cluster, scattered, rows, I, H, e1.rel, e2.rel, e3.rel);
      if (scattered || cluster != 1) continue;  // gathered rows need single CTAs
      // A's rows gathered by index from a shuffled source, as the layer reads d_out: bitwise the same outputs
      // (the gathering producer warpgroup then waits for the h stages' readers on their read barriers).
      const DeviceGatheredRows gd = upload_rows_randomly(dy, rows, H, 7);
      DeviceBuffer<float> dDots2(size_t(rows) * parts);
      std::vector<float*> dot_rows2(rows);
      for (int r = 0; r < rows; ++r) dot_rows2[r] = dDots2.get() + size_t(r) * parts;
      DeviceBuffer<float*> dDotRows2(dot_rows2.size());
      dDotRows2.upload(dot_rows2);
      epi.row_dots = dDotRows2.get();
      dDh.poison();
      dAout.poison();
      ASSERT_TRUE(
          grouped_gemm_nn(gd.source.get(), dW2.get(), dDh.get(), dOff.get(), E, rows, I, H, epi, nullptr, t, gd.as_a())
              .is_ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto gathered_dh = dDh.download(), gathered_a = dAout.download();
      const auto gathered_dots = dDots2.download();
      EXPECT_EQ(0, std::memcmp(got_dh.data(), gathered_dh.data(), got_dh.size() * sizeof(bf16))) << "gathered: dh";
      EXPECT_EQ(0, std::memcmp(got_a.data(), gathered_a.data(), got_a.size() * sizeof(bf16))) << "gathered: w*a";
      EXPECT_EQ(0, std::memcmp(got_dots.data(), gathered_dots.data(), got_dots.size() * sizeof(float)))
          << "gathered: <da, a> partials";
    }
  }
}

// ---------------------------------------------------------------- form 3 (K-grouped)

void run_k_grouped(int E, int max_per_group, int M, int N, bool accumulate, const GemmTuning& tuning) {
  const auto sizes = random_groups(E, max_per_group);
  const auto off = prefix(sizes);
  const int rows = off[E];
  const int max_rows = rows + 50;
  auto a = random_bf16(size_t(max_rows) * M), b = random_bf16(size_t(max_rows) * N);
  // Capacity rows past the last expert hold NaN: the straddling K-tile of the last expert loads them and
  // must zero them before the tensor cores see them.
  for (size_t i = size_t(rows) * M; i < a.size(); ++i) a[i] = __float2bfloat16(NAN);
  for (size_t i = size_t(rows) * N; i < b.size(); ++i) b[i] = __float2bfloat16(NAN);
  DeviceBuffer<bf16> dA(a.size()), dB(b.size());
  DeviceBuffer<float> dC(size_t(E) * M * N);
  DeviceBuffer<int32_t> dOff(off.size());
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  std::vector<float> init;
  if (accumulate) {
    init.resize(dC.size());
    std::uniform_real_distribution<float> d(-4.0f, 4.0f);
    for (auto& v : init) v = d(rng());
    dC.upload(init);
  }
  ASSERT_TRUE(
      grouped_gemm_tn(dA.get(), dB.get(), dC.get(), dOff.get(), E, max_rows, M, N, accumulate, nullptr, tuning).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = dC.download();
  const auto ref = run_ref_k(dA, dB, dOff, E, M, N);  // ref loops exactly over each expert's rows
  Err err;
  double num = 0, den = 0;
  int64_t empty_nonzero = 0;
  for (int e = 0; e < E; ++e)
    for (size_t i = size_t(e) * M * N; i < size_t(e + 1) * M * N; ++i) {
      const double expect = ref[i] + (accumulate ? init[i] : 0.0);
      accumulate_err(err, num, den, got[i], expect);
      if (sizes[e] == 0 && got[i] != float(expect)) ++empty_nonzero;  // exact: 0, or init unchanged
    }
  err.rel = std::sqrt(num / den);
  EXPECT_EQ(err.nan, 0);
  EXPECT_LE(err.rel, kTol);
  EXPECT_EQ(empty_nonzero, 0) << "an empty expert must give exactly 0 (or leave the accumulator unchanged)";
  std::printf("[gemm_test] TN cluster=%d tile_n=%d dynamic=%d E=%d rows=%d M=%d N=%d accumulate=%d: rel err %.3e\n",
              tuning.cluster_size, tuning.tile_n, tuning.work_counter != nullptr, E, rows, M, N, accumulate, err.rel);
  // C stored transposed ([E, N, M], accumulating onto the transposed start values): the same bits.
  const auto transposed = [&](const std::vector<float>& c) {
    std::vector<float> t(c.size());
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) t[(size_t(e) * N + n) * M + m] = c[(size_t(e) * M + m) * N + n];
    return t;
  };
  {
    if (accumulate) {
      dC.upload(transposed(init));
    } else {
      dC.poison();
    }
    ASSERT_TRUE(grouped_gemm_tn(dA.get(), dB.get(), dC.get(), dOff.get(), E, max_rows, M, N, accumulate, nullptr, tuning,
                                {}, /*transpose_c=*/true)
                    .is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto want_t = transposed(got);
    const auto got_t = dC.download();
    EXPECT_EQ(std::memcmp(want_t.data(), got_t.data(), got_t.size() * sizeof(float)), 0) << "transposed C differs";
    if (accumulate) {
      dC.upload(init);
    } else {
      dC.poison();
    }
  }
  // C in bf16 (the weight gradients of a bf16 parameter): each value the fp32 call's rounded once, and with
  // accumulate the fp32 sum of the existing bf16 value and the new one rounded once; C plain and transposed,
  // operands as they are (every launch shape) and gathered (below).
  dC.poison();
  ASSERT_TRUE(
      grouped_gemm_tn(dA.get(), dB.get(), dC.get(), dOff.get(), E, max_rows, M, N, false, nullptr, tuning).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto fresh = dC.download();  // the fp32 products alone
  std::vector<float> init16f(dC.size());
  for (size_t i = 0; i < init16f.size(); ++i) {
    init16f[i] = megamoe::testing::bf16_rounded(accumulate ? init[i] : 0.0f);
  }
  DeviceBuffer<bf16> dC16(dC.size());
  const auto check_bf16 = [&](const bf16* a_, const bf16* b_, const GemmGather& g, bool transpose, const char* what) {
    if (accumulate) {
      const std::vector<float> start = transpose ? transposed(init16f) : init16f;
      std::vector<bf16> start16(start.size());
      for (size_t i = 0; i < start.size(); ++i) start16[i] = __float2bfloat16_rn(start[i]);
      dC16.upload(start16);
    } else {
      dC16.poison();
    }
    ASSERT_TRUE(grouped_gemm_tn(a_, b_, dC16.get(), dOff.get(), E, max_rows, M, N, accumulate, nullptr, tuning, g,
                                transpose)
                    .is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> want(fresh.size());
    for (size_t i = 0; i < want.size(); ++i) {
      want[i] = megamoe::testing::bf16_rounded(fresh[i] + (accumulate ? init16f[i] : 0.0f));
    }
    if (transpose) want = transposed(want);
    const auto got16 = dC16.download();
    int64_t differ = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const float v = __bfloat162float(got16[i]);
      differ += std::memcmp(&v, &want[i], sizeof(float)) != 0;
    }
    EXPECT_EQ(differ, 0) << "bf16 C (" << what << (transpose ? ", transposed" : "")
                         << ") differs from the fp32 C rounded";
  };
  check_bf16(dA.get(), dB.get(), {}, false, "operands as they are");
  check_bf16(dA.get(), dB.get(), {}, true, "operands as they are");
  if (tuning.cluster_size != 1) return;
  // A, B or both gathered by index from shuffled sources (the layer's weight gradients read rows of a
  // receive buffer): bitwise the same C.
  const DeviceGatheredRows ga = upload_rows_randomly(a, max_rows, M, 11), gb = upload_rows_randomly(b, max_rows, N, 5);
  const DeviceBuffer<bf16>& dSa = ga.source;
  const DeviceBuffer<bf16>& dSb = gb.source;
  for (int which = 1; which <= 3; ++which) {
    GemmGather g;
    if (which & 1) g = ga.as_a();
    if (which & 2) {
      g.b_rows = gb.index.get();
      g.b_source_rows = gb.source_rows;
    }
    if (accumulate) {
      dC.upload(init);
    } else {
      dC.poison();
    }
    ASSERT_TRUE(grouped_gemm_tn((which & 1) ? dSa.get() : dA.get(), (which & 2) ? dSb.get() : dB.get(), dC.get(),
                                dOff.get(), E, max_rows, M, N, accumulate, nullptr, tuning, g)
                    .is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got_g = dC.download();
    EXPECT_EQ(std::memcmp(got.data(), got_g.data(), got.size() * sizeof(float)), 0) << "gathered operands " << which;
    check_bf16((which & 1) ? dSa.get() : dA.get(), (which & 2) ? dSb.get() : dB.get(), g, which == 1,
               which == 1 ? "A gathered" : which == 2 ? "B gathered" : "A and B gathered");
    if (which != 1) continue;
    // The layer's weight gradients: A gathered, C stored transposed.
    if (accumulate) {
      dC.upload(transposed(init));
    } else {
      dC.poison();
    }
    ASSERT_TRUE(grouped_gemm_tn(dSa.get(), dB.get(), dC.get(), dOff.get(), E, max_rows, M, N, accumulate, nullptr,
                                tuning, g, /*transpose_c=*/true)
                    .is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got_gt = dC.download();
    const auto want_gt = transposed(got);
    EXPECT_EQ(std::memcmp(want_gt.data(), got_gt.data(), got_gt.size() * sizeof(float)), 0)
        << "gathered A, transposed C differs";
  }
}

// Form 3 launch shapes: static order with clusters of 1 and 2, dynamic scheduling (longest first), tile 128.
std::vector<GemmTuning> k_grouped_tunings(int* counter) {
  GemmTuning dynamic;
  dynamic.work_counter = counter;
  GemmTuning narrow;
  narrow.tile_n = 128;
  GemmTuning narrow_dynamic = dynamic;
  narrow_dynamic.tile_n = 128;
  return {GemmTuning{1}, GemmTuning{2}, dynamic, narrow, narrow_dynamic};
}

TEST(GroupedGemm, KGroupedFp32) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<int32_t> counter(1);
  counter.upload({0});  // zero once: every launch leaves it zero
  for (const GemmTuning& t : k_grouped_tunings(counter.get())) {
    run_k_grouped(8, 300, 200, 320, false, t);
    run_k_grouped(5, 700, 256, 512, false, t);
    run_k_grouped(6, 500, 328, 264, false, t);  // 3 m-tiles: the second CTA of the last pair has none
    run_k_grouped(40, 200, 136, 128, false, t);  // more experts than a scan step, several empty
  }
}

TEST(GroupedGemm, KGroupedAccumulate) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<int32_t> counter(1);
  counter.upload({0});  // zero once: every launch leaves it zero
  for (const GemmTuning& t : k_grouped_tunings(counter.get())) run_k_grouped(7, 260, 136, 264, true, t);
}

// Dynamic scheduling changes which CTA computes a tile, never its bits; the counter is reused, each launch
// leaving it zero for the next (no memset between them).
TEST(GroupedGemm, DynamicSchedulingAgreesBitwise) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  const int E = 12, M = 264, N = 200;
  std::vector<int> sizes = random_groups(E, 400);
  sizes[E - 1] = 2000;  // one long expert at the end: longest-first moves it to the front
  const auto off = prefix(sizes);
  const int rows = off[E];
  const auto a = random_bf16(size_t(rows) * M), b = random_bf16(size_t(rows) * N);
  DeviceBuffer<bf16> dA(a.size()), dB(b.size());
  DeviceBuffer<float> dC(size_t(E) * M * N);
  DeviceBuffer<int32_t> dOff(off.size()), counter(1);
  dA.upload(a);
  dB.upload(b);
  dOff.upload(off);
  counter.upload({0});  // zero once: every launch leaves it zero
  GemmTuning dynamic;
  dynamic.work_counter = counter.get();
  ASSERT_TRUE(grouped_gemm_tn(dA.get(), dB.get(), dC.get(), dOff.get(), E, rows, M, N, false, nullptr, {}).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto ref = dC.download();
  for (int rep = 0; rep < 3; ++rep) {
    dC.poison();
    ASSERT_TRUE(grouped_gemm_tn(dA.get(), dB.get(), dC.get(), dOff.get(), E, rows, M, N, false, nullptr, dynamic).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = dC.download();
    ASSERT_EQ(std::memcmp(ref.data(), got.data(), got.size() * sizeof(float)), 0) << "repeat " << rep;
    EXPECT_EQ(counter.download()[0], 0) << "the launch must leave its work counter zero, repeat " << rep;
  }
  // Forms 1 and 2 take the counter too (items in increasing order).
  DeviceBuffer<bf16> dX(size_t(rows) * M), dW(size_t(E) * N * M), dY(size_t(rows) * N);
  dX.upload(random_bf16(dX.size()));
  dW.upload(random_bf16(dW.size()));
  ASSERT_TRUE(grouped_gemm_nt(dX.get(), dW.get(), dY.get(), dOff.get(), E, rows, N, M, {}, nullptr, {}).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto ref_y = dY.download();
  dY.poison();
  ASSERT_TRUE(grouped_gemm_nt(dX.get(), dW.get(), dY.get(), dOff.get(), E, rows, N, M, {}, nullptr, dynamic).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_y = dY.download();
  EXPECT_EQ(std::memcmp(ref_y.data(), got_y.data(), got_y.size() * sizeof(bf16)), 0);
  // On three CTAs, each drawing many items in turn: bitwise the same.
  GemmTuning dynamic_few = dynamic;
  dynamic_few.max_ctas = 3;
  dY.poison();
  ASSERT_TRUE(grouped_gemm_nt(dX.get(), dW.get(), dY.get(), dOff.get(), E, rows, N, M, {}, nullptr, dynamic_few).is_ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_few = dY.download();
  EXPECT_EQ(std::memcmp(ref_y.data(), got_few.data(), got_few.size() * sizeof(bf16)), 0) << "dynamic, 3 CTAs";
  EXPECT_EQ(counter.download()[0], 0) << "the launch must leave its work counter zero (dynamic, 3 CTAs)";
  // Clusters and dynamic scheduling do not combine.
  GemmTuning bad = dynamic;
  bad.cluster_size = 2;
  EXPECT_EQ(grouped_gemm_tn(dA.get(), dB.get(), dC.get(), dOff.get(), E, rows, M, N, false, nullptr, bad).code(),
            StatusCode::kInvalidArgument);
}

TEST(GroupedGemm, RejectsBadArguments) {
  MEGAMOE_SKIP_WITHOUT_GPU();
  DeviceBuffer<bf16> d(4096);
  DeviceBuffer<int32_t> off(2);
  GemmEpilogue epi;
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 1, 8, 12, 64, epi, nullptr).code(),
            StatusCode::kInvalidArgument);  // N % 8
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 0, 8, 16, 64, epi, nullptr).code(),
            StatusCode::kInvalidArgument);  // no groups
  epi.activation = GemmActivation::kSwiGLUBackward;
  EXPECT_EQ(grouped_gemm_nn(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, epi, nullptr).code(),
            StatusCode::kInvalidArgument);  // h_in missing
  epi.h_in = d.get();
  const Status no_aux = grouped_gemm_nn(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, epi, nullptr);
  EXPECT_EQ(no_aux.code(), StatusCode::kInvalidArgument);  // aux_out missing
  EXPECT_NE(no_aux.message().find("aux_out"), std::string::npos) << no_aux.message();
  GemmEpilogue both;
  DeviceBuffer<void*> ptrs(8);
  DeviceBuffer<int32_t> rows(8);
  both.scatter_rows = rows.get();
  both.row_pointers = ptrs.get();
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, both, nullptr).code(),
            StatusCode::kInvalidArgument);  // scatter and row pointers
  GemmTuning narrow;
  narrow.tile_n = 64;
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, {}, nullptr, narrow).code(),
            StatusCode::kInvalidArgument);  // tile width
  GemmGather gather;
  gather.a_rows = rows.get();
  gather.a_source_rows = 8;
  GemmTuning pair;
  pair.cluster_size = 2;
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, {}, nullptr, pair, gather).code(),
            StatusCode::kInvalidArgument);  // gathered operands are not multicast
  gather.a_source_rows = 0;
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, {}, nullptr, {}, gather).code(),
            StatusCode::kInvalidArgument);  // no source rows
  GemmGather b_only;
  b_only.b_rows = rows.get();
  b_only.b_source_rows = 8;
  EXPECT_EQ(grouped_gemm_nt(d.get(), d.get(), d.get(), off.get(), 1, 8, 64, 64, {}, nullptr, {}, b_only).code(),
            StatusCode::kInvalidArgument);  // B rows are gathered in form 3 only
}

}  // namespace
}  // namespace megamoe::kernels
