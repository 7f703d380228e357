// Host side of the Hopper grouped-GEMM engine: argument checks, launch-shape resolution, tensor maps and
// kernel parameters. The kernel is composed in grouped_gemm_kernel.cuh from the device building blocks
// (src/device/); docs/GEMM.md has the design and the measured figures.
#include <algorithm>
#include <cstdint>
#include <string>

#include "host/tensor_map.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/grouped_gemm_launch.hpp"

namespace megamoe::kernels {

namespace {

constexpr int kBM = 128;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int resolved_tile_n(const GemmTuning& t) { return t.tile_n == 0 ? 256 : t.tile_n; }

// The launch shape the kernels are instantiated for. kDefault picks the measured fastest store: TMA tiles
// where the outputs are contiguous (docs/GEMM.md: +0.5..+5.2% over the threads), else the threads (whose
// configuration has one pipeline stage more).
Status resolve_tuning(const GemmTuning& in, bool bf16_epilogue, bool contiguous_outputs, bool gathered,
                      GemmTuning* out) {
  if (in.cluster_size != 1 && in.cluster_size != 2) {
    return Status::invalid("GemmTuning::cluster_size must be 1 or 2, got " + std::to_string(in.cluster_size));
  }
  if (in.max_ctas < 0) return Status::invalid("GemmTuning::max_ctas must be >= 0");
  const int store = static_cast<int>(in.store);
  if (in.store != GemmStoreMode::kDefault && in.store != GemmStoreMode::kThreads &&
      in.store != GemmStoreMode::kTmaTile) {
    return Status::invalid("GemmTuning::store is not a GemmStoreMode, got " + std::to_string(store));
  }
  if (in.tile_n != 0 && in.tile_n != 128 && in.tile_n != 256) {
    return Status::invalid("GemmTuning::tile_n must be 0 (default), 128 or 256, got " + std::to_string(in.tile_n));
  }
  if (in.work_counter != nullptr && in.cluster_size != 1) {
    return Status::invalid("GemmTuning::work_counter (dynamic scheduling) needs cluster_size 1");
  }
  if (in.cluster_size == 2 && resolved_tile_n(in) != 256) {
    return Status::invalid("GemmTuning: 2-CTA clusters use the 256-wide tile");
  }
  if (in.cluster_size == 2 && gathered) return Status::invalid("gathered operands need cluster_size 1");
  *out = in;
  out->tile_n = resolved_tile_n(in);
  if (!bf16_epilogue) {
    out->store = GemmStoreMode::kThreads;
  } else if (in.store == GemmStoreMode::kDefault) {
    out->store = contiguous_outputs ? GemmStoreMode::kTmaTile : GemmStoreMode::kThreads;
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

Status check_gather(const int32_t* rows, int64_t source_rows, const char* which) {
  if (rows == nullptr) return Status::ok();
  if (source_rows < 1 || source_rows >= (int64_t{1} << 31)) {
    return Status::invalid(std::string("GemmGather: ") + which + "_source_rows must be in [1, 2^31), got " +
                           std::to_string(source_rows));
  }
  return Status::ok();
}

GemmKernelParams base_params(const int32_t* group_offsets, int num_groups, int64_t max_rows, int M, int N, int K,
                             const GemmTuning& tuning) {
  GemmKernelParams p{};
  p.group_offsets = group_offsets;
  p.num_groups = num_groups;
  p.max_rows = static_cast<int>(max_rows);
  p.M = M;
  p.N = N;
  p.K = K;
  p.work_counter = tuning.work_counter;
  return p;
}

enum class MForm { kNT, kNN };

Status m_grouped(MForm form, const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                 const int32_t* group_offsets, int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epi,
                 cudaStream_t stream, const GemmTuning& tuning, const GemmGather& gather, const GemmReadiness& ready) {
  MEGAMOE_RETURN_IF_ERROR(check_common(A, B, C, group_offsets, num_groups, max_rows));
  if (N <= 0 || K <= 0 || N % 8 != 0 || K % 8 != 0) {
    return Status::invalid("N and K must be positive multiples of 8, got N=" + std::to_string(N) +
                           " K=" + std::to_string(K));
  }
  if (gather.b_rows != nullptr) return Status::invalid("GemmGather: B rows are gathered in form 3 only");
  MEGAMOE_RETURN_IF_ERROR(check_gather(gather.a_rows, gather.a_source_rows, "a"));
  if (epi.scatter_rows != nullptr && epi.row_pointers != nullptr) {
    return Status::invalid("GemmEpilogue: scatter_rows and row_pointers exclude each other");
  }
  if (epi.aux_out != nullptr && !aligned16(epi.aux_out)) return Status::invalid("aux_out must be 16-byte aligned");
  const bool contiguous = epi.scatter_rows == nullptr && epi.row_pointers == nullptr;
  GemmLaunch l{};
  MEGAMOE_RETURN_IF_ERROR(resolve_tuning(tuning, true, contiguous, gather.a_rows != nullptr, &l.tuning));
  const int BN = l.tuning.tile_n;
  // The only configurations of the SwiGLU backward (grouped_gemm_kernel.cuh); they store through the threads
  // where the outputs are not contiguous.
  if (epi.activation == GemmActivation::kSwiGLUBackward) l.tuning.store = GemmStoreMode::kTmaTile;
  l.activation = epi.activation;
  l.gather_a = gather.a_rows != nullptr;
  GemmKernelParams& p = l.p;
  p = base_params(group_offsets, num_groups, max_rows, 0, N, K, l.tuning);
  device::EpilogueArgs& e = p.epi;
  e.row_scale = epi.row_scale;
  int64_t ldc = N;
  int64_t ld_aux = N;
  switch (epi.activation) {
    case GemmActivation::kSwiGLU:
      if (form != MForm::kNT) return Status::invalid("SwiGLU forward epilogue is for grouped_gemm_nt");
      if (N % BN != 0) {
        return Status::invalid("SwiGLU: N (= 2I) must be a multiple of the tile width " + std::to_string(BN) +
                               ", got " + std::to_string(N));
      }
      ldc = N / 2;
      e.up_offset = N / 2;
      break;
    case GemmActivation::kSwiGLUBackward:
      if (form != MForm::kNN) return Status::invalid("SwiGLU backward epilogue is for grouped_gemm_nn");
      if (N % 64 != 0) return Status::invalid("SwiGLU backward: N (= I) must be a multiple of 64");
      if (epi.h_in == nullptr || !aligned16(epi.h_in)) return Status::invalid("SwiGLU backward needs an aligned h_in");
      // Its staged form (128-wide tiles) stages w * a with dh in every box and commits all three
      // (BoxStore::reserve counts on it): without an aux output a staging slot could be rewritten while a
      // store still reads it.
      if (epi.aux_out == nullptr) return Status::invalid("SwiGLU backward needs aux_out (w * a)");
      ldc = 2 * int64_t{N};
      e.up_offset = N;
      e.dot_rows = epi.row_dots;
      // h reaches the epilogue through the pipeline, in the boxes of 64 columns x 128 rows TMA loads.
      MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&l.h, epi.h_in, 2 * int64_t{N}, max_rows, kBM));
      break;
    default:
      if (epi.aux_out != nullptr) return Status::invalid("aux_out is only written by the SwiGLU epilogues");
      if (epi.row_dots != nullptr) return Status::invalid("row_dots are only written by the SwiGLU backward");
  }
  e.c = device::OutputRows{C, ldc, epi.scatter_rows, epi.row_pointers};
  e.aux = device::OutputRows{epi.aux_out, ld_aux, epi.scatter_rows, nullptr};
  e.c_cols = static_cast<int>(ldc);
  e.aux_cols = static_cast<int>(ld_aux);

  if (l.gather_a) {
    p.src.a = device::gathered_rows(A, K, gather.a_rows, gather.a_source_rows);
  } else {
    MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&l.a, A, K, max_rows, kBM));
  }
  // TMA stores: C (and aux) as [max_rows, width] row-major, in 64 x 64 boxes. Without scatter or row
  // pointers C has exactly max_rows rows (the contract); otherwise the thread path is taken.
  if (l.tuning.store == GemmStoreMode::kTmaTile && contiguous) {
    MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&l.c, C, ldc, max_rows, 64));
    if (epi.aux_out != nullptr) MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&l.aux, epi.aux_out, ld_aux, max_rows, 64));
    p.tma_store = 1;
  }
  if (form == MForm::kNT) {
    // The B panel of a tile comes in two halves of BN / 2 rows (each CTA of a 2-CTA cluster loads one):
    // rows n * BN and n * BN + BN / 2, or for SwiGLU the gate rows n * BN / 2 and the up rows I + n * BN / 2.
    MEGAMOE_RETURN_IF_ERROR(make_bf16_experts_map(&l.b, B, K, N, num_groups, static_cast<uint32_t>(BN / 2)));
    const bool swiglu = epi.activation == GemmActivation::kSwiGLU;
    p.src.b_row_step = swiglu ? BN / 2 : BN;
    p.src.b_half_offset = swiglu ? N / 2 : BN / 2;
  } else {
    MEGAMOE_RETURN_IF_ERROR(make_bf16_experts_map(&l.b, B, N, K, num_groups, 64));
  }
  if (ready.counters != nullptr) {
    if (ready.error == nullptr || ready.timeout_ns == 0) {
      return Status::invalid("GemmReadiness needs an error record and a positive timeout");
    }
    p.ready = device::ReadinessGate{ready.counters, ready.target,
                                    device::WaitReport{ready.error, ready.rank, ready.timeout_ns}};
  }
  return form == MForm::kNT ? launch_grouped_gemm_nt(l, stream) : launch_grouped_gemm_nn(l, stream);
}

}  // namespace

