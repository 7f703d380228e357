// Host side of the fused kernels: shape checks, tensor maps of their two GEMMs, the kernels' parameters and
// their cooperative launches (one CTA per SM of the rank's share).
#include <algorithm>
#include <string>

#include "host/tensor_map.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_layout.cuh"
#include "kernels/ep_route_rows.cuh"
#include "kernels/fused_backward_kernel.cuh"
#include "kernels/fused_forward.hpp"
#include "kernels/fused_forward_kernel.cuh"

namespace megamoe::ep {
namespace {

using kernels::FusedForwardConfig;
using kernels::FusedForwardParams;
constexpr int kBN = FusedForwardConfig::kBN;
constexpr int kBM = FusedForwardConfig::Shape::kBM;
constexpr int kBK = FusedForwardConfig::Shape::kBK;

// A cooperative launch: the CTAs wait on each other (grid barriers, readiness counters), so either all of them
// are resident at once or the launch fails with an error, instead of spinning until the timeout. (The kernel's
// shared memory size was set once, by load_fused_forward_kernels.)
template <class Kernel, class... Args>
Status launch_cooperative(Kernel kernel, int ctas, int smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.gridDim = dim3(ctas, 1, 1);
  cfg.blockDim = dim3(kernels::kFusedThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, args...));
  return Status::ok();
}

// The second GEMM's epilogue of either kernel: each row of H columns through the row pointers route_rows wrote
// (row_dest) into its slot of the combine buffer on its source rank.
device::EpilogueArgs rows_home_epilogue(const Params& p, int64_t H) {
  device::EpilogueArgs e{};
  e.c = device::OutputRows{nullptr, H, nullptr, reinterpret_cast<void* const*>(p.local + p.layout.row_dest)};
  e.aux = device::OutputRows{nullptr, H, nullptr, nullptr};
  e.c_cols = static_cast<int>(H);
  e.aux_cols = static_cast<int>(H);
  return e;
}

}  // namespace

Status check_fused_forward_shape(const Shape& s) {
  if (s.experts_per_rank > kernels::kFusedMaxExperts)
    return Status(StatusCode::kNotSupported, "fused forward: at most " + std::to_string(kernels::kFusedMaxExperts) +
                                                 " local experts per rank, got " + std::to_string(s.experts_per_rank));
  if (s.num_ranks > kernels::kFusedMaxRanks)
    return Status(StatusCode::kNotSupported, "fused forward: at most " + std::to_string(kernels::kFusedMaxRanks) +
                                                 " ranks, got " + std::to_string(s.num_ranks));
  const int64_t tables = std::max(layout_assign_smem<kernels::kFusedWarps>(s), RouteTables::smem_bytes(s));
  if (tables > FusedForwardConfig::kScratchBytes)
    return Status(StatusCode::kNotSupported, "fused forward: E + R = " + std::to_string(s.num_experts + s.num_ranks) +
                                                 " is too many for the layout's shared-memory tables");
  if ((2 * static_cast<int64_t>(s.intermediate)) % kBN != 0)
    return Status(StatusCode::kNotSupported, "fused forward: 2I must be a multiple of " + std::to_string(kBN));
  return Status::ok();
}

