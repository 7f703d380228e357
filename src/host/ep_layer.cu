// Host side of the expert-parallel layer: argument checks, the kernel sequence of forward and backward,
// error decoding, and the virtual-rank group.
#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <sstream>
#include <vector>

#include "comm/ep_workspace.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/ep_kernels.hpp"
#include "kernels/fp8_gemm.hpp"
#include "kernels/fp8_quantize.hpp"
#include "kernels/fp8_swiglu_backward.hpp"
#include "kernels/fp8_token_major.hpp"
#include "kernels/fp8_wgrad.hpp"
#include "kernels/fused_forward.hpp"
#include "kernels/grouped_gemm.hpp"
#include "megamoe/layer.hpp"

namespace megamoe {

namespace {

constexpr double kMinWaitTimeoutSeconds = 1e-3;
constexpr double kMaxWaitTimeoutSeconds = 86400.0;

bool aligned_to(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// Every pointer a call takes is checked before anything is enqueued, so that a bad argument never leaves
// a call half-enqueued (peers waiting at a barrier this rank never reaches). Rows are read and written 16
// bytes at a time.
Status check_alignment(std::initializer_list<std::pair<const void*, const char*>> rows16,
                       std::initializer_list<std::pair<const void*, const char*>> words4) {
  for (const auto& [ptr, name] : rows16)
    if (ptr != nullptr && !aligned_to(ptr, 16))
      return Status::invalid(std::string(name) + " must be 16-byte aligned (rows are moved 16 bytes at a time)");
  for (const auto& [ptr, name] : words4)
    if (ptr != nullptr && !aligned_to(ptr, 4)) return Status::invalid(std::string(name) + " must be 4-byte aligned");
  return Status::ok();
}

Status broken_status() {
  return Status(StatusCode::kTimeout,
                "this layer is unusable: an earlier call timed out waiting for a peer (counters can no longer be "
                "trusted); recreate the layer");
}

int64_t worst_case_rows(const LayerConfig& c) {
  return c.num_ranks * c.max_tokens_per_rank * std::min(c.top_k, c.experts_per_rank());
}

// Blockwise FP8 on the GPU so far: the modular forward (docs/FP8.md). Its 1x128 groups and 128x128 blocks
// tile H and I exactly because every precision already asks both to be multiples of 128 (validate).
Status check_fp8(const LayerOptions& options) {
  static_assert(kChannelAlignment % 128 == 0, "the FP8 scale blocks must tile every valid H and I");
  if (options.forward_path != ForwardPath::kModular || options.backward_path != BackwardPath::kModular)
    return Status(StatusCode::kNotSupported, "fp8-blockwise runs the modular paths only so far (no fused kernels)");
  if (options.recompute_h)
    return Status(StatusCode::kNotSupported, "fp8-blockwise keeps GEMM1's fp32 h for its backward: no recompute_h");
  return Status::ok();
}

Status resolve_capacity(const LayerConfig& config, const LayerOptions& options, int64_t* capacity) {
  MEGAMOE_RETURN_IF_ERROR(validate(config));
  MEGAMOE_RETURN_IF_ERROR(validate(options));
  if (config.precision == Precision::kFP8Blockwise) MEGAMOE_RETURN_IF_ERROR(check_fp8(options));
  *capacity = options.expert_row_capacity > 0 ? options.expert_row_capacity : worst_case_rows(config);
  if (*capacity >= (int64_t{1} << 31))
    return Status::invalid("expert_row_capacity must stay below 2^31 rows, got " + std::to_string(*capacity) +
                           "; lower max_tokens_per_rank or set expert_row_capacity");
  return Status::ok();
}

}  // namespace

Status validate(const LayerOptions& options) {
  if (options.expert_row_capacity < 0)
    return Status::invalid("expert_row_capacity must be >= 0 (0 = worst case), got " +
                           std::to_string(options.expert_row_capacity));
  if (options.forward_path != ForwardPath::kModular && options.forward_path != ForwardPath::kFused)
    return Status::invalid("forward_path must be kModular (0) or kFused (1), got " +
                           std::to_string(static_cast<int>(options.forward_path)));
  if (options.backward_path != BackwardPath::kModular && options.backward_path != BackwardPath::kFused)
    return Status::invalid("backward_path must be kModular (0) or kFused (1), got " +
                           std::to_string(static_cast<int>(options.backward_path)));
  // A finite, bounded range: inf or huge values would overflow the nanosecond count into an instant timeout.
  if (!(options.wait_timeout_seconds >= kMinWaitTimeoutSeconds && options.wait_timeout_seconds <= kMaxWaitTimeoutSeconds))
    return Status::invalid("wait_timeout_seconds must be in [" + std::to_string(kMinWaitTimeoutSeconds) + ", " +
                           std::to_string(kMaxWaitTimeoutSeconds) + "], got " +
                           std::to_string(options.wait_timeout_seconds));
  return Status::ok();
}

namespace {

// The tuning of the GEMM whose epilogue writes the d_topk_weights partials (its n-tiles are the partials).
kernels::GemmTuning dgrad_tuning() { return kernels::GemmTuning{}; }

// f(d_w13, d_w2) with the weight-gradient pair the call gives: its bf16 pointers, or its fp32 ones.
template <class F>
Status with_weight_gradients(const BackwardArgs& args, F&& f) {
  return args.bf16_weight_grads() ? f(args.d_w13_bf16, args.d_w2_bf16) : f(args.d_w13, args.d_w2);
}

ep::Shape make_shape(const LayerConfig& c, int rank, int64_t capacity) {
  ep::Shape s{};
  s.hidden = static_cast<int32_t>(c.hidden);
  s.intermediate = static_cast<int32_t>(c.intermediate);
  s.num_experts = static_cast<int32_t>(c.num_experts);
  s.experts_per_rank = static_cast<int32_t>(c.experts_per_rank());
  s.top_k = static_cast<int32_t>(c.top_k);
  s.num_ranks = static_cast<int32_t>(c.num_ranks);
  s.rank = rank;
  s.max_tokens = static_cast<int32_t>(c.max_tokens_per_rank);
  s.row_capacity = capacity;
  s.dot_parts = kernels::grouped_gemm_n_tiles(static_cast<int>(c.intermediate), dgrad_tuning());
  s.recompute_h = 0;
  s.fp8 = c.precision == Precision::kFP8Blockwise ? 1 : 0;
  return s;
}

const char* fused_wait_name(int64_t kind) {
  switch (kind) {
    case ep::kWaitGridBarrier: return "its grid barrier";
    case ep::kWaitCounts: return "every source's counts on rank";
    case ep::kWaitRows: return "the token rows of source rank";
    case ep::kWaitRowBlock: return "the routed rows of row block";
    case ep::kWaitActBlock: return "the GEMM1 output of row block";
    case ep::kWaitToken: return "the rows coming home to token";
    default: return "an unknown counter";
  }
}

std::string describe(const ep::DeviceError& e, const LayerConfig& c) {
  std::ostringstream s;
  switch (e.what) {
    case ep::kErrorExpertId:
      s << "rank " << e.rank << ": topk_idx of token " << e.a << " holds expert id " << e.b << ", outside [-1, "
        << c.num_experts << ")";
      break;
    case ep::kErrorCapacity:
      s << "rank " << e.rank << " would receive " << e.a << " expert rows but its capacity is " << e.b
        << " (LayerOptions::expert_row_capacity)";
      break;
    case ep::kErrorBarrierTimeout:
      s << "rank " << e.rank << ": barrier " << e.a << " timed out with " << e.b << " of " << c.num_ranks
        << " ranks arrived (a peer never reached it); recreate the layer";
      break;
    case ep::kErrorBroken:
      s << "rank " << e.rank << ": the layer is unusable after an earlier timeout; recreate it";
      break;
    case ep::kErrorPeerIndex:
      s << "rank " << e.rank << " received an out-of-range value " << e.b << " from rank " << e.a << " (field "
        << e.c << " of the receive buffers)";
      break;
    case ep::kErrorForwardFailed:
      s << "rank " << e.rank << ": backward of a forward that failed";
      break;
    case ep::kErrorWaitTimeout:
      s << "rank " << e.rank << ": ";
      if (e.a >= (int64_t{1} << 32)) {
        s << "the fused kernel's wait for " << fused_wait_name(e.a >> 32) << " " << (e.a & 0xffffffff);
      } else {
        s << "wait " << e.a;
      }
      s << " timed out at " << e.b << " of " << e.c << " signals (its producer never finished); recreate the layer";
      break;
    default:
      s << "rank " << e.rank << ": device error " << e.what;
  }
  s << "; this call's outputs are NaN";
  return s.str();
}

}  // namespace

struct ExpertParallelLayer::Impl {
  LayerConfig config;
  LayerOptions options;
  RankPlacement placement;
  ep::Params params{};
  int max_blocks = 0;
  bool has_forward = false;
  bool forward_failed = false;  // an error was reported after the latest forward
  bool broken = false;          // a timeout was reported: the layer must be recreated
  int64_t forward_tokens = 0;
  const __nv_bfloat16* forward_w13 = nullptr;
  const __nv_bfloat16* forward_w2 = nullptr;
  uint64_t* fused_timeline = nullptr;
  int fused_wave_lag = 1;
  Fp8PromotionOverlap fp8_overlap = Fp8PromotionOverlap::kTmaOperands;  // set_fp8_overlap_promotion
  // fp8-blockwise: which weights the workspace's quantized copies hold (ForwardArgs::weights_version).
  const void* quantized_w13 = nullptr;
  const void* quantized_w2 = nullptr;
  uint64_t quantized_version = 0;
  // The version whose quantized weights the backward's transposed copies hold (0: none known), so that
  // micro-batches between two weight updates transpose once.
  uint64_t transposed_version = 0;
  // The quantized weights the latest FP8 forward's GEMMs read and its backward transposes: the workspace's
  // copies, or the caller's pre-quantized ones, read where they are (as bf16 weights are).
  struct QuantizedWeights {
    const uint8_t* w13 = nullptr;
    const float* w13_scales = nullptr;
    const uint8_t* w2 = nullptr;
    const float* w2_scales = nullptr;
  };
  QuantizedWeights fp8_weights;

