// Hopper grouped-GEMM engine (BF16 in, fp32 accumulate). See grouped_gemm.hpp for the contract and
// docs/GEMM.md for the design and the measured figures.
//
// One persistent, warp-specialised kernel template serves the three forms:
//   * 384 threads: warpgroup 0 is the producer (one thread issues TMA; setmaxnreg down to 40),
//     warpgroups 1 and 2 are consumers (setmaxnreg up to 232), each owning 64 rows of a 128 x 256 tile.
//   * K is staged 64 at a time (128-byte rows, 128-byte swizzle) through a 4-stage ring of full/empty
//     mbarriers, waited on with raw parity waits.
//   * Work items (expert, m-tile, n-tile) are numbered on the device from group_offsets; every CTA walks
//     the numbering with a grid stride, in bands of 16 m-tiles (m fastest inside a band), so that CTAs
//     running at the same time share A and B panels in L2.
//   * Epilogue through a small per-warpgroup shared-memory buffer (stmatrix), leaving as 16-byte
//     row-contiguous stores; row masking, scatter, scale and SwiGLU applied on the way.
//   * Optional 2-CTA clusters (GemmTuning::cluster_size = 2): the pair shares the B panel by TMA multicast.
#include <cuda.h>  // CUtensorMap and its enums only: the driver entry point comes through the runtime
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cuda/ptx>
#include <mutex>
#include <string>

#include "kernels/cuda_check.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/wgmma.cuh"

