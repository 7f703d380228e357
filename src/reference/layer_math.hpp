// Internal pieces of the CPU reference layer (include/megamoe/reference.hpp), exposed so that a
// reduced-precision reference (FP8 blockwise, BF16) can reuse the exact same math and only say where
// values get rounded. Not part of the public API.
//
// Where rounding can happen (every hook is optional; an empty std::function means "keep the value"):
//
//   round_weight         once per expert, on a copy of w13 [2I, H] and of w2 [H, I]. The same rounded
//                        copy feeds the forward GEMMs and the backward dgrad GEMMs: 128x128 block scales
//                        are the same for W and W^T, so one rounding serves both.
//   round_row            on one row of a GEMM operand or a GEMM result (see RowPoint):
//                          - operand points (kTokenInput, kActivation, kOutputGrad, kGateUpGrad) round a
//                            copy that only the next GEMM reads; the unrounded row is what the
//                            weight-gradient GEMMs gather (they use their own, token-major rounding);
//                          - result points (kGateUp, kExpertOutput, kActivationGrad, kInputGradPartial)
//                            round the stored result in place: every later step sees the rounded value.
//   round_wgrad_operand  once per expert on each gathered weight-gradient operand, laid out
//                        [channels, routed_rows] (routed rows contiguous: the reduction axis is
//                        contiguous, as the K-major FP8 operand on the GPU). routed_rows is any count,
//                        not padded to 128.
//
// Row order: the rows routed to one expert are visited in the order the GPU numbers them
// (src/kernels/ep_layout.cuh): by source rank, then per window of kRoutingWindow consecutive tokens of that
// rank (windows start at multiples of 32), by slot, then by token. That is also the column order of the
// weight-gradient operands (so the FP8 reference's groups of 128 routed rows are the GPU's) and the order
// contributions are summed in: every result is deterministic, and identical for any partition of the same
// global problem whose ranks start their tokens at multiples of kRoutingWindow.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/status.hpp"

namespace megamoe::reference::detail {

enum class RowPoint : int {
  kTokenInput = 0,        // x_t [H], operand of GEMM1 (forward)
  kGateUp = 1,            // h [2I], result of GEMM1
  kActivation = 2,        // a [I], operand of GEMM2 (forward)
  kExpertOutput = 3,      // y [H], result of GEMM2; read by the combine and by d_topk_weights
  kOutputGrad = 4,        // dy = w * dOut_t [H], operand of the dgrad of GEMM2
  kActivationGrad = 5,    // da [I], result of the dgrad of GEMM2
  kGateUpGrad = 6,        // dh = [dg, du] [2I], operand of the dgrad of GEMM1
  kInputGradPartial = 7,  // dh . W13[e] [H], result of the dgrad of GEMM1, one per slot, before the combine
};

enum class WeightKind : int {
  kW13 = 0,  // [2I, H]
  kW2 = 1,   // [H, I]
};

enum class WgradOperand : int {
  kOutputGrad = 0,   // dy^T [H, n]   (dW2 = dy^T a)
  kActivation = 1,   // a^T  [I, n]
  kGateUpGrad = 2,   // dh^T [2I, n]  (dW13 = dh^T x)
  kTokenInput = 3,   // x^T  [H, n]
};

template <typename Scalar>
struct QuantizationHooks {
  std::function<void(RowPoint point, std::span<Scalar> row)> round_row;
  std::function<void(WeightKind kind, std::span<Scalar> matrix, int64_t rows, int64_t cols)> round_weight;
  std::function<void(WgradOperand operand, std::span<Scalar> matrix, int64_t channels, int64_t routed_rows)>
      round_wgrad_operand;
};

// One expert's weights as the GEMMs read them (already rounded when a weight hook is set).
template <typename Scalar>
struct ExpertWeightsView {
  const Scalar* w13 = nullptr;  // [2I, H]
  const Scalar* w2 = nullptr;   // [H, I]
};

// What the forward of one routed row produces.
template <typename Scalar>
struct ExpertRowForward {
  std::vector<Scalar> gate_up;     // h [2I], after round_row(kGateUp)
  std::vector<Scalar> activation;  // a [I] as SwiGLU produced it (round_row(kActivation) rounds a copy)
  std::vector<Scalar> output;      // y [H], after round_row(kExpertOutput); not yet weighted
};

// What the backward of one routed row produces.
template <typename Scalar>
struct ExpertRowBackward {
  std::vector<Scalar> output_grad;      // dy [H], unrounded (round_row(kOutputGrad) rounds a copy)
  std::vector<Scalar> activation_grad;  // da [I], after round_row(kActivationGrad)
  std::vector<Scalar> gate_up_grad;     // dh [2I], unrounded (round_row(kGateUpGrad) rounds a copy)
  std::vector<Scalar> input_grad;       // dh . W13[e] [H], after round_row(kInputGradPartial)
  Scalar routing_weight_grad = 0;       // <dOut_t, y>
};

// h = x . W13^T, a = silu(g) * u, y = a . W2^T for one row.
template <typename Scalar>
void expert_forward_row(const LayerConfig& config, const ExpertWeightsView<Scalar>& weights,
                        std::span<const Scalar> x_row, const QuantizationHooks<Scalar>& hooks,
                        ExpertRowForward<Scalar>* row);

// The backward of one row given its forward (recomputed) and the token's dOut_t.
template <typename Scalar>
void expert_backward_row(const LayerConfig& config, const ExpertWeightsView<Scalar>& weights,
                         const ExpertRowForward<Scalar>& forward, std::span<const Scalar> d_out_row,
                         Scalar routing_weight, const QuantizationHooks<Scalar>& hooks,
                         ExpertRowBackward<Scalar>* row);

// One (rank, token, slot) routed to an expert.
struct RoutedRow {
  int64_t rank = 0;
  int64_t token = 0;
  int64_t slot = 0;
};

inline constexpr int64_t kRoutingWindow = 32;

// For every global expert, the rows routed to it in the row order above; masked slots are skipped.
// Expects inputs that passed check_inputs.
template <typename Scalar>
std::vector<std::vector<RoutedRow>> route_rows(const LayerConfig& config,
                                               const std::vector<RankInputs<Scalar>>& ranks);

// The public forward/backward with hooks; with default (empty) hooks they are exactly
// reference::forward/backward.
template <typename Scalar>
Status forward_impl(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                    const QuantizationHooks<Scalar>& hooks, std::vector<std::vector<Scalar>>* out);

template <typename Scalar>
Status backward_impl(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                     const std::vector<std::vector<Scalar>>& d_out, const QuantizationHooks<Scalar>& hooks,
                     std::vector<RankGradients<Scalar>>* grads);

}  // namespace megamoe::reference::detail