  template <typename T>
  T* buffer(int64_t offset) const {
    return reinterpret_cast<T*>(placement.workspace + offset);
  }
  const int32_t* expert_offsets() const { return buffer<int32_t>(params.layout.expert_offsets); }
  // Virtual ranks share a GPU: the engine's persistent grid is capped at the rank's share of SMs.
  kernels::GemmTuning gemm_tuning() const {
    kernels::GemmTuning tuning;
    tuning.max_ctas = max_blocks;
    return tuning;
  }
  // The FP8 data GEMMs' launch shape: the rank's share of SMs, and the main loop's form. Their A operands all
  // come by TMA (the received rows are copied into expert order first), so kTmaOperands names all four.
  kernels::Fp8GemmTuning fp8_tuning() const {
    kernels::Fp8GemmTuning tuning{1, max_blocks};
    tuning.overlap_promotion = fp8_overlap != Fp8PromotionOverlap::kNone;
    return tuning;
  }
  // The backward's two dgrads in 2-CTA pairs (a pair of tiles shares its weight panel, each CTA loading half of
  // it and multicasting it): 7-12% faster than single CTAs at the benchmark shapes (docs/PERF.md run 119), where
  // GEMM2 gained nothing. A rank's share of one SM keeps them single.
  kernels::Fp8GemmTuning fp8_paired_tuning() const {
    kernels::Fp8GemmTuning tuning = fp8_tuning();
    if (max_blocks == 0 || max_blocks >= 2) tuning.cluster_size = 2;
    return tuning;
  }
  // GEMM1's gate-up pair in 2-CTA pairs from 32 K blocks on (K = H): at H = 4096 they were 2.6% faster than single
  // CTAs, at H = 2048 (16 blocks) 5% slower, both with the overlapped loop (docs/PERF.md run 121).
  kernels::Fp8GemmTuning fp8_gemm1_tuning() const {
    return config.hidden / 128 >= 32 ? fp8_paired_tuning() : fp8_tuning();
  }
  bool fp8_wgrad_overlap() const { return fp8_overlap == Fp8PromotionOverlap::kAll; }
  // A weight gradient of N columns in 128 x 192 tiles when they cover N whole (the plain loop only): dW2
  // (N = I) 2-4% faster than in 128 x 128 tiles at both benchmark shapes (docs/PERF.md run 125); dW13 is
  // formed as x^T dh so that its N is 2I (as dh^T x, N = H, whose last 192-column tile is partly empty, it
  // measured mixed).
  int fp8_wgrad_tile_columns(int64_t N) const { return !fp8_wgrad_overlap() && N % 192 == 0 ? 192 : 128; }
  // Weight gradients: expert row counts are uneven in training, so their work items are handed out
  // dynamically, longest first (each rank's own counter in its workspace; the two calls are stream-ordered).
  kernels::GemmTuning weight_grad_tuning() const {
    kernels::GemmTuning tuning = gemm_tuning();
    tuning.work_counter = buffer<int>(params.layout.gemm_work_counter);
    return tuning;
  }