namespace megamoe::kernels {
namespace {

namespace ptx = cuda::ptx;

constexpr int kBM = 128;
constexpr int kBN = 256;
constexpr int kBK = 64;
constexpr int kBandM = 16;                // tile-order band height (m-tiles), see decode_tile
constexpr uint16_t kMulticastMask = 0x3;  // both CTAs of a 2-CTA cluster
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kChunkBytes = 64 * 128;           // one 64 x 64 bf16 swizzled box, 8 KB
constexpr int kABytes = kBM * kBK * 2;          // 16 KB
constexpr int kBBytes = kBN * kBK * 2;          // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;  // 48 KB
constexpr int kStagingBytes = 64 * 128;         // one epilogue staging box (64 rows x 128 B), 8 KB
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register budget");

enum class Form : int { kNT = 0, kNN = 1, kTN = 2 };

// Pipeline depth and staging boxes per consumer warpgroup of each store mode (GemmStoreMode).
constexpr int stages_of(GemmStoreMode m) { return m == GemmStoreMode::kTmaTile ? 3 : 4; }
constexpr int slots_of(GemmStoreMode m) { return m == GemmStoreMode::kTmaTile ? 4 : 1; }
constexpr bool tma_store_of(GemmStoreMode m) {
  return m == GemmStoreMode::kTmaBox || m == GemmStoreMode::kTmaTile;
}
// Which epilogues can store through TMA: the bf16 staging ones of forms 1 and 2 (form 3 writes fp32 with
// an optional read-add, the SwiGLU backward epilogue writes directly).
constexpr bool has_tma_store(Form form, GemmActivation act) {
  return form != Form::kTN && act != GemmActivation::kSwiGLUBackward;
}
// The mode kDefault stands for: measured fastest on the H200 (docs/GEMM.md run 9, interleaved): +0.5 to
// +5.2% over kThreads for forms 1 and 2 on the four benchmark shapes, SwiGLU within +-1.5%.
constexpr GemmStoreMode kDefaultStore = GemmStoreMode::kTmaTile;

struct KernelParams {
  const int32_t* group_offsets;
  int num_groups;
  int max_rows;
  int M;  // form TN: rows of each C[e]
  int N;
  int K;  // forms NT/NN: reduction length
  void* C;
  int64_t ldc;
  const float* row_scale;
  const int32_t* scatter;
  __nv_bfloat16* aux_out;
  int64_t ld_aux;
  const __nv_bfloat16* h_in;
  int64_t ld_h;
  int accumulate;
  int tma_store;  // 1: the C (and aux) tensor maps are valid (no scatter)
  int* work_counter;  // non-null: work items are handed out by atomicAdd on it (zeroed before the launch)
  int longest_first;  // 1: number the work items of the experts with the most rows first (form 3, dynamic)
};

constexpr int kTileRing = 8;  // work items in flight from the producer to the consumers (dynamic scheduling)

template <int kStages, int kSlots>
struct SmemLayoutOf {
  static constexpr int kBarOffset = kStages * kStageBytes;  // full[kStages], empty[kStages], tile full/empty
  static constexpr int kTileRingOffset = kBarOffset + (2 * kStages + 2 * kTileRing) * 8;
  static constexpr int kOffsetsOffset = kTileRingOffset + kTileRing * 4;
  static constexpr int kTileStartOffset = kOffsetsOffset + (kGemmMaxGroups + 1) * 4;
  static constexpr int kOrderOffset = kTileStartOffset + (kGemmMaxGroups + 1) * 4;
  static constexpr int kStagingOffset = (kOrderOffset + kGemmMaxGroups * 4 + 1023) / 1024 * 1024;
  static constexpr int kEnd = kStagingOffset + 2 * kSlots * kStagingBytes;
  static constexpr int kDynamicBytes = kEnd + 1024;  // slack to align the base to 1024
  static_assert(kDynamicBytes <= 227 * 1024, "shared memory budget");
};

struct Tile {
  int e;
  int m_idx;
  int n_idx;
  int row0;     // NT/NN: first A row of the tile; TN: first row of expert e
  int rows;     // NT/NN: valid rows in the tile (<= kBM); TN: rows of expert e (the reduction length)
  int k_tiles;  // number of 64-deep K stages
};

__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// Work units: with kCluster = 2 a unit is a pair of vertically adjacent tiles (m = 2u, 2u + 1) that share
// the B panel; CTA `rank` of the cluster takes tile m = kCluster * u + rank (possibly past the expert's
// last m-tile: then it computes on zero/foreign rows and stores nothing, but still loads its half of B).
template <Form kForm, int kCluster>
__device__ __forceinline__ Tile decode_tile(int t, const int* offsets, const int* tile_start, const int* order,
                                            int num_groups, int n_tiles, int rank, const KernelParams& p) {
  int lo = 0, hi = num_groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // Position lo of the work numbering holds expert order[lo] (the identity unless longest-first).
  Tile tile;
  tile.e = order[lo];
  const int off = offsets[tile.e];
  const int rows_e = offsets[tile.e + 1] - off;
  // Within an expert, tiles go in bands of kBandM m-tiles, m fastest inside a band: the CTAs running at
  // the same time cover about kBandM x (grid / kBandM) tiles, so their A and B panels are shared in L2.
  const int m_tiles = kForm == Form::kTN ? (p.M + kBM - 1) / kBM : (rows_e + kBM - 1) / kBM;
  const int m_units = (m_tiles + kCluster - 1) / kCluster;
  constexpr int kBandU = kBandM / kCluster;
  const int local = t - tile_start[lo];
  const int band = local / (kBandU * n_tiles);
  const int in_band = local - band * (kBandU * n_tiles);
  const int band_h = min(kBandU, m_units - band * kBandU);
  tile.n_idx = in_band / band_h;
  tile.m_idx = (band * kBandU + (in_band - tile.n_idx * band_h)) * kCluster + rank;
  if constexpr (kForm == Form::kTN) {
    tile.row0 = off;
    tile.rows = rows_e;
    tile.k_tiles = (rows_e + kBK - 1) / kBK;
  } else {
    tile.row0 = off + tile.m_idx * kBM;
    tile.rows = min(kBM, rows_e - tile.m_idx * kBM);
    tile.k_tiles = (p.K + kBK - 1) / kBK;
  }
  return tile;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Fast sigmoid: ex2 and rcp on the special-function unit (exact enough for a bf16 result; sigmoid of a
// large negative g underflows to 0 cleanly, since rcp(inf) = 0).
__device__ __forceinline__ float sigmoid_f(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }

template <Form kForm, GemmActivation kAct, int kCluster, GemmStoreMode kStore>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                        const __grid_constant__ CUtensorMap tm_c, const __grid_constant__ CUtensorMap tm_aux,
                        const KernelParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  constexpr int kStages = stages_of(kStore);
  constexpr int kSlots = slots_of(kStore);
  constexpr bool kTmaStore = tma_store_of(kStore);
  static_assert(!kTmaStore || has_tma_store(kForm, kAct), "TMA stores serve the bf16 staging epilogues");
  using SmemLayout = SmemLayoutOf<kStages, kSlots>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + SmemLayout::kBarOffset);
  uint64_t* empty_bar = full_bar + kStages;
  int* offsets = reinterpret_cast<int*>(smem + SmemLayout::kOffsetsOffset);
  int* tile_start = reinterpret_cast<int*>(smem + SmemLayout::kTileStartOffset);
  int* order = reinterpret_cast<int*>(smem + SmemLayout::kOrderOffset);
  uint64_t* tile_full = empty_bar + kStages;
  uint64_t* tile_empty = tile_full + kTileRing;
  volatile int* tile_ring = reinterpret_cast<volatile int*>(smem + SmemLayout::kTileRingOffset);
  // Dynamic scheduling (single CTAs only, checked on the host): the producer takes the next work item from
  // a global counter and hands it to the consumers through tile_ring, so a CTA that drew long items simply
  // draws fewer; the static order is a grid stride.
  const bool dynamic = kCluster == 1 && p.work_counter != nullptr;

  const int tid = threadIdx.x;
  const int E = p.num_groups;
  const int n_tiles = (p.N + kBN - 1) / kBN;
  const int m_tiles_tn = (p.M + kBM - 1) / kBM;
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
  const int rank = kCluster == 1 ? 0 : static_cast<int>(ptx::get_sreg_cluster_ctarank());
  const int cluster_id = kCluster == 1 ? static_cast<int>(blockIdx.x) : static_cast<int>(ptx::get_sreg_clusterid_x());
  const int num_clusters = static_cast<int>(gridDim.x) / kCluster;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full_bar[s], 1);
      // Released by both consumer warpgroups of every CTA whose TMA writes into this stage.
      ptx::mbarrier_init(&empty_bar[s], 2 * kCluster);
    }
    for (int s = 0; s < kTileRing; ++s) {
      ptx::mbarrier_init(&tile_full[s], 1);
      ptx::mbarrier_init(&tile_empty[s], kConsumerThreads);
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  // Offsets read on the device, clamped into [0, max_rows], so that a bad table can never send TMA or the
  // stores out of the buffers.
  for (int i = tid; i <= E; i += kThreads) offsets[i] = min(max(p.group_offsets[i], 0), p.max_rows);
  if constexpr (kCluster > 1) {
    // The peer multicasts into this CTA's shared memory and arrives on its barriers: both CTAs must have
    // initialised them first.
    ptx::barrier_cluster_arrive(ptx::sem_release);
    ptx::barrier_cluster_wait(ptx::sem_acquire);
  } else {
    __syncthreads();
  }
  // Numbering order of the experts. Longest-first (form 3 with dynamic scheduling): the experts with the
  // most rows, i.e. the longest work items, are handed out first, so that short items fill the tail
  // (greedy longest-processing-time order); ties keep the expert order. Rank by counting: O(E^2 / threads).
  for (int i = tid; i < E; i += kThreads) {
    int pos = i;
    if (p.longest_first) {
      const int rows_i = max(offsets[i + 1] - offsets[i], 0);
      pos = 0;
      for (int f = 0; f < E; ++f) {
        const int rows_f = max(offsets[f + 1] - offsets[f], 0);
        pos += (rows_f > rows_i || (rows_f == rows_i && f < i)) ? 1 : 0;
      }
    }
    order[pos] = i;
  }
  __syncthreads();
  if (tid < 32) {
    // Work-item prefix sums over the numbering order: warp 0 scans 32 positions at a time.
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int pos = base + tid;
      const int e = pos < E ? order[pos] : E;
      int count = 0;
      if (pos < E) {
        const int lo_row = offsets[e];
        const int hi_row = max(offsets[e + 1], lo_row);
        const int m_tiles = kForm == Form::kTN ? m_tiles_tn : (hi_row - lo_row + kBM - 1) / kBM;
        count = ((m_tiles + kCluster - 1) / kCluster) * n_tiles;
      }
      int incl = count;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (tid >= d) incl += v;
      }
      if (pos < E) tile_start[pos] = carry + incl - count;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (tid == 0) tile_start[E] = carry;
  }
  __syncthreads();
  // A decreasing pair of offsets reads as an empty expert: it gets no work items (forms NT/NN) or no
  // K stages (form TN).
  const int total_tiles = tile_start[E];