Status launch_fused_forward(const Params& p, const FusedForwardArgs& a, int max_blocks, cudaStream_t stream) {
  const Shape& s = p.shape;
  MEGAMOE_RETURN_IF_ERROR(check_fused_forward_shape(s));
  const int64_t H = s.hidden, I = s.intermediate, EL = s.experts_per_rank, C = s.row_capacity;
  const int64_t source_rows = static_cast<int64_t>(s.num_ranks) * s.max_tokens;
  char* w = p.local;
  auto* recv_x = reinterpret_cast<__nv_bfloat16*>(w + p.layout.recv_x);
  auto* act = reinterpret_cast<__nv_bfloat16*>(w + p.layout.a);
  auto* h = reinterpret_cast<__nv_bfloat16*>(w + p.layout.h);

  CUtensorMap tm_w13{}, tm_a_load{}, tm_w2{}, tm_a_store{}, tm_h_store{};
  MEGAMOE_RETURN_IF_ERROR(make_bf16_experts_map(&tm_w13, a.w13, H, 2 * I, EL, kBN / 2));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_experts_map(&tm_w2, a.w2, I, H, EL, kBN / 2));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_a_load, act, I, C, kBM));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_a_store, act, I, C, 64));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_h_store, h, 2 * I, C, 64));

  FusedForwardParams k{};
  k.layer = p;
  k.x = a.x;
  k.topk_idx = a.topk_idx;
  k.topk_weights = a.topk_weights;
  k.out = a.out;
  k.timeline = a.timeline;
  const int ctas = std::max(1, max_blocks);
  k.layout_blocks = layout_blocks(p.num_tokens, ctas);
  k.wave_lag = static_cast<int>(std::min<int64_t>(std::max(a.wave_lag, 0), EL));  // past EL: the same order
  k.n_tiles[0] = static_cast<int>(2 * I / kBN);
  k.n_tiles[1] = static_cast<int>((H + kBN - 1) / kBN);
  k.k_tiles[0] = static_cast<int>((H + kBK - 1) / kBK);
  k.k_tiles[1] = static_cast<int>((I + kBK - 1) / kBK);
  // GEMM1: x rows gathered from the receive slabs; each tile loads matching gate and up half panels of W13.
  k.gemm1_src.a = device::gathered_rows(recv_x, H, reinterpret_cast<const int32_t*>(w + p.layout.row_src), source_rows);
  k.gemm1_src.b_row_step = kBN / 2;
  k.gemm1_src.b_half_offset = static_cast<int>(I);
  k.gemm1_epi.c = device::OutputRows{act, I, nullptr, nullptr};
  // h only when the backward is to read it (LayerOptions::recompute_h off).
  k.gemm1_epi.aux = device::OutputRows{s.recompute_h != 0 ? nullptr : h, 2 * I, nullptr, nullptr};
  k.gemm1_epi.c_cols = static_cast<int>(I);
  k.gemm1_epi.aux_cols = static_cast<int>(2 * I);
  k.gemm1_epi.up_offset = static_cast<int>(I);
  // GEMM2: y rows through the row pointers into the sources' combine slots.
  k.gemm2_src.b_row_step = kBN;
  k.gemm2_src.b_half_offset = kBN / 2;
  k.gemm2_epi = rows_home_epilogue(p, H);

  const int smem = FusedForwardConfig::kSmemBytes;
  MEGAMOE_RETURN_IF_ERROR(a.idx_is_int64 ? launch_cooperative(kernels::fused_forward_kernel<int64_t>, ctas, smem,
                                                              stream, tm_w13, tm_a_load, tm_w2, tm_a_store,
                                                              tm_h_store, k)
                                         : launch_cooperative(kernels::fused_forward_kernel<int32_t>, ctas, smem,
                                                              stream, tm_w13, tm_a_load, tm_w2, tm_a_store,
                                                              tm_h_store, k));
  MEGAMOE_CHECK_LAUNCH(stream, "fused_forward_kernel");
  return Status::ok();
}