  // Rows of a receive buffer (R * T of them).
  int64_t received_source_rows() const { return static_cast<int64_t>(config.num_ranks) * config.max_tokens_per_rank; }
  // Operand rows read from a receive buffer in expert order.
  kernels::GemmGather received_rows() const {
    kernels::GemmGather g;
    g.a_rows = buffer<int32_t>(params.layout.row_src);
    g.a_source_rows = received_source_rows();
    return g;
  }
  // The received e4m3 rows q (scales row-major, as they travel) copied into expert order in the workspace's
  // rows_q / rows_s, the A operand of GEMM1 (x) and of the dgrad (d_out) through TMA, and from the same read
  // of them their token-major copy for a weight gradient (qt / st; with row_weight, dy = w dOut): the bytes of
  // gather_rows_e4m3 and token_major_quantize_e4m3, in one pass (fp8_token_major.hpp).
  Status fp8_rows_in_expert_order(const ep::Params& p, const uint8_t* q, const float* scales, const float* row_weight,
                                  uint8_t* qt, kernels::TokenMajorScale* st) const {
    const ep::WorkspaceLayout& l = p.layout;
    const int64_t C = p.shape.row_capacity;
    return kernels::token_major_quantize_e4m3_gathering(
        q, scales, received_source_rows(), buffer<int32_t>(l.row_src), row_weight, config.hidden, expert_offsets(),
        static_cast<int>(config.experts_per_rank()), C, qt, st, buffer<uint8_t>(l.rows_q), buffer<float>(l.rows_s),
        kernels::fp8_scale_pitch(C), placement.stream);
  }
  // An FP8 GEMM's output stored unrounded (fp32, contiguous): GEMM1's h, the dgrad's g.
  static kernels::Fp8GemmRows fp32_rows(float* d_fp32) {
    kernels::Fp8GemmRows rows;
    rows.d_fp32 = d_fp32;
    return rows;
  }
  // FP8 GEMM output rows stored straight into their combine slots on the source ranks.
  kernels::Fp8GemmRows combine_slot_rows() const {
    kernels::Fp8GemmRows rows;
    rows.d_rows = buffer<void*>(params.layout.row_dest);
    return rows;
  }

  // GEMM1 with SwiGLU -> GEMM2, y rows delivered to the sources' combine slots.
  Status expert_mlp_forward(const ep::Params& p, const __nv_bfloat16* w13, const __nv_bfloat16* w2) const;
  // The same in blockwise FP8, on the e4m3 rows the FP8 dispatch delivered and the weights fp8_weights names;
  // quantize_weights: quantize args.w13 / w2 into the workspace's copies first.
  Status expert_mlp_forward_fp8(const ep::Params& p, const ForwardArgs& args, bool quantize_weights) const;
  // h = x W13^T over the received rows, a = silu(g) * u in its epilogue; with keep_h h itself is stored too.
  Status gemm1_swiglu(const ep::Params& p, const __nv_bfloat16* w13, bool keep_h) const;
  // dgrad GEMMs with the SwiGLU backward and d_topk_weights, d_x rows home, weight-gradient GEMMs.
  Status expert_mlp_backward(const ep::Params& p, const BackwardArgs& args) const;
  Status weight_gradients(const ep::Params& p, const BackwardArgs& args) const;
  // NaN in the weight gradients (fp32 or bf16, whichever the call asked for) if the call failed.
  Status nan_weight_gradients_if_failed(const ep::Params& p, const BackwardArgs& args) const;
  // The same in blockwise FP8 (docs/FP8.md, the backward), on the e4m3 d_out rows the FP8 dispatch delivered
  // and what the FP8 forward kept (the received x rows, the fp32 h, the quantized weights).
  Status expert_mlp_backward_fp8(const ep::Params& p, const BackwardArgs& args, bool transpose_weights) const;
  Status weight_gradients_fp8(const ep::Params& p, const BackwardArgs& args) const;
};

Status ExpertParallelLayer::Impl::gemm1_swiglu(const ep::Params& p, const __nv_bfloat16* w13, bool keep_h) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  kernels::GemmEpilogue swiglu;
  swiglu.activation = kernels::GemmActivation::kSwiGLU;
  swiglu.aux_out = keep_h ? buffer<__nv_bfloat16>(p.layout.h) : nullptr;
  return kernels::grouped_gemm_nt(buffer<__nv_bfloat16>(p.layout.recv_x), w13, buffer<__nv_bfloat16>(p.layout.a),
                                  expert_offsets(), EL, C, static_cast<int>(2 * I), static_cast<int>(H), swiglu,
                                  placement.stream, gemm_tuning(), received_rows());
}

// h = x W13^T over the received rows (gathered by index, no expand copy), a = silu(g) * u in its epilogue
// (h kept for the backward unless recompute_h); y = a W2^T, each row stored straight into its combine slot
// on the source rank.
Status ExpertParallelLayer::Impl::expert_mlp_forward(const ep::Params& p, const __nv_bfloat16* w13,
                                                     const __nv_bfloat16* w2) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  cudaStream_t stream = placement.stream;
  auto* a = buffer<__nv_bfloat16>(p.layout.a);
  MEGAMOE_RETURN_IF_ERROR(gemm1_swiglu(p, w13, p.shape.recompute_h == 0));
  kernels::GemmEpilogue home;
  home.row_pointers = buffer<void*>(p.layout.row_dest);
  return kernels::grouped_gemm_nt(a, w2, buffer<__nv_bfloat16>(p.layout.combine), expert_offsets(), EL, C,
                                  static_cast<int>(H), static_cast<int>(I), home, stream, gemm_tuning());
}

// Blockwise FP8 (docs/FP8.md): the weights quantized in 128x128 blocks when they changed (the caller's
// weights_version says so); h = xq W13q^T over the received e4m3 rows and their scales (copied into expert
// order first, so that the GEMM reads them through TMA), kept in fp32 (by arithmetic, not measured: from a
// bf16 h about one element of a in 60 would round to the other e4m3 neighbour than the reference's, about 1%
// of error in out); a = silu(g) u quantized in 1x128 groups along I by GEMM1's epilogue (from the same fp32
// values); y = aq W2q^T, each row stored straight into its combine slot on the source rank.
Status ExpertParallelLayer::Impl::expert_mlp_forward_fp8(const ep::Params& p, const ForwardArgs& args,
                                                         bool quantize_weights) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  cudaStream_t stream = placement.stream;
  // Expert weights [E, N, K] with N a multiple of 128 quantize as one matrix of E * N rows.
  if (quantize_weights) {
    MEGAMOE_RETURN_IF_ERROR(kernels::quantize_blocks_128x128_bf16(args.w13, EL * 2 * I, H,
                                                                  buffer<uint8_t>(p.layout.w13_q),
                                                                  buffer<float>(p.layout.w13_s), stream));
    MEGAMOE_RETURN_IF_ERROR(kernels::quantize_blocks_128x128_bf16(args.w2, EL * H, I, buffer<uint8_t>(p.layout.w2_q),
                                                                  buffer<float>(p.layout.w2_s), stream));
  }
  const QuantizedWeights& w = fp8_weights;
  auto* a_q = buffer<uint8_t>(p.layout.a_q);
  auto* a_s = buffer<float>(p.layout.a_s);
  // x's token-major copy for the backward's dW13 comes with the rows' copy into expert order: the rows are read
  // once for both (a forward with no backward after it pays for the copy, docs/FP8.md).
  MEGAMOE_RETURN_IF_ERROR(fp8_rows_in_expert_order(p, buffer<uint8_t>(p.layout.recv_xq),
                                                   buffer<float>(p.layout.recv_xs), nullptr,
                                                   buffer<uint8_t>(p.layout.xt_q),
                                                   buffer<kernels::TokenMajorScale>(p.layout.xt_s)));
  // GEMM1 with the SwiGLU epilogue: the fp32 h for the backward and a's codes and scales of the expert rows.
  kernels::Fp8GemmRows gemm1_out = fp32_rows(buffer<float>(p.layout.h_f32));
  gemm1_out.swiglu_a_q = a_q;
  gemm1_out.swiglu_a_s = a_s;
  gemm1_out.swiglu_a_s_pitch = kernels::fp8_scale_pitch(C);
  MEGAMOE_RETURN_IF_ERROR(kernels::fp8_grouped_gemm_nt(buffer<uint8_t>(p.layout.rows_q), buffer<float>(p.layout.rows_s),
                                                       w.w13, w.w13_scales, nullptr, expert_offsets(), EL, C,
                                                       static_cast<int>(2 * I), static_cast<int>(H), stream,
                                                       fp8_gemm1_tuning(), gemm1_out));
  return kernels::fp8_grouped_gemm_nt(a_q, a_s, w.w2, w.w2_scales, nullptr, expert_offsets(), EL, C, static_cast<int>(H),
                                      static_cast<int>(I), stream, fp8_tuning(), combine_slot_rows());
}