  const int wg = tid / 128;
  if (wg == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0) {
      int stage = 0;
      uint32_t phase = 0;
      const uint16_t mc_mask = kMulticastMask;
      int t = dynamic ? atomicAdd(p.work_counter, 1) : cluster_id;
      for (int j = 0;; ++j) {
        if (dynamic) {
          // Publish the item (or the end: t >= total_tiles) to the consumers, in order.
          const int slot = j % kTileRing;
          wait_parity(&tile_empty[slot], ((j / kTileRing) & 1) ^ 1);
          tile_ring[slot] = t;
          (void)ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &tile_full[slot]);
        }
        if (t >= total_tiles) break;
        const Tile tile = decode_tile<kForm, kCluster>(t, offsets, tile_start, order, E, n_tiles, rank, p);
        const int k_tiles = max(tile.k_tiles, 0);
        const int n0 = tile.n_idx * kBN;
        for (int kt = 0; kt < k_tiles; ++kt) {
          wait_parity(&empty_bar[stage], phase ^ 1);
          ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full_bar[stage],
                                         static_cast<uint32_t>(kStageBytes));
          uint8_t* sa = smem + stage * kStageBytes;
          uint8_t* sb = sa + kABytes;
          const int k0 = kt * kBK;
          if constexpr (kForm == Form::kTN) {
            const int m0 = tile.m_idx * kBM;
            const int r = tile.row0 + k0;
#pragma unroll
            for (int c = 0; c < kBM / 64; ++c) {
              const int32_t crd[2] = {m0 + c * 64, r};
              ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, sa + c * kChunkBytes, &tm_a, crd,
                                        &full_bar[stage]);
            }
#pragma unroll
            for (int c = 0; c < kBN / 64; ++c) {
              const int32_t crd[2] = {n0 + c * 64, r};
              if constexpr (kCluster == 1) {
                ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, sb + c * kChunkBytes, &tm_b, crd,
                                          &full_bar[stage]);
              } else if (c / (kBN / 64 / kCluster) == rank) {
                ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, sb + c * kChunkBytes, &tm_b, crd,
                                          &full_bar[stage], mc_mask);
              }
            }
          } else {
            const int32_t crd_a[2] = {k0, tile.row0};
            ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, sa, &tm_a, crd_a, &full_bar[stage]);
            if constexpr (kForm == Form::kNT) {
              if constexpr (kCluster == 1) {
                const int32_t crd_b[3] = {k0, n0, tile.e};
                ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, sb, &tm_b, crd_b, &full_bar[stage]);
              } else {
                // Each CTA loads BN / 2 rows of the B panel and multicasts them to both CTAs.
                const int32_t crd_b[3] = {k0, n0 + rank * (kBN / 2), tile.e};
                ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, sb + rank * (kBBytes / 2), &tm_b,
                                          crd_b, &full_bar[stage], mc_mask);
              }
            } else {
#pragma unroll
              for (int c = 0; c < kBN / 64; ++c) {
                const int32_t crd_b[3] = {n0 + c * 64, k0, tile.e};
                if constexpr (kCluster == 1) {
                  ptx::cp_async_bulk_tensor(ptx::space_shared, ptx::space_global, sb + c * kChunkBytes, &tm_b, crd_b,
                                            &full_bar[stage]);
                } else if (c / (kBN / 64 / kCluster) == rank) {
                  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, sb + c * kChunkBytes, &tm_b, crd_b,
                                            &full_bar[stage], mc_mask);
                }
              }
            }
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
        t = dynamic ? atomicAdd(p.work_counter, 1) : t + num_clusters;
      }
    }
  } else {
    sm90::setmaxnreg_inc<kConsumerRegs>();
    const int cwg = wg - 1;      // consumer warpgroup 0/1: rows 64*cwg .. 64*cwg+63 of the tile
    const int ctid = tid - 128;  // 0..255 over both consumers
    const int lt = tid & 127;
    const int warp = lt >> 5;
    const int lane = lt & 31;
    constexpr int kTransA = (kForm == Form::kTN) ? 1 : 0;
    constexpr int kTransB = (kForm == Form::kNT) ? 0 : 1;
    constexpr uint32_t kAStep = kTransA ? 2048u : 32u;  // bytes to the next k16 slice
    constexpr uint32_t kBStep = kTransB ? 2048u : 32u;
    constexpr uint32_t kALbo = kTransA ? kChunkBytes : 16u;
    constexpr uint32_t kBLbo = kTransB ? kChunkBytes : 16u;
    const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    // A stage is free once every CTA whose TMA writes into it is done with it: with a 2-CTA cluster the
    // peer multicasts into our stages, so we release the peer's empty barrier as well as our own.
    const uint32_t empty_s = static_cast<uint32_t>(__cvta_generic_to_shared(empty_bar));
    // Lane 0 arrives on our barrier and lane 1 on the peer's, side by side.
    auto release = [&](int s) {
      if (lt == 0) (void)ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &empty_bar[s]);
      if constexpr (kCluster > 1) {
        if (lt == 1) sm90::mbarrier_arrive_cluster_peer(empty_s + 8 * s, rank ^ 1);
      }
    };

    int stage = 0;
    uint32_t phase = 0;
    float acc[kBN / 2];
    int t_static = cluster_id;
    for (int j = 0;; ++j) {
      int t;
      if (dynamic) {
        const int slot = j % kTileRing;
        wait_parity(&tile_full[slot], (j / kTileRing) & 1);
        t = tile_ring[slot];
        (void)ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &tile_empty[slot]);
      } else {
        t = t_static;
        t_static += num_clusters;
      }
      if (t >= total_tiles) break;
      const Tile tile = decode_tile<kForm, kCluster>(t, offsets, tile_start, order, E, n_tiles, rank, p);
      const int k_tiles = max(tile.k_tiles, 0);
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;

      int prev_stage = 0;
      for (int kt = 0; kt < k_tiles; ++kt) {
        wait_parity(&full_bar[stage], phase);
        const uint32_t sa = smem_base + stage * kStageBytes;
        const uint32_t sb = sa + kABytes;
        if constexpr (kForm == Form::kTN) {
          const int valid = tile.rows - kt * kBK;
          if (valid < kBK) {
            // Rows [valid, 64) of this stage belong to the next expert (or lie past max_rows): zero them in
            // every A and B chunk (a whole 128-byte row, so the swizzle does not matter), then hand the
            // stores to the async proxy before any wgmma reads the stage.
            const int units_per_chunk = (kBK - valid) * 8;  // 16-byte units
            const int total_units = units_per_chunk * ((kBM + kBN) / 64);
            uint8_t* stage_ptr = smem + stage * kStageBytes;
            for (int u = ctid; u < total_units; u += kConsumerThreads) {
              const int c = u / units_per_chunk;
              const int o = u - c * units_per_chunk;
              *reinterpret_cast<uint4*>(stage_ptr + c * kChunkBytes + valid * 128 + o * 16) = make_uint4(0, 0, 0, 0);
            }
            ptx::fence_proxy_async(ptx::space_shared);
            sm90::named_barrier_sync(1, kConsumerThreads);
          }
        }
        sm90::wgmma_fence();
        const uint32_t a_base = sa + cwg * kChunkBytes;  // K-major: 64 rows x 128 B; MN-major: chunk cwg
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = sm90::make_smem_desc(a_base + kk * kAStep, kALbo, 1024);
          const uint64_t db = sm90::make_smem_desc(sb + kk * kBStep, kBLbo, 1024);
          sm90::wgmma_m64n256k16_bf16<kTransA, kTransB>(acc, da, db, 1);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();
        if (kt > 0) release(prev_stage);
        prev_stage = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      sm90::wgmma_wait<0>();
      if (k_tiles > 0) release(prev_stage);
      sm90::fence_accumulators(acc);

      // ---- epilogue ----
      // Accumulator i of a m64nNk16 wgmma sits at row 16*warp + lane/4 + 8*((i/2)%2) and column
      // 8*(i/4) + 2*(lane%4) + i%2 of the warpgroup's 64 x N block. Outputs go through a per-warpgroup
      // 64 x 128-byte shared-memory buffer (16-byte chunks XOR-swizzled by row, so both the fragment
      // writes and the row reads are free of bank conflicts) and leave as full 16-byte, row-contiguous
      // global stores: a warp writes whole 128-byte lines instead of 8 rows x 16 bytes.
      const int n0 = tile.n_idx * kBN;
      const int q = lane & 3;
      // This warpgroup's kSlots staging boxes (8 KB each, 1024-aligned: the 128-byte swizzle of a TMA box).
      uint8_t* stg = smem + SmemLayout::kStagingOffset + cwg * kSlots * kStagingBytes;
      const uint32_t stg_s = smem_base + SmemLayout::kStagingOffset + cwg * kSlots * kStagingBytes;
      const int bar_id = 2 + cwg;
      // Read-back geometry: thread lt handles chunk lt%8 of rows lt/8 + 16*it, it = 0..3.
      const int rb_chunk = lt & 7;
      const int rb_row = lt >> 3;
      if constexpr (kForm == Form::kTN) {
        float* C = static_cast<float*>(p.C) + static_cast<int64_t>(tile.e) * p.M * p.N;
        const int m_base = tile.m_idx * kBM + cwg * 64;
#pragma unroll
        for (int pass = 0; pass < kBN / 32; ++pass) {
          if (n0 + pass * 32 >= p.N) break;  // uniform over the warpgroup
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int j = pass * 4 + jj;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = warp * 16 + (lane >> 2) + 8 * h;
              const int chunk = (2 * jj + (q >> 1)) ^ (row & 7);
              *reinterpret_cast<float2*>(stg + row * 128 + chunk * 16 + 8 * (q & 1)) =
                  make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
          }
          sm90::named_barrier_sync(bar_id, 128);
          const int col = n0 + pass * 32 + rb_chunk * 4;
#pragma unroll
          for (int it = 0; it < 4; ++it) {
            const int row = rb_row + 16 * it;
            const int m = m_base + row;
            if (m < p.M && col < p.N) {
              float4 v = *reinterpret_cast<const float4*>(stg + row * 128 + ((rb_chunk ^ (row & 7)) << 4));
              float4* dst = reinterpret_cast<float4*>(C + static_cast<int64_t>(m) * p.N + col);
              if (p.accumulate) {
                const float4 old = *dst;
                v.x += old.x;
                v.y += old.y;
                v.z += old.z;
                v.w += old.w;
              }
              *dst = v;
            }
          }
          sm90::named_barrier_sync(bar_id, 128);
        }
      } else if constexpr (kAct == GemmActivation::kSwiGLUBackward) {
        // SwiGLU backward: acc = da for activation columns i (N = I); h and dh are interleaved. Direct
        // stores (the h loads dominate this epilogue).
        __nv_bfloat16* C = static_cast<__nv_bfloat16*>(p.C);
        const bool full_n = n0 + kBN <= p.N;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = cwg * 64 + warp * 16 + (lane >> 2) + 8 * h;
          if (r >= tile.rows) continue;
          const int src = tile.row0 + r;
          const int dst_row = p.scatter != nullptr ? p.scatter[src] : src;
          if (dst_row < 0) continue;
          const float s = p.row_scale != nullptr ? p.row_scale[src] : 1.0f;
          __nv_bfloat16* crow = C + static_cast<int64_t>(dst_row) * p.ldc;
          const __nv_bfloat16* hin = p.h_in + static_cast<int64_t>(src) * p.ld_h;
          __nv_bfloat16* arow = p.aux_out != nullptr ? p.aux_out + static_cast<int64_t>(dst_row) * p.ld_aux : nullptr;
#pragma unroll
          for (int j = 0; j < kBN / 8; ++j) {
            const int col = n0 + 8 * j + 2 * q;
            if (!full_n && col >= p.N) continue;
            const int pg = (col / kSwiGLUInterleave) * (2 * kSwiGLUInterleave) + col % kSwiGLUInterleave;
            const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(hin + pg);
            const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(hin + pg + kSwiGLUInterleave);
            const float g[2] = {__low2float(g2), __high2float(g2)};
            const float u[2] = {__low2float(u2), __high2float(u2)};
            float dg[2], du[2], a[2];
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
              const float da = acc[4 * j + 2 * h + k2] * s;
              const float sig = sigmoid_f(g[k2]);
              const float silu = g[k2] * sig;
              dg[k2] = da * u[k2] * sig * (1.0f + g[k2] * (1.0f - sig));
              du[k2] = da * silu;
              a[k2] = silu * u[k2];
            }
            *reinterpret_cast<uint32_t*>(crow + pg) = pack_bf16x2(dg[0], dg[1]);
            *reinterpret_cast<uint32_t*>(crow + pg + kSwiGLUInterleave) = pack_bf16x2(du[0], du[1]);
            if (arow != nullptr) *reinterpret_cast<uint32_t*>(arow + col) = pack_bf16x2(a[0], a[1]);
          }
        }
      } else {
        // Row bookkeeping for the read-back rows (the same in every pass).
        int64_t dst_off[4];
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int r = cwg * 64 + rb_row + 16 * it;
          int d = -1;
          if (r < tile.rows) {
            const int src = tile.row0 + r;
            d = p.scatter != nullptr ? p.scatter[src] : src;
          }
          dst_off[it] = d;  // row index, -1 = do not store
        }
        // Per-row scale of the fragment rows.
        float sc[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = cwg * 64 + warp * 16 + (lane >> 2) + 8 * h;
          sc[h] = (p.row_scale != nullptr && r < tile.rows) ? p.row_scale[tile.row0 + r] : 1.0f;
        }
        // TMA stores need every row of this warpgroup's slice inside the expert (a TMA box is clipped only at
        // the tensor's edge, and rows past the expert belong to the next one) and no scatter. The decision
        // is uniform over the warpgroup.
        const bool tma_slice = kTmaStore && p.tma_store != 0 && tile.rows >= cwg * 64 + 64;
        if constexpr (kTmaStore) {
          // The previous tile's TMA stores were issued a whole main loop ago; make sure they have read the
          // staging boxes before anything is written into them again.
          if (lt == 0) ptx::cp_async_bulk_wait_group_read(ptx::n32_t<0>{});
          sm90::named_barrier_sync(bar_id, 128);
        }
        // Fragment -> staging box for 8 column groups (64 bf16 columns) given as packed bf16x2 values
        // v[jj][h]; stmatrix.x4 stores 4 8x8 matrices: (rows 0-7 | 8-15) x (group jj | jj+1). The 16-byte
        // chunks are XOR-swizzled by row: exactly the 128-byte swizzle a TMA box uses.
        const int sm_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
        const int sm_grp = lane >> 4;
        auto stage_out = [&](const uint32_t(&v)[8][2], int slot) {
          const uint32_t box_s = stg_s + slot * kStagingBytes;
#pragma unroll
          for (int jj = 0; jj < 8; jj += 2) {
            const uint32_t addr = box_s + sm_row * 128 + (((jj + sm_grp) ^ (sm_row & 7)) << 4);
            sm90::stmatrix_x4(addr, v[jj][0], v[jj][1], v[jj + 1][0], v[jj + 1][1]);
          }
        };
        // Staging box -> global by the threads: 64 rows x 64 columns starting at column `col0`.
        auto drain = [&](int slot, __nv_bfloat16* out, int64_t ld, int col0, int ncols) {
          const uint8_t* box = stg + slot * kStagingBytes;
          sm90::named_barrier_sync(bar_id, 128);
          const int col = col0 + rb_chunk * 8;
#pragma unroll
          for (int it = 0; it < 4; ++it) {
            const int row = rb_row + 16 * it;
            if (dst_off[it] >= 0 && col < ncols) {
              const uint4 v = *reinterpret_cast<const uint4*>(box + row * 128 + ((rb_chunk ^ (row & 7)) << 4));
              *reinterpret_cast<uint4*>(out + dst_off[it] * ld + col) = v;
            }
          }
          sm90::named_barrier_sync(bar_id, 128);
        };
        // One 64 x 64 output box of this warpgroup: box number `b` of the tile goes through slot b % kSlots.
        int box_no = 0;
        auto emit = [&](const uint32_t(&v)[8][2], const CUtensorMap* map, __nv_bfloat16* out, int64_t ld, int col0,
                        int ncols) {
          const int b = box_no++;
          const int slot = b % kSlots;
          if (tma_slice) {
            if (b >= kSlots) {
              // Slot reuse inside the tile: the box stored kSlots boxes ago must have been read.
              if (lt == 0) ptx::cp_async_bulk_wait_group_read(ptx::n32_t<kSlots - 1>{});
              sm90::named_barrier_sync(bar_id, 128);
            }
            stage_out(v, slot);
            ptx::fence_proxy_async(ptx::space_shared);  // make the stmatrix writes visible to TMA
            sm90::named_barrier_sync(bar_id, 128);
            if (lt == 0) {
              const int32_t crd[2] = {col0, tile.row0 + cwg * 64};
              ptx::cp_async_bulk_tensor(ptx::space_global, ptx::space_shared, map, crd, stg + slot * kStagingBytes);
              ptx::cp_async_bulk_commit_group();
            }
          } else {
            stage_out(v, slot);
            drain(slot, out, ld, col0, ncols);
          }
        };
        __nv_bfloat16* C = static_cast<__nv_bfloat16*>(p.C);
        if constexpr (kAct == GemmActivation::kNone) {
#pragma unroll
          for (int pass = 0; pass < kBN / 64; ++pass) {
            if (n0 + pass * 64 >= p.N) break;
            uint32_t v[8][2];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int j = pass * 8 + jj;
                v[jj][h] = pack_bf16x2(acc[4 * j + 2 * h] * sc[h], acc[4 * j + 2 * h + 1] * sc[h]);
              }
            emit(v, &tm_c, C, p.ldc, n0 + pass * 64, p.N);
          }
        } else {
          // SwiGLU: internal columns are 64 gate, 64 up, 64 gate, 64 up in a 256-wide tile; a is N/2 wide.
#pragma unroll
          for (int pair = 0; pair < kBN / 128; ++pair) {
            if (n0 + pair * 128 >= p.N) break;
            uint32_t v[8][2];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int jg = pair * 16 + jj, ju = jg + 8;
                const float g0 = acc[4 * jg + 2 * h], g1 = acc[4 * jg + 2 * h + 1];
                const float u0 = acc[4 * ju + 2 * h], u1 = acc[4 * ju + 2 * h + 1];
                v[jj][h] = pack_bf16x2(g0 * sigmoid_f(g0) * u0 * sc[h], g1 * sigmoid_f(g1) * u1 * sc[h]);
              }
            emit(v, &tm_c, C, p.ldc, n0 / 2 + pair * 64, p.N / 2);
          }
          if (p.aux_out != nullptr) {
#pragma unroll
            for (int pass = 0; pass < kBN / 64; ++pass) {
              if (n0 + pass * 64 >= p.N) break;
              uint32_t v[8][2];
#pragma unroll
              for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const int j = pass * 8 + jj;
                  v[jj][h] = pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                }
              emit(v, &tm_aux, p.aux_out, p.ld_aux, n0 + pass * 64, p.N);
            }
          }
        }
      }
    }
    // The staging boxes must not be released while TMA may still read them.
    if constexpr (kTmaStore) {
      if (lt == 0) ptx::cp_async_bulk_wait_group(ptx::n32_t<0>{});
    }
  }
  if constexpr (kCluster > 1) {
    // No CTA may exit while its peer can still arrive on its barriers or multicast into its memory.
    ptx::barrier_cluster_arrive(ptx::sem_release);
    ptx::barrier_cluster_wait(ptx::sem_acquire);
  }
