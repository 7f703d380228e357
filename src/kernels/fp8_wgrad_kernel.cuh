// The FP8 weight-gradient GEMM kernel (fp8_wgrad.hpp), composed like the FP8 GEMM (fp8_gemm_kernel.cuh): one
// persistent, warp-specialised CTA of 384 threads per SM, tile 128 x BN of one expert's [M, N] output (BN 128,
// or 192: fewer shared-memory bytes per output element, the plain loop in single CTAs), one 128-deep K block
// (128 routed rows) per stage; alone or in 2-CTA clusters, where a work item is a pair of
// vertically adjacent tiles sharing their B panel (each CTA loads one half of it and multicasts it to both,
// so a stage costs the L2 three quarters of its operand bytes, as in the FP8 GEMM). The reduction is
// K-grouped: an expert's K blocks are its segment of the token-major copies (kernels/fp8_token_major.hpp),
// which starts at a multiple of 128 columns.
//   warpgroup 0, the producer: thread 0 loads a stage's A box (the tile's 128 rows of qa) and B box (its BN
//     rows of qb, or in a cluster its half of them, multicast; rows past N load as zeros) with TMA; thread 32
//     the stage's 128 + BN scales (load_channel_scales: each CTA its own);
//   warpgroups 1 and 2, the consumers: 64 rows each, mma_tile_fp8_channel_scaled, then the fp32 epilogue
//     (stored in fp32 or rounded once to bf16, or added to what D holds; columns past N are not stored),
//     through a staging box, or for a transposed D straight from the accumulators (whose configurations leave
//     the staging boxes unused).
// An expert without rows still has its tiles: they store zeros (or add nothing).
#pragma once

#include <cuda_bf16.h>

#include "device/epilogue/box_store.cuh"
#include "device/epilogue/epilogues.cuh"
#include "device/gemm/block_scales.cuh"
#include "device/gemm/fp8_mainloop.cuh"
#include "device/gemm/operands.cuh"
#include "device/gemm/shape.cuh"
#include "device/pipeline.cuh"
#include "device/ptx/grid_dependency.cuh"
#include "device/ptx/sync.cuh"
#include "device/ptx/tma.cuh"
#include "device/sched/grouped_tiles.cuh"
#include "device/sched/schedulers.cuh"
#include "device/shared_storage.cuh"
#include "kernels/fp8_token_major.hpp"

namespace megamoe::kernels {

inline constexpr int kFp8WgradThreads = 384;

struct Fp8WgradParams {
  const int32_t* offsets;  // device [experts + 1]: routed-row offsets of the experts
  int experts;
  int capacity;            // routed rows (offsets are clamped into [0, capacity])
  int M, N;                // output rows and columns of each expert (multiples of 128)
  float* D;                // [experts, M, N] fp32, or [experts, N, M] with the configuration's kTransposeD
  __nv_bfloat16* D16;      // the same in bf16, for the configurations with kBf16D (D unused then)
  int accumulate;          // 1: D += the gradient
};

// kOverlap_: the consumers' loop is mma_tile_fp8_channel_scaled_overlapped (232 registers for them, 40 for
// the producer). kCluster_: 1, or 2 for the pairs of m-tiles sharing B (M a multiple of 256, fp8_wgrad.cu).
// kBN_: 128, or 192 with the plain loop in single CTAs (two 96-register accumulators a consumer thread; the
// overlapped loop's third would not fit). kTransposeD_: each D[e] stored transposed, in single CTAs (a
// configuration of its own: a run-time choice between the two epilogues made every form 5-15% slower,
// docs/PERF.md run 135). kBf16D_: D in bf16 (D16), single CTAs; configurations of their own, so that the fp32
// ones keep their code.
template <bool kOverlap_ = false, int kCluster_ = 1, int kBN_ = 128, bool kTransposeD_ = false, bool kBf16D_ = false>
struct Fp8WgradConfig {
  static constexpr bool kOverlap = kOverlap_;
  static constexpr int kCluster = kCluster_;
  static constexpr int kBN = kBN_;
  static constexpr bool kTransposeD = kTransposeD_;
  static constexpr bool kBf16D = kBf16D_;
  static_assert(!kTransposeD || kCluster == 1, "transposed D: single CTAs");
  static_assert(!kBf16D || kCluster == 1, "bf16 D: single CTAs");
  static_assert(kBN == 128 || (kBN == 192 && !kOverlap && kCluster == 1), "192 columns: plain loop, single CTAs");
  // 5 x 32 KB stages (or 4 x 40 KB) + their scale slots + two 8 KB fp32 staging boxes + the numbering's tables.
  static constexpr int kStages = kBN == 128 ? 5 : 4;
  // The bf16-pair view of the e4m3 operands: kBK = 64 "bf16" = 128 e4m3 = one K block (fp8_mainloop.cuh).
  using Shape = device::MainloopShape<device::GemmForm::kNT, kBN, kStages, kCluster>;
  // Numbered over routed rows: one stage = 128 of them.
  using Tiles = device::GroupedTiles<Shape::kBM, kBN, 128, kCluster, true>;
  // Rows of B one CTA loads per stage (the tensor map's box, fp8_wgrad.cu).
  static constexpr int kBRowsLoaded = kBN / kCluster;
  static constexpr int kFullArrivals = 2;  // the operand thread's transaction count, the scale thread's
  static constexpr int kEmptyArrivals = device::kFp8ChannelEmptyArrivals<Shape>;
  static constexpr int kScaleThread = 32;
  static constexpr int kProducerRegs = kOverlap ? 40 : 56;
  static constexpr int kConsumerRegs = kOverlap ? 232 : 224;
  static_assert(device::kRegisterSplitFits<kFp8WgradThreads, kProducerRegs, kConsumerRegs>, "register budget");

