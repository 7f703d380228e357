// The blockwise FP8 reference layer (include/megamoe/reference_fp8.hpp): the exact reference layer
// (reference_layer.cpp) run with QuantizationHooks that round with the E4M3 emulation of fp8.hpp, plus
// the routing-weight gradient computed the way the GPU computes it.
//
// Quantization points, in the order the GPU FP8 path follows them. "q1x128(v, axis)" is a quantize-
// dequantize round trip with one scale per 128 consecutive elements along axis; "q128x128" one scale per
// 128x128 block; everything not listed is fp32 (the reference stores float and accumulates in double).
//
//  Forward
//   F1  x_t [H]          q1x128 along H, once per token (the GPU quantizes on the source rank, before the
//                        dispatch; the reference quantizes each routed row, the same values every time).
//                        Hook: round_row(kTokenInput), a copy that only GEMM1 reads.
//   F2  W13[e] [2I, H]   q128x128 on the public layout (blocks = 128 consecutive gate rows or 128
//                        consecutive up rows x 128 columns). Hook: round_weight(kW13).
//   F3  h = x_q . W13_q^T            fp32, not quantized (GEMM1 accumulator; round_row(kGateUp) is a no-op).
//   F4  a = silu(g) * u              fp32, in GEMM1's epilogue.
//   F5  a [I]            q1x128 along I, per routed row. Hook: round_row(kActivation), a copy that only
//                        GEMM2 reads.
//   F6  W2[e] [H, I]     q128x128. Hook: round_weight(kW2).
//   F7  y = a_q . W2_q^T             fp32, not quantized (round_row(kExpertOutput) is a no-op).
//   F8  out_t = sum_j w_j * y_j      fp32 combine, slots summed in expert order, then route_rows' order.
//
//  Backward
//   B1  dOut_t [H]       q1x128 along H, once per token (the GPU quantizes it on the source rank, before
//                        the dispatch); dy_j = w_j * q(dOut_t) in fp32, the operand the dgrad of GEMM2 reads.
//                        Not q1x128(w_j * dOut_t): the two differ in about 1 element in 1000 (bf16 data puts
//                        v / scale exactly on an E4M3 rounding midpoint that often, and the two fp32 paths to
//                        it break the tie differently), which moves d_w13 by about 0.8% and d_x by 0.4%
//                        (measured against the GPU, docs/PERF.md run 44). The pre-quantized dOut goes through
//                        backward_impl with round_row(kOutputGrad) a no-op.
//   B2  W2_q^T           the K-major copy of W2_q for da = dy . W2 (K = H): same E4M3 codes, the 128x128
//                        block scales transposed, so numerically the same matrix as F6 (the reference
//                        reuses the rounded copy of F6).
//   B3  g = q(dOut_t) . W2_q,  da = w_j * g              fp32 (round_row(kActivationGrad) is a no-op).
//       d_topk_weights[t, j] = <g, a_j>, a_j the fp32 SwiGLU output of F4 (NOT the FP8 a_q of F5), i.e.
//                        the dgrad epilogue contracts on the I side (docs/MODEL.md, Backward) with the
//                        activation it recomputes from h. Computed here by fp8_routing_weight_grads below, because the
//                        generic backward contracts <dOut_t, y_j> with the unquantized dOut.
//   B4  dh = [dg, du]                fp32 SwiGLU backward from the fp32 h of F3 and the fp32 da of B3.
//   B5  dh [2I]          q1x128 along 2I (public order: groups are 128 gate or 128 up channels, never
//                        mixed). Hook: round_row(kGateUpGrad), a copy that only the dgrad of GEMM1 reads.
//   B6  W13_q^T          the K-major copy of W13_q (K = 2I): numerically the same matrix as F2.
//   B7  dx_j = dh_q . W13_q           fp32 partial per slot (round_row(kInputGradPartial) is a no-op);
//       dx_t = sum_j dx_j             fp32 combine.
//   B8  weight-gradient operands, per expert, token-major [channels, n_e] with the expert's routed rows in
//       the GPU's order (layer_math.hpp: source rank, windows of 32 tokens, slot, token), q1x128 along the
//       routed-row axis: groups of 128 consecutive routed rows starting at the expert's first row, the last
//       one partial (it never crosses into the next expert):
//         dy^T [H, n]  (dy = w_j * dOut_t)   a^T [I, n]   for dW2 = dy^T a
//         dh^T [2I, n]                       x^T [H, n]   for dW13 = dh^T x
//       x and dOut reach the expert's rank only as their dispatched FP8 copies (F1, B1), so x^T and dy^T
//       are built from those: x's routed rows rounded 1 x 128 along their channels first (F1), dy's already
//       w_j * q(dOut_t) (B1), then both along the routed rows (a second rounding, as a GPU that dequantizes,
//       transposes and quantizes the copies again gets). a and dh are the expert rank's own fp32 values
//       (F4, B4), rounded along the routed rows only. Hook: round_wgrad_operand (all four operands), via
//       fake_quantize_channels_1x128 and fake_quantize_token_major_1x128.
//   B9  dW2, dW13                    fp32 accumulation over the expert's routed rows, fp32 result.
//
// Not modelled (documented choices, each far below the FP8 error):
//  - bf16 storage. The GPU stores some values in bf16 where the contract or the traffic asks for it
//    (out and d_x are bf16 tensors; the combine may move y_j and dx_j in bf16; the backward may save h in
//    bf16). Each such store adds at most 2^-9 relative error per element (~0.1-0.2% norm-wise) against the
//    ~3-5% of FP8; the reference keeps fp32 so that one oracle serves every storage choice. That holds for
//    a value stored in bf16 and used as it is; one that is quantized again afterwards (a from a bf16 h, dh
//    from a bf16 h) lands on the other E4M3 neighbour whenever the bf16 rounding crosses a rounding
//    midpoint, with probability about 2^-9 / (the E4M3 step): by arithmetic about 1% norm-wise, too close
//    to the GPU checks' 1e-2. So the GPU's FP8 forward keeps h in fp32 (docs/FP8.md).
//  - The FP8 wgmma's limited-precision accumulation (promoted to fp32 every 128 K-elements on the GPU):
//    the reference accumulates in double.
#include "megamoe/reference_fp8.hpp"