#endif
}

// ---------------------------------------------------------------- host side

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  return fn;
}

// bf16 tensor map, dims[0] innermost (elements), box[0] * 2 bytes == 128 (one swizzle span).
Status make_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims, const uint32_t* box) {
  auto fn = encode_fn();
  if (fn == nullptr) return Status(StatusCode::kCudaError, "cuTensorMapEncodeTiled entry point not available");
  cuuint64_t gdim[3];
  cuuint64_t gstride[2];
  cuuint32_t bdim[3];
  cuuint32_t estride[3] = {1, 1, 1};
  uint64_t stride = 2;
  for (int i = 0; i < rank; ++i) {
    gdim[i] = dims[i];
    bdim[i] = box[i];
    if (i > 0) gstride[i - 1] = stride;
    stride *= dims[i];
  }
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank), const_cast<void*>(base),
                        gdim, gstride, bdim, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status(StatusCode::kCudaError, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)));
  }
  return Status::ok();
}

Status check_device(int* num_sms) {
  int dev = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  int major = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) {
    return Status(StatusCode::kNotSupported, "grouped GEMM needs an sm_90 (Hopper) device, found compute capability " +
                                                 std::to_string(major) + ".x");
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, dev));
  return Status::ok();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The operand and output tensor maps of one launch (tc / taux are only read by the TMA store modes).