// da = d_out W2 (W2 read N-major, d_out rows gathered from the receive buffer); its epilogue: dh =
// SwiGLU'(w * da), w * a for d_w2, and the per-tile partials of <da, a> sent to the source's slots. Then
// dx rows = dh W13 straight into the combine slots; dW2 = d_out^T (w * a) and dW13 = dh^T x (fp32, rows
// gathered where they come from a receive buffer).
Status ExpertParallelLayer::Impl::expert_mlp_backward(const ep::Params& p, const BackwardArgs& args) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  cudaStream_t stream = placement.stream;
  auto* recv_dout = buffer<__nv_bfloat16>(p.layout.recv_dout);
  auto* a = buffer<__nv_bfloat16>(p.layout.a);
  auto* dh = buffer<__nv_bfloat16>(p.layout.dh);
  kernels::GemmEpilogue grad;
  grad.activation = kernels::GemmActivation::kSwiGLUBackward;
  grad.row_scale = buffer<float>(p.layout.row_weight);
  grad.h_in = buffer<__nv_bfloat16>(p.layout.h);
  grad.aux_out = a;
  grad.row_dots = buffer<float*>(p.layout.row_dot_dest);
  kernels::GemmTuning dgrad = dgrad_tuning();
  dgrad.max_ctas = max_blocks;
  MEGAMOE_RETURN_IF_ERROR(kernels::grouped_gemm_nn(recv_dout, forward_w2, dh, expert_offsets(), EL, C,
                                                   static_cast<int>(I), static_cast<int>(H), grad, stream, dgrad,
                                                   received_rows()));
  kernels::GemmEpilogue home;
  home.row_pointers = buffer<void*>(p.layout.row_dest);
  MEGAMOE_RETURN_IF_ERROR(kernels::grouped_gemm_nn(dh, forward_w13, buffer<__nv_bfloat16>(p.layout.combine),
                                                   expert_offsets(), EL, C, static_cast<int>(H), static_cast<int>(2 * I),
                                                   home, stream, gemm_tuning()));
  return weight_gradients(p, args);
}

// dW2 = d_out^T (w * a) and dW13 = dh^T x (fp32, or rounded to bf16 when the call gives bf16 gradients; rows
// gathered where they come from a receive buffer), after the dgrad GEMMs wrote w * a and dh. The gathered
// operand is A of both GEMMs, the tile's narrower one (128 columns; B has 256): dW13 is computed as x^T dh and
// stored transposed.
Status ExpertParallelLayer::Impl::weight_gradients(const ep::Params& p, const BackwardArgs& args) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  cudaStream_t stream = placement.stream;
  auto* recv_dout = buffer<__nv_bfloat16>(p.layout.recv_dout);
  auto* a = buffer<__nv_bfloat16>(p.layout.a);
  auto* dh = buffer<__nv_bfloat16>(p.layout.dh);
  return with_weight_gradients(args, [&](auto* d_w13, auto* d_w2) -> Status {
    MEGAMOE_RETURN_IF_ERROR(kernels::grouped_gemm_tn(recv_dout, a, d_w2, expert_offsets(), EL, C,
                                                     static_cast<int>(H), static_cast<int>(I),
                                                     args.accumulate_weight_grads, stream, weight_grad_tuning(),
                                                     received_rows()));
    return kernels::grouped_gemm_tn(buffer<__nv_bfloat16>(p.layout.recv_x), dh, d_w13, expert_offsets(), EL, C,
                                    static_cast<int>(H), static_cast<int>(2 * I), args.accumulate_weight_grads,
                                    stream, weight_grad_tuning(), received_rows(), /*transpose_c=*/true);
  });
}

Status ExpertParallelLayer::Impl::nan_weight_gradients_if_failed(const ep::Params& p,
                                                                 const BackwardArgs& args) const {
  const int64_t EL = config.experts_per_rank(), H = config.hidden, I = config.intermediate;
  return with_weight_gradients(args, [&](auto* d_w13, auto* d_w2) {
    return ep::launch_nan_if_failed(p, d_w13, EL * 2 * I * H, d_w2, EL * H * I, placement.stream, max_blocks);
  });
}