int grouped_gemm_n_tiles(int N, const GemmTuning& tuning) {
  const int BN = resolved_tile_n(tuning);
  return (N + BN - 1) / BN;
}

Status grouped_gemm_nt(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning, const GemmGather& gather,
                       const GemmReadiness& readiness) {
  return m_grouped(MForm::kNT, A, B, C, group_offsets, num_groups, max_rows, N, K, epilogue, stream, tuning, gather,
                   readiness);
}

Status grouped_gemm_nn(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int N, int K, const GemmEpilogue& epilogue,
                       cudaStream_t stream, const GemmTuning& tuning, const GemmGather& gather,
                       const GemmReadiness& readiness) {
  return m_grouped(MForm::kNN, A, B, C, group_offsets, num_groups, max_rows, N, K, epilogue, stream, tuning, gather,
                   readiness);
}

namespace {

// Form 3 into C32 (fp32) or C16 (bf16), whichever is given.
Status k_grouped(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C32, __nv_bfloat16* C16,
                 const int32_t* group_offsets, int num_groups, int64_t max_rows, int M, int N, bool accumulate,
                 cudaStream_t stream, const GemmTuning& tuning, const GemmGather& gather, bool transpose_c) {
  const void* C = C16 != nullptr ? static_cast<const void*>(C16) : static_cast<const void*>(C32);
  MEGAMOE_RETURN_IF_ERROR(check_common(A, B, C, group_offsets, num_groups, max_rows));
  if (M <= 0 || N <= 0 || M % 8 != 0 || N % 8 != 0) {
    return Status::invalid("M and N must be positive multiples of 8, got M=" + std::to_string(M) +
                           " N=" + std::to_string(N));
  }
  MEGAMOE_RETURN_IF_ERROR(check_gather(gather.a_rows, gather.a_source_rows, "a"));
  MEGAMOE_RETURN_IF_ERROR(check_gather(gather.b_rows, gather.b_source_rows, "b"));
  GemmLaunch l{};
  l.gather_a = gather.a_rows != nullptr;
  l.gather_b = gather.b_rows != nullptr;
  MEGAMOE_RETURN_IF_ERROR(resolve_tuning(tuning, false, true, l.gather_a || l.gather_b, &l.tuning));
  l.activation = GemmActivation::kNone;
  GemmKernelParams& p = l.p;
  p = base_params(group_offsets, num_groups, max_rows, M, N, 0, l.tuning);
  p.c32 = C32;
  p.c16 = C16;
  p.accumulate = accumulate ? 1 : 0;
  p.transpose_c = transpose_c ? 1 : 0;
  // Work items of form 3 are as long as their expert's rows: hand out the longest first.
  p.longest_first = tuning.work_counter != nullptr ? 1 : 0;
  if (l.gather_a) {
    p.src.a = device::gathered_rows(A, M, gather.a_rows, gather.a_source_rows);
  } else {
    MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&l.a, A, M, max_rows, 64));
  }
  if (l.gather_b) {
    p.src.b = device::gathered_rows(B, N, gather.b_rows, gather.b_source_rows);
  } else {
    MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&l.b, B, N, max_rows, 64));
  }
  return launch_grouped_gemm_tn(l, stream);
}

}  // namespace

Status grouped_gemm_tn(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, const int32_t* group_offsets,
                       int num_groups, int64_t max_rows, int M, int N, bool accumulate, cudaStream_t stream,
                       const GemmTuning& tuning, const GemmGather& gather, bool transpose_c) {
  return k_grouped(A, B, C, nullptr, group_offsets, num_groups, max_rows, M, N, accumulate, stream, tuning, gather,
                   transpose_c);
}

Status grouped_gemm_tn(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                       const int32_t* group_offsets, int num_groups, int64_t max_rows, int M, int N, bool accumulate,
                       cudaStream_t stream, const GemmTuning& tuning, const GemmGather& gather, bool transpose_c) {
  return k_grouped(A, B, nullptr, C, group_offsets, num_groups, max_rows, M, N, accumulate, stream, tuning, gather,
                   transpose_c);
}

Status grouped_gemm_preload() {
  MEGAMOE_RETURN_IF_ERROR(preload_grouped_gemm_nt());
  MEGAMOE_RETURN_IF_ERROR(preload_grouped_gemm_nn());
  return preload_grouped_gemm_tn();
}

}  // namespace megamoe::kernels