Status launch_fused_backward(const Params& p, const FusedBackwardArgs& a, int max_blocks, cudaStream_t stream) {
  using kernels::FusedBackwardConfig;
  using kernels::FusedBackwardParams;
  const Shape& s = p.shape;
  MEGAMOE_RETURN_IF_ERROR(check_fused_forward_shape(s));
  const int64_t H = s.hidden, I = s.intermediate, EL = s.experts_per_rank, C = s.row_capacity;
  const int64_t source_rows = static_cast<int64_t>(s.num_ranks) * s.max_tokens;
  char* w = p.local;
  auto* recv_dout = reinterpret_cast<__nv_bfloat16*>(w + p.layout.recv_dout);
  auto* act = reinterpret_cast<__nv_bfloat16*>(w + p.layout.a);
  auto* h = reinterpret_cast<__nv_bfloat16*>(w + p.layout.h);
  auto* dh = reinterpret_cast<__nv_bfloat16*>(w + p.layout.dh);

  // dgrad1: da = d_out W2 with W2 [E, H, I] read N-major (64 x 64 boxes); h [C, 2I] in boxes of 128 rows for
  // the epilogue; dh [C, 2I] and w * a [C, I] stored in 64 x 64 boxes. dgrad2: dx = dh W13 with dh in boxes of
  // 128 rows and W13 [E, 2I, H] N-major.
  CUtensorMap tm_w2{}, tm_h{}, tm_dh_store{}, tm_wa_store{}, tm_dh_load{}, tm_w13{};
  MEGAMOE_RETURN_IF_ERROR(make_bf16_experts_map(&tm_w2, a.w2, I, H, EL, 64));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_h, h, 2 * I, C, kBM));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_dh_store, dh, 2 * I, C, 64));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_wa_store, act, I, C, 64));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_rows_map(&tm_dh_load, dh, 2 * I, C, kBM));
  MEGAMOE_RETURN_IF_ERROR(make_bf16_experts_map(&tm_w13, a.w13, H, 2 * I, EL, 64));

  FusedBackwardParams k{};
  k.layer = p;
  k.d_out = a.d_out;
  k.d_x = a.d_x;
  k.d_topk_weights = a.d_topk_weights;
  k.timeline = a.timeline;
  const int ctas = std::max(1, max_blocks);
  k.wave_lag = static_cast<int>(std::min<int64_t>(std::max(a.wave_lag, 0), EL));  // past EL: the same order
  k.n_tiles[0] = static_cast<int>((I + kBN - 1) / kBN);
  k.n_tiles[1] = static_cast<int>((H + kBN - 1) / kBN);
  k.k_tiles[0] = static_cast<int>((H + kBK - 1) / kBK);
  k.k_tiles[1] = static_cast<int>((2 * I + kBK - 1) / kBK);
  // The partials of d_topk_weights per row are dgrad1's n-tiles (the layer sized slot_dots for them).
  if (k.n_tiles[0] != s.dot_parts)
    return Status(StatusCode::kInternal, "fused backward: dgrad1 has " + std::to_string(k.n_tiles[0]) +
                                             " n-tiles but the workspace holds " + std::to_string(s.dot_parts) +
                                             " routing-gradient partials per slot");
  k.dgrad1_src.a = device::gathered_rows(recv_dout, H, reinterpret_cast<const int32_t*>(w + p.layout.row_src),
                                         source_rows);
  k.dgrad1_epi.c = device::OutputRows{dh, 2 * I, nullptr, nullptr};
  k.dgrad1_epi.aux = device::OutputRows{act, I, nullptr, nullptr};
  k.dgrad1_epi.c_cols = static_cast<int>(2 * I);
  k.dgrad1_epi.aux_cols = static_cast<int>(I);
  k.dgrad1_epi.row_scale = reinterpret_cast<const float*>(w + p.layout.row_weight);
  k.dgrad1_epi.up_offset = static_cast<int>(I);
  k.dgrad1_epi.dot_rows = reinterpret_cast<float* const*>(w + p.layout.row_dot_dest);
  k.dgrad2_epi = rows_home_epilogue(p, H);

  MEGAMOE_RETURN_IF_ERROR(launch_cooperative(kernels::fused_backward_kernel, ctas, FusedBackwardConfig::kSmemBytes,
                                             stream, tm_w2, tm_h, tm_dh_store, tm_wa_store, tm_dh_load, tm_w13, k));
  MEGAMOE_CHECK_LAUNCH(stream, "fused_backward_kernel");
  return Status::ok();
}

// At the layer's creation: every fused kernel loaded (lazy loading would make a first launch wait for running
// kernels, which may be peers spinning on this rank) and given its shared memory once, not per launch.
Status load_fused_forward_kernels() {
  cudaFuncAttributes attributes{};
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernels::fused_forward_kernel<int64_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernels::fused_forward_kernel<int32_t>));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernels::fused_backward_kernel));
  constexpr auto kSmem = cudaFuncAttributeMaxDynamicSharedMemorySize;
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernels::fused_forward_kernel<int64_t>, kSmem, FusedForwardConfig::kSmemBytes));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernels::fused_forward_kernel<int32_t>, kSmem, FusedForwardConfig::kSmemBytes));
  MEGAMOE_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernels::fused_backward_kernel, kSmem, kernels::FusedBackwardConfig::kSmemBytes));
  return Status::ok();
}

}  // namespace megamoe::ep