// g = q(dOut) W2q (fp32, d_out's received rows copied into expert order, W2q read K-major: its transposed copy);
// then per routed row dh = SwiGLU'(w g) quantized 1 x 128 along 2I, with <g, a> sent to the source's slot (and
// the weight gradients' token-major a and dh, from the same read of g and h);
// dx rows = dh_q W13q straight into the combine slots (W13q's transposed copy); then the weight gradients.
Status ExpertParallelLayer::Impl::expert_mlp_backward_fp8(const ep::Params& p, const BackwardArgs& args,
                                                          bool transpose_weights) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  cudaStream_t stream = placement.stream;
  const ep::WorkspaceLayout& l = p.layout;
  // The forward's quantized weights, K-major for the dgrads: W2q [E, H, I] -> [E, I, H], W13q [E, 2I, H] ->
  // [E, H, 2I] (the same codes, the block scales transposed); kept from an earlier backward of the same
  // weights version when transpose_weights is false.
  if (transpose_weights) {
    MEGAMOE_RETURN_IF_ERROR(kernels::transpose_blocks_128x128_e4m3(fp8_weights.w2, fp8_weights.w2_scales, EL, H, I,
                                                                   buffer<uint8_t>(l.w2t_q), buffer<float>(l.w2t_s),
                                                                   stream));
    MEGAMOE_RETURN_IF_ERROR(kernels::transpose_blocks_128x128_e4m3(fp8_weights.w13, fp8_weights.w13_scales, EL,
                                                                   2 * I, H, buffer<uint8_t>(l.w13t_q),
                                                                   buffer<float>(l.w13t_s), stream));
  }
  auto* g = buffer<float>(l.g_f32);
  MEGAMOE_RETURN_IF_ERROR(fp8_rows_in_expert_order(p, buffer<uint8_t>(l.recv_doutq), buffer<float>(l.recv_douts),
                                                   buffer<float>(l.row_weight), buffer<uint8_t>(l.dyt_q),
                                                   buffer<kernels::TokenMajorScale>(l.dyt_s)));
  MEGAMOE_RETURN_IF_ERROR(kernels::fp8_grouped_gemm_nt(buffer<uint8_t>(l.rows_q), buffer<float>(l.rows_s),
                                                       buffer<uint8_t>(l.w2t_q), buffer<float>(l.w2t_s), nullptr,
                                                       expert_offsets(), EL, C, static_cast<int>(I),
                                                       static_cast<int>(H), stream, fp8_paired_tuning(), fp32_rows(g)));
  auto* dh_q = buffer<uint8_t>(l.dh_q);
  auto* dh_s = buffer<float>(l.dh_s);
  // One pass over g and h for dh (row-major, this GEMM's operand), <g, a> and the weight gradients' a^T and dh^T.
  kernels::SwigluBackwardFp8Outputs swiglu_out;
  swiglu_out.dh_q = dh_q;
  swiglu_out.dh_s = dh_s;
  swiglu_out.dh_scales_pitch = kernels::fp8_scale_pitch(C);
  swiglu_out.dot_rows = buffer<float*>(l.row_dot_dest);
  swiglu_out.dot_parts = p.shape.dot_parts;
  swiglu_out.at_q = buffer<uint8_t>(l.at_q);
  swiglu_out.at_s = buffer<kernels::TokenMajorScale>(l.at_s);
  swiglu_out.dht_q = buffer<uint8_t>(l.dht_q);
  swiglu_out.dht_s = buffer<kernels::TokenMajorScale>(l.dht_s);
  MEGAMOE_RETURN_IF_ERROR(kernels::swiglu_backward_quantize_fp8(g, buffer<float>(l.h_f32), buffer<float>(l.row_weight),
                                                                I, expert_offsets(), EL, C, swiglu_out, stream));
  MEGAMOE_RETURN_IF_ERROR(kernels::fp8_grouped_gemm_nt(dh_q, dh_s, buffer<uint8_t>(l.w13t_q), buffer<float>(l.w13t_s),
                                                       nullptr, expert_offsets(), EL, C, static_cast<int>(H),
                                                       static_cast<int>(2 * I), stream, fp8_paired_tuning(),
                                                       combine_slot_rows()));
  return weight_gradients_fp8(p, args);
}

// dW2 = dy^T a and dW13 = dh^T x on token-major copies quantized along the routed rows (docs/FP8.md), all
// written before: dy = w dOut and x from their dispatched e4m3 rows, each with its rows' copy into expert order;
// a and dh by the SwiGLU step, which recomputed them in fp32 from h, g and the routing weight.
Status ExpertParallelLayer::Impl::weight_gradients_fp8(const ep::Params& p, const BackwardArgs& args) const {
  const int64_t H = config.hidden, I = config.intermediate, C = p.shape.row_capacity;
  const int EL = static_cast<int>(config.experts_per_rank());
  cudaStream_t stream = placement.stream;
  const ep::WorkspaceLayout& l = p.layout;
  const int32_t* offsets = expert_offsets();
  const auto scales = [this](int64_t offset) { return buffer<kernels::TokenMajorScale>(offset); };
  // fp32 gradients, or bf16 ones when the call gives those (each value rounded once where it is stored).
  return with_weight_gradients(args, [&](auto* d_w13, auto* d_w2) -> Status {
    MEGAMOE_RETURN_IF_ERROR(kernels::fp8_wgrad_gemm(buffer<uint8_t>(l.dyt_q), scales(l.dyt_s), H,
                                                    buffer<uint8_t>(l.at_q), scales(l.at_s), I, offsets, EL, C, d_w2,
                                                    args.accumulate_weight_grads, stream, max_blocks,
                                                    fp8_wgrad_overlap(), 1, fp8_wgrad_tile_columns(I)));
    // dW13 = dh^T x formed as x^T dh and stored transposed (the same bits): its columns are then the 2I
    // channels, which 192-column tiles cover whole when 3 divides I, as at the benchmark shapes (otherwise
    // 128-column tiles).
    return kernels::fp8_wgrad_gemm(buffer<uint8_t>(l.xt_q), scales(l.xt_s), H, buffer<uint8_t>(l.dht_q),
                                   scales(l.dht_s), 2 * I, offsets, EL, C, d_w13, args.accumulate_weight_grads, stream,
                                   max_blocks, fp8_wgrad_overlap(), 1, fp8_wgrad_tile_columns(2 * I),
                                   /*transpose_d=*/true);
  });
}

ExpertParallelLayer::ExpertParallelLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertParallelLayer::~ExpertParallelLayer() = default;

const LayerConfig& ExpertParallelLayer::config() const { return impl_->config; }

Status ExpertParallelLayer::set_fused_timeline(uint64_t* stamps) {
  static_assert(kFusedTimelineStamps == ep::kFusedTimelineStamps, "one count of timeline stamps");
  impl_->fused_timeline = stamps;
  return Status::ok();
}

Status ExpertParallelLayer::set_fused_wave_lag(int lag) {
  if (lag < 0) return Status::invalid("the fused kernels' wave lag must be >= 0, got " + std::to_string(lag));
  impl_->fused_wave_lag = lag;
  return Status::ok();
}

void ExpertParallelLayer::set_fp8_overlap_promotion(Fp8PromotionOverlap where) { impl_->fp8_overlap = where; }

int ExpertParallelLayer::fused_forward_ctas() const { return std::max(1, impl_->max_blocks); }
int64_t ExpertParallelLayer::expert_row_capacity() const { return impl_->params.shape.row_capacity; }

Status ExpertParallelLayer::workspace_bytes(const LayerConfig& config, const LayerOptions& options, int64_t* bytes) {
  int64_t capacity = 0;
  MEGAMOE_RETURN_IF_ERROR(resolve_capacity(config, options, &capacity));
  ep::Shape shape = make_shape(config, 0, capacity);
  shape.recompute_h = options.recompute_h ? 1 : 0;
  *bytes = ep::WorkspaceLayout::make(shape).total;
  return Status::ok();
}