struct TensorMaps {
  CUtensorMap a, b, c, aux;
};

template <Form kForm, GemmActivation kAct, int kCluster, GemmStoreMode kStore>
Status launch_cluster(const TensorMaps& maps, const KernelParams& p, cudaStream_t stream, int max_ctas) {
  using SmemLayout = SmemLayoutOf<stages_of(kStore), slots_of(kStore)>;
  int num_sms = 0;
  MEGAMOE_RETURN_IF_ERROR(check_device(&num_sms));
  auto kernel = grouped_gemm_kernel<kForm, kAct, kCluster, kStore>;
  // Set on every call (cheap, and correct on every device of a multi-GPU process).
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SmemLayout::kDynamicBytes));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = SmemLayout::kDynamicBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int grid = num_sms;
  if constexpr (kCluster > 1) {
    // As many co-resident clusters as the GPCs hold (an odd SM count in a GPC leaves one SM out).
    cfg.gridDim = dim3(num_sms, 1, 1);
    int max_clusters = 0;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &cfg));
    if (max_clusters < 1) return Status(StatusCode::kNotSupported, "no 2-CTA cluster fits on this device");
    grid = std::min(num_sms / kCluster, max_clusters) * kCluster;
  }
  // A caller sharing the GPU (virtual ranks) caps the persistent grid at its share of the SMs.
  if (max_ctas > 0 && grid > max_ctas) grid = std::max(kCluster, max_ctas / kCluster * kCluster);
  cfg.gridDim = dim3(grid, 1, 1);
  if (p.work_counter != nullptr) {
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.work_counter, 0, sizeof(int), stream));
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, maps.a, maps.b, maps.c, maps.aux, p));
  MEGAMOE_CHECK_LAUNCH(stream, "grouped_gemm_kernel");
  return Status::ok();
}