#include <algorithm>
#include <span>
#include <stdexcept>
#include <string>

#include "megamoe/fp8.hpp"
#include "reference/fp8_hooks.hpp"
#include "reference/layer_math.hpp"

namespace megamoe::reference {

namespace {

using detail::QuantizationHooks;
using detail::RowPoint;
using detail::WeightKind;
using detail::WgradOperand;

void quantize_operand_row(std::span<float> row) {
  fp8::fake_quantize_rows_1x128(row.data(), 1, static_cast<int64_t>(row.size()));
}

// The F1 / B1 rounding of every routed row of a token-major operand [channels, routed_rows]: each column
// cut into groups of 128 consecutive channels, as fake_quantize_rows_1x128 cuts the row it came from.
void fake_quantize_channels_1x128(float* operand, int64_t channels, int64_t routed_rows) {
  std::vector<float> column(static_cast<size_t>(channels));
  for (int64_t n = 0; n < routed_rows; ++n) {
    for (int64_t c = 0; c < channels; ++c) column[c] = operand[c * routed_rows + n];
    fp8::fake_quantize_rows_1x128(column.data(), 1, channels);
    for (int64_t c = 0; c < channels; ++c) operand[c * routed_rows + n] = column[c];
  }
}

// B3's routing-weight gradient for every routed row: d_topk_weights[t, j] = <q(dOut_t) . W2_q[e], a_j>, given
// d_out_q = q(dOut) (B1). Overwrites the entries backward_impl wrote (masked slots keep their 0).
void fp8_routing_weight_grads(const LayerConfig& config, const std::vector<RankInputs<float>>& ranks,
                              const std::vector<std::vector<float>>& d_out_q, const QuantizationHooks<float>& hooks,
                              std::vector<RankGradients<float>>* grads) {
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;
  const int64_t experts_per_rank = config.experts_per_rank();

  const std::vector<std::vector<detail::RoutedRow>> rows_of_expert = detail::route_rows(config, ranks);
  std::vector<float> w13_q;
  std::vector<float> w2_q;
  std::vector<double> g(intermediate);
  detail::ExpertRowForward<float> forward_row;
  for (int64_t expert = 0; expert < config.num_experts; ++expert) {
    const std::vector<detail::RoutedRow>& rows = rows_of_expert[expert];
    if (rows.empty()) continue;
    const RankInputs<float>& owner = ranks[config.rank_of_expert(expert)];
    const int64_t local = expert % experts_per_rank;
    const float* w13 = owner.w13.data() + local * 2 * intermediate * hidden;
    const float* w2 = owner.w2.data() + local * hidden * intermediate;
    w13_q.assign(w13, w13 + 2 * intermediate * hidden);
    w2_q.assign(w2, w2 + hidden * intermediate);
    hooks.round_weight(WeightKind::kW13, std::span<float>(w13_q), 2 * intermediate, hidden);
    hooks.round_weight(WeightKind::kW2, std::span<float>(w2_q), hidden, intermediate);
    const detail::ExpertWeightsView<float> view{w13_q.data(), w2_q.data()};

    for (const detail::RoutedRow& routed : rows) {
      const RankInputs<float>& source = ranks[routed.rank];
      detail::expert_forward_row(
          config, view,
          std::span<const float>(source.x.data() + routed.token * hidden, static_cast<size_t>(hidden)), hooks,
          &forward_row);
      // g = q(dOut_t) . W2_q, stored fp32 like the GEMM accumulator; accumulated in double.
      std::fill(g.begin(), g.end(), 0.0);
      const float* d_out_row = d_out_q[routed.rank].data() + routed.token * hidden;
      for (int64_t h = 0; h < hidden; ++h) {
        const double d = static_cast<double>(d_out_row[h]);
        const float* w2_row = w2_q.data() + h * intermediate;
        for (int64_t i = 0; i < intermediate; ++i) g[i] += d * static_cast<double>(w2_row[i]);
      }
      double dw = 0.0;
      for (int64_t i = 0; i < intermediate; ++i) {
        const float g_fp32 = static_cast<float>(g[i]);
        dw += static_cast<double>(g_fp32) * static_cast<double>(forward_row.activation[i]);
      }
      (*grads)[routed.rank].d_topk_weights[routed.token * top_k + routed.slot] = static_cast<float>(dw);
    }
  }
}

}  // namespace

namespace detail {

QuantizationHooks<float> fp8_quantization_hooks() {
  QuantizationHooks<float> hooks;
  hooks.round_row = [](RowPoint point, std::span<float> row) {
    switch (point) {
      case RowPoint::kTokenInput:    // F1
      case RowPoint::kActivation:    // F5
      case RowPoint::kGateUpGrad:    // B5
        quantize_operand_row(row);
        return;
      case RowPoint::kOutputGrad:        // B1: dOut was quantized per token before backward_impl
      case RowPoint::kGateUp:            // F3: fp32 accumulator
      case RowPoint::kExpertOutput:      // F7: fp32
      case RowPoint::kActivationGrad:    // B3: fp32
      case RowPoint::kInputGradPartial:  // B7: fp32
        return;
    }
  };
  // F2, F6 (and B2, B6: the transposed copies share the codes and the transposed block scales).
  hooks.round_weight = [](WeightKind, std::span<float> matrix, int64_t rows, int64_t cols) {
    fp8::fake_quantize_blocks_128x128(matrix.data(), rows, cols);
  };
  // B8: x through its dispatched FP8 copy first (dy is built from the quantized dOut already).
  hooks.round_wgrad_operand = [](WgradOperand operand, std::span<float> matrix, int64_t channels,
                                 int64_t routed_rows) {
    if (operand == WgradOperand::kTokenInput) fake_quantize_channels_1x128(matrix.data(), channels, routed_rows);
    fake_quantize_token_major_1x128(matrix.data(), channels, routed_rows);
  };
  return hooks;
}

}  // namespace detail

void fake_quantize_token_major_1x128(float* operand, int64_t channels, int64_t routed_rows) {
  if (channels < 0 || routed_rows < 0) {
    throw std::invalid_argument("megamoe::reference::fake_quantize_token_major_1x128: channels and routed_rows "
                                "must be >= 0, got channels=" + std::to_string(channels) +
                                " routed_rows=" + std::to_string(routed_rows));
  }
  // A partial group is zero-padded to 128: zeros do not change the amax (NaN elements are ignored by the
  // amax either way) and quantize to zero, so the valid elements get exactly the partial group's result.
  float group[fp8::kGroup];
  for (int64_t c = 0; c < channels; ++c) {
    float* row = operand + c * routed_rows;
    for (int64_t begin = 0; begin < routed_rows; begin += fp8::kGroup) {
      const int64_t count = std::min(fp8::kGroup, routed_rows - begin);
      std::fill(group, group + fp8::kGroup, 0.0f);
      std::copy(row + begin, row + begin + count, group);
      fp8::fake_quantize_rows_1x128_power_of_two(group, 1, fp8::kGroup);
      std::copy(group, group + count, row + begin);
    }
  }
}

Status forward_fp8(const LayerConfig& config, const std::vector<RankInputs<float>>& ranks,
                   std::vector<std::vector<float>>* out) {
  return detail::forward_impl(config, ranks, detail::fp8_quantization_hooks(), out);
}

Status backward_fp8(const LayerConfig& config, const std::vector<RankInputs<float>>& ranks,
                    const std::vector<std::vector<float>>& d_out, std::vector<RankGradients<float>>* grads) {
  const QuantizationHooks<float> hooks = detail::fp8_quantization_hooks();
  // backward_impl checks the inputs and d_out (with the configuration) before anything runs; the per-token
  // quantization (B1) only needs the row count to match first.
  std::vector<std::vector<float>> d_out_q = d_out;
  for (size_t r = 0; r < d_out_q.size() && r < ranks.size(); ++r) {
    if (config.hidden > 0 && config.hidden % fp8::kGroup == 0 &&
        static_cast<int64_t>(d_out_q[r].size()) == ranks[r].num_tokens * config.hidden)
      fp8::fake_quantize_rows_1x128(d_out_q[r].data(), ranks[r].num_tokens, config.hidden);
  }
  MEGAMOE_RETURN_IF_ERROR(detail::backward_impl(config, ranks, d_out_q, hooks, grads));
  fp8_routing_weight_grads(config, ranks, d_out_q, hooks, grads);
  return Status::ok();
}

}  // namespace megamoe::reference