Status ExpertParallelLayer::row_capacity(const LayerConfig& config, const LayerOptions& options, int64_t* rows) {
  return resolve_capacity(config, options, rows);
}

namespace ep {

Status preload_kernels() {
  MEGAMOE_RETURN_IF_ERROR(load_barrier_kernels());
  MEGAMOE_RETURN_IF_ERROR(load_layout_kernels());
  MEGAMOE_RETURN_IF_ERROR(load_dispatch_kernels());
  MEGAMOE_RETURN_IF_ERROR(load_route_rows_kernels());
  MEGAMOE_RETURN_IF_ERROR(load_combine_kernels());
  MEGAMOE_RETURN_IF_ERROR(load_failure_kernels());
  MEGAMOE_RETURN_IF_ERROR(load_fused_forward_kernels());
  // The blockwise FP8 path's kernels too (a bf16 layer pays for loading them once per process).
  MEGAMOE_RETURN_IF_ERROR(kernels::fp8_gemm_preload());
  MEGAMOE_RETURN_IF_ERROR(kernels::fp8_quantize_preload());
  MEGAMOE_RETURN_IF_ERROR(kernels::token_major_preload());
  MEGAMOE_RETURN_IF_ERROR(kernels::swiglu_backward_fp8_preload());
  MEGAMOE_RETURN_IF_ERROR(kernels::fp8_wgrad_preload());
  return kernels::grouped_gemm_preload();
}

}  // namespace ep

Status ExpertParallelLayer::create(const LayerConfig& config, const LayerOptions& options,
                                   const RankPlacement& placement, std::unique_ptr<ExpertParallelLayer>* layer) {
  int64_t capacity = 0;
  MEGAMOE_RETURN_IF_ERROR(resolve_capacity(config, options, &capacity));
  if (placement.rank < 0 || placement.rank >= config.num_ranks)
    return Status::invalid("rank must be in [0, num_ranks), got " + std::to_string(placement.rank));
  if (placement.workspace == nullptr || placement.peer_workspaces_device == nullptr)
    return Status::invalid("placement needs the rank's workspace and the device table of peer workspaces");
  if (options.forward_path == ForwardPath::kFused || options.backward_path == BackwardPath::kFused)
    MEGAMOE_RETURN_IF_ERROR(ep::check_fused_forward_shape(make_shape(config, placement.rank, capacity)));
  MEGAMOE_RETURN_IF_ERROR(ep::preload_kernels());
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->options = options;
  impl->placement = placement;
  impl->params.shape = make_shape(config, placement.rank, capacity);
  impl->params.shape.recompute_h = options.recompute_h ? 1 : 0;
  impl->params.layout = ep::WorkspaceLayout::make(impl->params.shape);
  impl->params.local = placement.workspace;
  impl->params.peers = placement.peer_workspaces_device;
  impl->params.timeout_ns = static_cast<uint64_t>(options.wait_timeout_seconds * 1e9);
  int max_blocks = placement.max_blocks;
  if (max_blocks <= 0) {
    int device = 0;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&max_blocks, cudaDevAttrMultiProcessorCount, device));
  }
  impl->max_blocks = max_blocks;
  layer->reset(new ExpertParallelLayer(std::move(impl)));
  return Status::ok();
}

Status ExpertParallelLayer::check_forward(const ForwardArgs& args) const {
  const Impl& m = *impl_;
  const LayerConfig& c = m.config;
  if (args.num_tokens < 0 || args.num_tokens > c.max_tokens_per_rank)
    return Status::invalid("num_tokens must be in [0, max_tokens_per_rank=" + std::to_string(c.max_tokens_per_rank) +
                           "], got " + std::to_string(args.num_tokens));
  const int fp8_given = (args.w13_fp8 != nullptr) + (args.w13_scales != nullptr) + (args.w2_fp8 != nullptr) +
                        (args.w2_scales != nullptr);
  if (fp8_given != 0 && fp8_given != 4)
    return Status::invalid("forward: pre-quantized FP8 weights need all four of w13_fp8, w13_scales, w2_fp8 and "
                           "w2_scales, got " + std::to_string(fp8_given));
  if (fp8_given == 4 && c.precision != Precision::kFP8Blockwise)
    return Status::invalid("forward: pre-quantized FP8 weights need a layer of precision fp8-blockwise");
  if (fp8_given == 0 && (args.w13 == nullptr || args.w2 == nullptr))
    return Status::invalid("forward: w13 and w2 are required (or, with fp8-blockwise, the pre-quantized w13_fp8, "
                           "w13_scales, w2_fp8 and w2_scales)");
  if (args.num_tokens > 0 && (args.x == nullptr || args.topk_idx == nullptr || args.topk_weights == nullptr ||
                              args.out == nullptr))
    return Status::invalid("forward: x, topk_idx, topk_weights and out are required when num_tokens > 0");
  MEGAMOE_RETURN_IF_ERROR(check_alignment({{args.x, "x"}, {args.w13, "w13"}, {args.w2, "w2"}, {args.out, "out"},
                                           {args.w13_fp8, "w13_fp8"}, {args.w2_fp8, "w2_fp8"}},
                                          {{args.topk_weights, "topk_weights"}, {args.w13_scales, "w13_scales"},
                                           {args.w2_scales, "w2_scales"}}));
  if (args.topk_idx != nullptr &&
      !aligned_to(args.topk_idx, args.topk_idx_type == IndexType::kInt64 ? 8 : 4))
    return Status::invalid("topk_idx must be aligned to its element size");
  if (m.broken) return broken_status();
  return Status::ok();
}