template <Form kForm, GemmActivation kAct, GemmStoreMode kStore>
Status launch_store(const TensorMaps& maps, const KernelParams& p, const GemmTuning& tuning, cudaStream_t stream) {
  if (tuning.cluster_size == 2) return launch_cluster<kForm, kAct, 2, kStore>(maps, p, stream, tuning.max_ctas);
  return launch_cluster<kForm, kAct, 1, kStore>(maps, p, stream, tuning.max_ctas);
}

GemmStoreMode resolve_store(GemmStoreMode m) { return m == GemmStoreMode::kDefault ? kDefaultStore : m; }

template <Form kForm, GemmActivation kAct>
Status launch(const TensorMaps& maps, const KernelParams& p, const GemmTuning& tuning, cudaStream_t stream) {
  if constexpr (has_tma_store(kForm, kAct)) {
    switch (resolve_store(tuning.store)) {
      case GemmStoreMode::kTmaBox:
        return launch_store<kForm, kAct, GemmStoreMode::kTmaBox>(maps, p, tuning, stream);
      case GemmStoreMode::kTmaTile:
        return launch_store<kForm, kAct, GemmStoreMode::kTmaTile>(maps, p, tuning, stream);
      default:
        break;
    }
  }
  return launch_store<kForm, kAct, GemmStoreMode::kThreads>(maps, p, tuning, stream);
}