  struct alignas(1024) SharedStorage {
    uint8_t stages[kStages][Shape::kStageBytes];
    uint8_t staging[2][device::kBoxBytes];
    device::StageChannelScales<kBN> scales[kStages];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    typename Tiles::Storage tiles;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget");
};

// The tile's first K column in the token-major copies: its expert's segment, then 128 per K block.
__device__ __forceinline__ int wgrad_k_column(const device::TileCoord& tile, int kt) {
  return static_cast<int>(token_major_start(tile.row0, tile.e)) + 128 * kt;
}

template <class Cfg>
__device__ __forceinline__ void fp8_wgrad_producer(const CUtensorMap* tm_a, const CUtensorMap* tm_b,
                                                   const CUtensorMap* tm_sa, const CUtensorMap* tm_sb,
                                                   typename Cfg::SharedStorage& smem,
                                                   const typename Cfg::Tiles& tiles,
                                                   const device::StaticSchedule& sched, int rank, int ptid) {
  using Shape = typename Cfg::Shape;
  if (ptid != 0 && ptid != Cfg::kScaleThread) return;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  device::PipeState<Shape::kStages> st;
  const int total = tiles.total();
  for (int j = 0;; ++j) {
    const int t = sched.item(j);
    if (t >= total) break;
    const device::TileCoord tile = tiles.decode(t, rank);
    const int m0 = tile.m_idx * Shape::kBM, n0 = tile.n_idx * Shape::kBN;
    for (int kt = 0; kt < tile.k_tiles; ++kt) {
      pipe.producer_acquire(st);
      const int k = wgrad_k_column(tile, kt);
      if (ptid == 0) {
        uint64_t* bar = pipe.full_barrier(st);
        uint8_t* stage = smem.stages[st.index];
        // The whole B panel lands here: in a cluster, half of it from the peer's multicast.
        pipe.producer_expect_tx(st, static_cast<uint32_t>(Shape::kABytes + Shape::kBBytes));
        // Coordinates in bf16 pairs along K (two e4m3 each), rows as they are.
        device::tma_load_2d(stage, tm_a, k / 2, m0, bar);
        if constexpr (Cfg::kCluster == 1) {
          device::tma_load_2d(stage + Shape::kABytes, tm_b, k / 2, n0, bar);
        } else {
          // Rows n0 + 64 rank ..: 8 KB on, a multiple of the swizzle's 1 KB period, so the halves together are
          // laid out as one whole box.
          constexpr int kHalfBytes = Shape::kBBytes / 2;
          device::tma_load_2d_multicast(stage + Shape::kABytes + rank * kHalfBytes, tm_b, k / 2,
                                        n0 + rank * Cfg::kBRowsLoaded, bar, device::kClusterPairMask);
        }
      } else {
        device::load_channel_scales(pipe, st, &smem.scales[st.index], tm_sa, tm_sb, m0, n0, k / 128);
      }
      st.advance();
    }
  }
}

// kCwg: the consumer warpgroup, rows 64 kCwg .. 64 kCwg + 63 of the tile (a constant of the instantiation,
// as in fp8_gemm_kernel.cuh).
template <class Cfg, int kCwg>
__device__ __forceinline__ void fp8_wgrad_consumer(const Fp8WgradParams& p, typename Cfg::SharedStorage& smem,
                                                   const typename Cfg::Tiles& tiles,
                                                   const device::StaticSchedule& sched, int rank, int tid) {
  using Shape = typename Cfg::Shape;
  constexpr int kBN = Shape::kBN;
  constexpr int cwg = kCwg;
  const int lt = tid & 127;
  const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
  device::PipeState<Shape::kStages> st;
  float acc[kBN / 2];
  for (int j = 0;; ++j) {
    const int t = sched.item(j);
    if (t >= tiles.total_now()) break;
    const device::TileCoord tile = tiles.decode(t, rank);
    if constexpr (Cfg::kOverlap) {
      device::mma_tile_fp8_channel_scaled_overlapped<Shape>(acc, pipe, st, smem.stages[0], smem.scales,
                                                            max(tile.k_tiles, 0), cwg, lt, rank);
    } else {
      device::mma_tile_fp8_channel_scaled<Shape>(acc, pipe, st, smem.stages[0], smem.scales, max(tile.k_tiles, 0),
                                                 cwg, lt, rank);
    }
    auto* d = [&] {
      const int64_t offset = static_cast<int64_t>(tile.e) * p.M * p.N;
      if constexpr (Cfg::kBf16D) {
        return p.D16 + offset;
      } else {
        return p.D + offset;
      }
    }();
    const int m0 = tile.m_idx * Shape::kBM + 64 * cwg, n0 = tile.n_idx * kBN;
    if constexpr (Cfg::kTransposeD) {
      device::epilogue_fp32_transposed_direct<kBN>(acc, d, p.M, p.N, m0, n0, p.accumulate != 0, lt);
    } else {
      device::epilogue_fp32<kBN>(acc, d, p.M, p.N, m0, n0, p.accumulate != 0, smem.staging[cwg], 2 + cwg, lt);
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(kFp8WgradThreads, 1)
    fp8_wgrad_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                     const __grid_constant__ CUtensorMap tm_sa, const __grid_constant__ CUtensorMap tm_sb,
                     const Fp8WgradParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Shape = typename Cfg::Shape;
  auto& smem = device::shared_storage<typename Cfg::SharedStorage>();
  const int tid = threadIdx.x;
  const typename Cfg::Tiles tiles{&smem.tiles, p.experts, (p.N + Shape::kBN - 1) / Shape::kBN, p.M, 0};
  if (tid == 0) {
    const device::StagePipeline<Shape::kStages> pipe{smem.full, smem.empty};
    pipe.init(Cfg::kFullArrivals, Cfg::kEmptyArrivals);
    device::mbarrier_init_fence();
  }
  device::begin_dependent_grid();  // the offsets and both operands come from earlier kernels
  __syncthreads();
  tiles.build(p.offsets, p.capacity, false, tid, kFp8WgradThreads);
  // In a cluster the peer multicasts into this CTA's shared memory and arrives on its barriers: both CTAs
  // must have initialised them first. Both walk the same items (same experts, so the same stages).
  if constexpr (Shape::kCluster > 1) device::cluster_sync();
  const int rank = Shape::kCluster == 1 ? 0 : static_cast<int>(device::cluster_cta_rank());
  const int cluster = Shape::kCluster == 1 ? static_cast<int>(blockIdx.x) : static_cast<int>(device::cluster_id_x());
  const device::StaticSchedule sched{cluster, static_cast<int>(gridDim.x) / Shape::kCluster};
  // Overlapped, the role branch must be uniform to ptxas (fp8_gemm_kernel.cuh): a shuffled warpgroup index.
  const int warpgroup = Cfg::kOverlap ? __shfl_sync(0xffffffffu, tid / 128, 0) : tid / 128;
  if (warpgroup == 0) {
    device::setmaxnreg_dec<Cfg::kProducerRegs>();
    fp8_wgrad_producer<Cfg>(&tm_a, &tm_b, &tm_sa, &tm_sb, smem, tiles, sched, rank, tid);
  } else {
    device::setmaxnreg_inc<Cfg::kConsumerRegs>();
    if (warpgroup == 1) {
      fp8_wgrad_consumer<Cfg, 0>(p, smem, tiles, sched, rank, tid);
    } else {
      fp8_wgrad_consumer<Cfg, 1>(p, smem, tiles, sched, rank, tid);
    }
  }
  // No CTA may exit while its peer can still arrive on its barriers or multicast into its memory.
  if constexpr (Shape::kCluster > 1) device::cluster_sync();
#endif
}

}  // namespace megamoe::kernels