Status ExpertParallelLayer::forward(const ForwardArgs& args) {
  MEGAMOE_RETURN_IF_ERROR(check_forward(args));
  Impl& m = *impl_;
  cudaStream_t stream = m.placement.stream;
  ep::Params p = m.params;
  p.num_tokens = args.num_tokens;
  const bool idx64 = args.topk_idx_type == IndexType::kInt64;
  // Asked before anything is enqueued: a failure after the first launch would leave peers at a barrier.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (p.shape.fp8 != 0) MEGAMOE_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));

  if (m.options.forward_path == ForwardPath::kFused) {
    ep::FusedForwardArgs fused;
    fused.x = args.x;
    fused.topk_idx = args.topk_idx;
    fused.idx_is_int64 = idx64;
    fused.topk_weights = args.topk_weights;
    fused.w13 = args.w13;
    fused.w2 = args.w2;
    fused.out = args.out;
    fused.timeline = m.fused_timeline;
    fused.wave_lag = m.fused_wave_lag;
    MEGAMOE_RETURN_IF_ERROR(ep::launch_fused_forward(p, fused, m.max_blocks, stream));
  } else {
    const bool fp8 = p.shape.fp8 != 0;
    MEGAMOE_RETURN_IF_ERROR(ep::launch_layout(p, args.topk_idx, idx64, stream, m.max_blocks));
    if (fp8) {
      // x quantized per token (1x128 groups along H) before the dispatch, which then moves e4m3 rows.
      MEGAMOE_RETURN_IF_ERROR(kernels::quantize_rows_1x128_bf16(args.x, args.num_tokens, m.config.hidden,
                                                                m.buffer<uint8_t>(p.layout.x_q),
                                                                m.buffer<float>(p.layout.x_s), stream));
      MEGAMOE_RETURN_IF_ERROR(
          ep::launch_dispatch_fp8(p, args.topk_idx, idx64, args.topk_weights, stream, m.max_blocks));
    } else {
      MEGAMOE_RETURN_IF_ERROR(
          ep::launch_dispatch(p, args.x, args.topk_idx, idx64, args.topk_weights, stream, m.max_blocks));
    }
    MEGAMOE_RETURN_IF_ERROR(ep::launch_barrier(p, ep::kBarrierDispatched, stream));
    MEGAMOE_RETURN_IF_ERROR(ep::launch_route_rows(p, stream, m.max_blocks));
    if (fp8) {
      const bool same_weights = !args.prequantized() && args.weights_version != 0 &&
                                args.weights_version == m.quantized_version && args.w13 == m.quantized_w13 &&
                                args.w2 == m.quantized_w2;
      // Forgotten until the quantization is enqueued: a call that fails before it leaves no stale promise. New
      // quantized weights also make the backward's transposed copies stale (a reused version may come with
      // other pointers).
      m.quantized_version = 0;
      if (!same_weights) m.transposed_version = 0;
      m.fp8_weights = args.prequantized()
                          ? Impl::QuantizedWeights{args.w13_fp8, args.w13_scales, args.w2_fp8, args.w2_scales}
                          : Impl::QuantizedWeights{m.buffer<uint8_t>(p.layout.w13_q), m.buffer<float>(p.layout.w13_s),
                                                   m.buffer<uint8_t>(p.layout.w2_q), m.buffer<float>(p.layout.w2_s)};
      MEGAMOE_RETURN_IF_ERROR(m.expert_mlp_forward_fp8(p, args, !same_weights && !args.prequantized()));
      // Under stream capture the quantization is only recorded (it runs when the graph does): no promise; nor
      // for pre-quantized weights, which are no copy of w13 / w2.
      if (capture == cudaStreamCaptureStatusNone && !args.prequantized()) {
        m.quantized_w13 = args.w13;
        m.quantized_w2 = args.w2;
        m.quantized_version = args.weights_version;
      }
    } else {
      MEGAMOE_RETURN_IF_ERROR(m.expert_mlp_forward(p, args.w13, args.w2));
    }
    MEGAMOE_RETURN_IF_ERROR(ep::launch_barrier(p, ep::kBarrierCombined, stream));
    MEGAMOE_RETURN_IF_ERROR(ep::launch_combine_forward(p, args.topk_weights, args.out, stream, m.max_blocks));
  }
  m.has_forward = true;
  m.forward_failed = false;
  m.forward_tokens = args.num_tokens;
  m.forward_w13 = args.w13;
  m.forward_w2 = args.w2;
  return Status::ok();
}

Status ExpertParallelLayer::check_backward(const BackwardArgs& args) const {
  const Impl& m = *impl_;
  if (!m.has_forward) return Status::invalid("backward called before any forward on this rank");
  if (args.bf16_weight_grads()) {
    if (args.d_w13_bf16 == nullptr || args.d_w2_bf16 == nullptr || args.d_w13 != nullptr || args.d_w2 != nullptr)
      return Status::invalid("backward: give the weight gradients once, both in fp32 (d_w13, d_w2) or both in bf16 "
                             "(d_w13_bf16, d_w2_bf16)");
  } else if (args.d_w13 == nullptr || args.d_w2 == nullptr) {
    return Status::invalid("backward: d_w13 and d_w2 (or d_w13_bf16 and d_w2_bf16) are required");
  }
  if (m.forward_tokens > 0 && (args.d_out == nullptr || args.d_x == nullptr || args.d_topk_weights == nullptr))
    return Status::invalid("backward: d_out, d_x and d_topk_weights are required when num_tokens > 0");
  MEGAMOE_RETURN_IF_ERROR(check_alignment(
      {{args.d_out, "d_out"}, {args.d_x, "d_x"}, {args.d_w13, "d_w13"}, {args.d_w2, "d_w2"},
       {args.d_w13_bf16, "d_w13_bf16"}, {args.d_w2_bf16, "d_w2_bf16"}},
      {{args.d_topk_weights, "d_topk_weights"}}));
  if (m.broken) return broken_status();
  return Status::ok();
}