Status check_tuning(const GemmTuning& tuning) {
  if (tuning.cluster_size != 1 && tuning.cluster_size != 2) {
    return Status::invalid("GemmTuning::cluster_size must be 1 or 2, got " + std::to_string(tuning.cluster_size));
  }
  if (tuning.max_ctas < 0) return Status::invalid("GemmTuning::max_ctas must be >= 0");
  const int store = static_cast<int>(tuning.store);
  if (store < static_cast<int>(GemmStoreMode::kDefault) || store > static_cast<int>(GemmStoreMode::kTmaTile)) {
    return Status::invalid("GemmTuning::store is not a GemmStoreMode, got " + std::to_string(store));
  }
  if (tuning.work_counter != nullptr && tuning.cluster_size != 1) {
    return Status::invalid("GemmTuning::work_counter (dynamic scheduling) needs cluster_size 1");
  }
  return Status::ok();
}

Status check_common(const void* A, const void* B, const void* C, const int32_t* offsets, int num_groups,
                    int64_t max_rows) {
  if (A == nullptr || B == nullptr || C == nullptr || offsets == nullptr) return Status::invalid("null pointer");
  if (!aligned16(A) || !aligned16(B) || !aligned16(C)) return Status::invalid("A, B and C must be 16-byte aligned");
  if (num_groups < 1 || num_groups > kGemmMaxGroups) {
    return Status::invalid("num_groups must be in [1, " + std::to_string(kGemmMaxGroups) + "], got " +
                           std::to_string(num_groups));
  }
  if (max_rows < 0 || max_rows >= (int64_t{1} << 31) - kBM) return Status::invalid("max_rows out of range");
  return Status::ok();
}

// The launch parameters every form sets the same way; the epilogue fields stay zero.
KernelParams base_params(const int32_t* group_offsets, int num_groups, int64_t max_rows, int M, int N, int K, void* C,
                         const GemmTuning& tuning) {
  KernelParams p{};
  p.group_offsets = group_offsets;
  p.num_groups = num_groups;
  p.max_rows = static_cast<int>(max_rows);
  p.M = M;
  p.N = N;
  p.K = K;
  p.C = C;
  p.ldc = N;
  p.work_counter = tuning.work_counter;
  return p;
}

Status m_grouped(Form form, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                 const int32_t* group_offsets, int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epi,
                 cudaStream_t stream, const GemmTuning& tuning) {
  MEGAMOE_RETURN_IF_ERROR(check_common(A, B, C, group_offsets, num_groups, max_rows));
  MEGAMOE_RETURN_IF_ERROR(check_tuning(tuning));
  if (N <= 0 || K <= 0 || N % 8 != 0 || K % 8 != 0) {
    return Status::invalid("N and K must be positive multiples of 8, got N=" + std::to_string(N) +
                           " K=" + std::to_string(K));
  }
  KernelParams p = base_params(group_offsets, num_groups, max_rows, 0, N, K, C, tuning);
  p.row_scale = epi.row_scale;
  p.scatter = epi.scatter_rows;
  p.aux_out = epi.aux_out;
  p.ld_aux = N;
  p.h_in = epi.h_in;
  p.ld_h = 2 * int64_t{N};
  if (epi.aux_out != nullptr && !aligned16(epi.aux_out)) return Status::invalid("aux_out must be 16-byte aligned");
  if (epi.activation == GemmActivation::kSwiGLU) {
    if (form != Form::kNT) return Status::invalid("SwiGLU forward epilogue is for grouped_gemm_nt");
    if (N % (2 * kSwiGLUInterleave) != 0) return Status::invalid("SwiGLU: N (= 2I) must be a multiple of 128");
    p.ldc = N / 2;
  } else if (epi.activation == GemmActivation::kSwiGLUBackward) {
    if (form != Form::kNN) return Status::invalid("SwiGLU backward epilogue is for grouped_gemm_nn");
    if (N % kSwiGLUInterleave != 0) return Status::invalid("SwiGLU backward: N (= I) must be a multiple of 64");
    if (epi.h_in == nullptr || !aligned16(epi.h_in)) return Status::invalid("SwiGLU backward needs an aligned h_in");
    p.ldc = 2 * int64_t{N};
  } else if (epi.aux_out != nullptr) {
    return Status::invalid("aux_out is only written by the SwiGLU epilogues");
  }

  TensorMaps maps{};
  const uint64_t rows_a = static_cast<uint64_t>(std::max<int64_t>(max_rows, 1));
  const uint64_t dims_a[2] = {static_cast<uint64_t>(K), rows_a};
  const uint32_t box_a[2] = {64, kBM};
  MEGAMOE_RETURN_IF_ERROR(make_map(&maps.a, A, 2, dims_a, box_a));
  // TMA stores: C (and aux) as [max_rows, width] row-major, in 64 x 64 boxes. Without scatter C has exactly
  // max_rows rows (the contract); with scatter its row count is unknown and the thread path is taken.
  const bool tma_store = tma_store_of(resolve_store(tuning.store)) && epi.scatter_rows == nullptr &&
                         has_tma_store(form, epi.activation);
  if (tma_store) {
    const uint32_t box_c[2] = {64, 64};
    const uint64_t dims_c[2] = {static_cast<uint64_t>(p.ldc), rows_a};
    MEGAMOE_RETURN_IF_ERROR(make_map(&maps.c, C, 2, dims_c, box_c));
    if (epi.aux_out != nullptr) {
      const uint64_t dims_aux[2] = {static_cast<uint64_t>(p.ld_aux), rows_a};
      MEGAMOE_RETURN_IF_ERROR(make_map(&maps.aux, epi.aux_out, 2, dims_aux, box_c));
    }
    p.tma_store = 1;
  }
  if (form == Form::kNT) {
    const uint64_t dims_b[3] = {static_cast<uint64_t>(K), static_cast<uint64_t>(N), static_cast<uint64_t>(num_groups)};
    // With a 2-CTA cluster each CTA loads (and multicasts) half of the B panel.
    const uint32_t box_b[3] = {64, static_cast<uint32_t>(kBN / tuning.cluster_size), 1};
    MEGAMOE_RETURN_IF_ERROR(make_map(&maps.b, B, 3, dims_b, box_b));
    if (epi.activation == GemmActivation::kSwiGLU) {
      return launch<Form::kNT, GemmActivation::kSwiGLU>(maps, p, tuning, stream);
    }
    return launch<Form::kNT, GemmActivation::kNone>(maps, p, tuning, stream);
  }
  const uint64_t dims_b[3] = {static_cast<uint64_t>(N), static_cast<uint64_t>(K), static_cast<uint64_t>(num_groups)};
  const uint32_t box_b[3] = {64, 64, 1};
  MEGAMOE_RETURN_IF_ERROR(make_map(&maps.b, B, 3, dims_b, box_b));
  if (epi.activation == GemmActivation::kSwiGLUBackward) {
    return launch<Form::kNN, GemmActivation::kSwiGLUBackward>(maps, p, tuning, stream);
  }
  return launch<Form::kNN, GemmActivation::kNone>(maps, p, tuning, stream);
}