Status ExpertParallelLayer::backward(const BackwardArgs& args) {
  MEGAMOE_RETURN_IF_ERROR(check_backward(args));
  Impl& m = *impl_;
  cudaStream_t stream = m.placement.stream;
  ep::Params p = m.params;
  p.num_tokens = m.forward_tokens;
  // Asked before anything is enqueued: a failure after the first launch would leave peers at a barrier.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (p.shape.fp8 != 0) MEGAMOE_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  // The forward's error was reported and cleared already: this backward's outputs must still be NaN.
  if (m.forward_failed) MEGAMOE_RETURN_IF_ERROR(ep::launch_record_forward_failed(p, stream));
  // h was not kept: GEMM1 once more, on the forward's rows and weights (bitwise the forward's h). The SwiGLU
  // backward then overwrites it with dh in place: each tile reads the h boxes of its own rows and columns
  // (streamed through its pipeline) before it stores dh there; a partial tile's boxes also read the next
  // expert's first rows, which may already be dh there, but those rows are never stored from it.
  if (p.shape.recompute_h != 0) MEGAMOE_RETURN_IF_ERROR(m.gemm1_swiglu(p, m.forward_w13, true));
  const int64_t H = m.config.hidden;

  if (m.options.backward_path == BackwardPath::kFused) {
    ep::FusedBackwardArgs fused;
    fused.d_out = args.d_out;
    fused.w13 = m.forward_w13;
    fused.w2 = m.forward_w2;
    fused.d_x = args.d_x;
    fused.d_topk_weights = args.d_topk_weights;
    fused.timeline = m.fused_timeline;
    fused.wave_lag = m.fused_wave_lag;
    MEGAMOE_RETURN_IF_ERROR(ep::launch_fused_backward(p, fused, m.max_blocks, stream));
    MEGAMOE_RETURN_IF_ERROR(m.weight_gradients(p, args));
    // The weight-gradient GEMMs read recv_x and recv_dout, which a peer's next call writes once it has passed
    // its last barrier of this call: that barrier comes after them (the modular path's last barrier does too).
    MEGAMOE_RETURN_IF_ERROR(ep::launch_barrier(p, ep::kBarrierGradDone, stream));
    // The weight gradients were written by the GEMMs: a failed call turns them into NaN too (every rank's
    // error of the call is in this rank's record since the fused kernel's last rank barrier).
    return m.nan_weight_gradients_if_failed(p, args);
  }
  if (p.shape.fp8 != 0) {
    // d_out quantized per token (1 x 128 along H) before the dispatch, which then moves e4m3 rows.
    MEGAMOE_RETURN_IF_ERROR(kernels::quantize_rows_1x128_bf16(args.d_out, m.forward_tokens, H,
                                                              m.buffer<uint8_t>(p.layout.dout_q),
                                                              m.buffer<float>(p.layout.dout_s), stream));
    MEGAMOE_RETURN_IF_ERROR(ep::launch_dispatch_fp8(p, nullptr, false, nullptr, stream, m.max_blocks));
  } else {
    MEGAMOE_RETURN_IF_ERROR(ep::launch_dispatch(p, args.d_out, nullptr, false, nullptr, stream, m.max_blocks));
  }
  MEGAMOE_RETURN_IF_ERROR(ep::launch_barrier(p, ep::kBarrierGradDispatched, stream));

  if (p.shape.fp8 != 0) {
    // The transposed weights of a known, nonzero version are kept until the forward quantizes another one (the
    // promise of ForwardArgs::weights_version); forgotten until this call's are enqueued, and under stream
    // capture (only recorded there) never promised.
    const bool transposed = m.quantized_version != 0 && m.transposed_version == m.quantized_version;
    m.transposed_version = 0;
    MEGAMOE_RETURN_IF_ERROR(m.expert_mlp_backward_fp8(p, args, !transposed));
    if (capture == cudaStreamCaptureStatusNone) m.transposed_version = m.quantized_version;
  } else {
    MEGAMOE_RETURN_IF_ERROR(m.expert_mlp_backward(p, args));
  }

  MEGAMOE_RETURN_IF_ERROR(ep::launch_barrier(p, ep::kBarrierGradCombined, stream));
  // The weight gradients were written by the GEMMs: a failed call turns them into NaN too.
  MEGAMOE_RETURN_IF_ERROR(m.nan_weight_gradients_if_failed(p, args));
  MEGAMOE_RETURN_IF_ERROR(ep::launch_combine_backward(p, args.d_x, args.d_topk_weights, stream, m.max_blocks));
  return Status::ok();
}

Status ExpertParallelLayer::synchronize_and_check() {
  Impl& m = *impl_;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.placement.stream));
  ep::DeviceError error{};
  ep::DeviceError* record = m.buffer<ep::DeviceError>(m.params.layout.error);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(&error, record, sizeof(error), cudaMemcpyDeviceToHost));
  // A group broken on the device (a timeout, a peer that wrote garbage) refuses calls from now on, whatever
  // error the record kept (the first one wins).
  int32_t broken_on_device = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(&broken_on_device, m.buffer<int32_t>(m.params.layout.broken),
                                          sizeof(broken_on_device), cudaMemcpyDeviceToHost));
  if (broken_on_device != 0) m.broken = true;
  if (error.code == 0) return Status::ok();
  // Cleared in the rank's stream order (not on the legacy default stream, which would order against
  // every other stream of the device).
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(record, 0, sizeof(error), m.placement.stream));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.placement.stream));
  m.forward_failed = m.has_forward;
  if (error.what == ep::kErrorBarrierTimeout || error.what == ep::kErrorBroken || error.what == ep::kErrorWaitTimeout)
    m.broken = true;
  return Status(static_cast<StatusCode>(error.code), describe(error, m.config));
}

// ---- virtual ranks ----

struct VirtualRankGroup::Impl {
  LayerConfig config;
  char* slab = nullptr;
  char** peer_table = nullptr;
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<ExpertParallelLayer>> layers;

  ~Impl() {
    layers.clear();
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
    if (peer_table != nullptr) cudaFree(peer_table);
    if (slab != nullptr) cudaFree(slab);
  }
};

VirtualRankGroup::~VirtualRankGroup() = default;

Status VirtualRankGroup::create(const LayerConfig& config, const LayerOptions& options,
                                std::unique_ptr<VirtualRankGroup>* group) {
  int64_t bytes = 0;
  MEGAMOE_RETURN_IF_ERROR(ExpertParallelLayer::workspace_bytes(config, options, &bytes));
  int device = 0, sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int R = static_cast<int>(config.num_ranks);
  if (R > sms)
    return Status(StatusCode::kNotSupported, "virtual ranks need at least one SM each: R=" + std::to_string(R) +
                                                 " > " + std::to_string(sms) + " SMs");
  std::unique_ptr<VirtualRankGroup> g(new VirtualRankGroup());
  g->impl_ = std::make_unique<Impl>();
  Impl& m = *g->impl_;
  m.config = config;
  const cudaError_t alloc = cudaMalloc(&m.slab, static_cast<size_t>(bytes) * R);
  if (alloc != cudaSuccess) {
    m.slab = nullptr;
    return Status(StatusCode::kCudaError, "cannot allocate the virtual ranks' workspace: " + std::to_string(R) +
                                              " x " + std::to_string(bytes) + " bytes (" + cudaGetErrorString(alloc) +
                                              "); lower max_tokens_per_rank or set expert_row_capacity");
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMemset(m.slab, 0, static_cast<size_t>(bytes) * R));
  std::vector<char*> bases(R);
  for (int r = 0; r < R; ++r) bases[r] = m.slab + static_cast<int64_t>(r) * bytes;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMalloc(&m.peer_table, sizeof(char*) * R));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(m.peer_table, bases.data(), sizeof(char*) * R, cudaMemcpyHostToDevice));
  for (int r = 0; r < R; ++r) {
    cudaStream_t s = nullptr;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    m.streams.push_back(s);
    RankPlacement placement;
    placement.rank = r;
    placement.stream = s;
    placement.max_blocks = std::max(1, sms / R);
    placement.workspace = bases[r];
    placement.peer_workspaces_device = m.peer_table;
    std::unique_ptr<ExpertParallelLayer> layer;
    MEGAMOE_RETURN_IF_ERROR(ExpertParallelLayer::create(config, options, placement, &layer));
    m.layers.push_back(std::move(layer));
  }
  *group = std::move(g);
  return Status::ok();
}

int VirtualRankGroup::num_ranks() const { return static_cast<int>(impl_->layers.size()); }
ExpertParallelLayer& VirtualRankGroup::layer(int rank) { return *impl_->layers.at(rank); }
cudaStream_t VirtualRankGroup::stream(int rank) const { return impl_->streams.at(rank); }

Status VirtualRankGroup::synchronize_and_check() {
  Status first;
  for (auto& layer : impl_->layers) {
    Status s = layer->synchronize_and_check();
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  return first;
}

}  // namespace megamoe