template <typename T>
__global__ void swiglu_permute_rows_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t I, int64_t cols,
                                           int64_t total_rows, bool to_internal) {
  // One block row-loop per (expert, row); columns strided by the block.
  for (int64_t row = blockIdx.x; row < total_rows; row += gridDim.x) {
    const int64_t e = row / (2 * I), r = row % (2 * I);
    const int64_t dst_r = to_internal ? swiglu_internal_row(r, I) : swiglu_public_row(r, I);
    const T* src = in + row * cols;
    T* dst = out + (e * 2 * I + dst_r) * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
  }
}

template <typename T>
Status permute_rows(const T* in, T* out, int64_t num_experts, int64_t I, int64_t cols, bool to_internal,
                    cudaStream_t stream) {
  if (in == nullptr || out == nullptr) return Status::invalid("null pointer");
  if (num_experts < 0 || I <= 0 || cols <= 0 || I % kSwiGLUInterleave != 0) {
    return Status::invalid("swiglu_permute_rows: I must be a positive multiple of 64, got I=" + std::to_string(I));
  }
  const int64_t total = num_experts * 2 * I;
  if (total == 0) return Status::ok();
  const int blocks = static_cast<int>(std::min<int64_t>(total, 65535));
  swiglu_permute_rows_kernel<T><<<blocks, 256, 0, stream>>>(in, out, I, cols, total, to_internal);
  MEGAMOE_CHECK_LAUNCH(stream, "swiglu_permute_rows_kernel");
  return Status::ok();
}

}  // namespace

Status grouped_gemm_nt(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning) {
  return m_grouped(Form::kNT, A, B, C, group_offsets, num_groups, max_rows, N, K, epilogue, stream, tuning);
}

Status grouped_gemm_nn(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning) {
  return m_grouped(Form::kNN, A, B, C, group_offsets, num_groups, max_rows, N, K, epilogue, stream, tuning);
}

Status grouped_gemm_tn(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int M, int N, bool accumulate, cudaStream_t stream,
                       const GemmTuning& tuning) {
  MEGAMOE_RETURN_IF_ERROR(check_common(A, B, C, group_offsets, num_groups, max_rows));
  MEGAMOE_RETURN_IF_ERROR(check_tuning(tuning));
  if (M <= 0 || N <= 0 || M % 8 != 0 || N % 8 != 0) {
    return Status::invalid("M and N must be positive multiples of 8, got M=" + std::to_string(M) +
                           " N=" + std::to_string(N));
  }
  KernelParams p = base_params(group_offsets, num_groups, max_rows, M, N, 0, C, tuning);
  p.accumulate = accumulate ? 1 : 0;
  // Work items of form 3 are as long as their expert's rows: hand out the longest first.
  p.longest_first = tuning.work_counter != nullptr ? 1 : 0;
  TensorMaps maps{};
  const uint64_t rows = static_cast<uint64_t>(std::max<int64_t>(max_rows, 1));
  const uint64_t dims_a[2] = {static_cast<uint64_t>(M), rows};
  const uint64_t dims_b[2] = {static_cast<uint64_t>(N), rows};
  const uint32_t box[2] = {64, 64};
  MEGAMOE_RETURN_IF_ERROR(make_map(&maps.a, A, 2, dims_a, box));
  MEGAMOE_RETURN_IF_ERROR(make_map(&maps.b, B, 2, dims_b, box));
  return launch<Form::kTN, GemmActivation::kNone>(maps, p, tuning, stream);
}

Status swiglu_permute_rows_bf16(const __nv_bfloat16* in, __nv_bfloat16* out, int64_t num_experts, int64_t I,
                                int64_t cols, bool to_internal, cudaStream_t stream) {
  return permute_rows(in, out, num_experts, I, cols, to_internal, stream);
}

Status swiglu_permute_rows_f32(const float* in, float* out, int64_t num_experts, int64_t I, int64_t cols,
                               bool to_internal, cudaStream_t stream) {
  return permute_rows(in, out, num_experts, I, cols, to_internal, stream);
}

Status grouped_gemm_preload() {
  // The kernels the default tuning launches (cluster 1, the default store mode).
  constexpr GemmStoreMode kS = kDefaultStore;
  constexpr GemmStoreMode kT = GemmStoreMode::kThreads;
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, grouped_gemm_kernel<Form::kNT, GemmActivation::kNone, 1, kS>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, grouped_gemm_kernel<Form::kNN, GemmActivation::kNone, 1, kS>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, grouped_gemm_kernel<Form::kTN, GemmActivation::kNone, 1, kT>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, grouped_gemm_kernel<Form::kNT, GemmActivation::kSwiGLU, 1, kS>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, grouped_gemm_kernel<Form::kNN, GemmActivation::kSwiGLUBackward, 1, kT>));
  return Status::ok();
}

}  // namespace megamoe::kernels
