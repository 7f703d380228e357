// CPU reference of the expert-parallel MoE layer (docs/MODEL.md). The structure follows the GPU
// data flow so a reduced-precision variant can round at the same places: dispatch (route_rows), expert
// compute row by row, weight gradients per expert over its gathered rows, combine into per-token sums.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "megamoe/reference.hpp"
#include "reference/layer_math.hpp"

namespace megamoe::reference {

namespace {

// Every sum of the reference is accumulated in double, whatever the storage type.
template <typename Scalar>
double dot(const Scalar* a, const Scalar* b, int64_t n) {
  double sum = 0.0;
  for (int64_t k = 0; k < n; ++k) sum += static_cast<double>(a[k]) * static_cast<double>(b[k]);
  return sum;
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

template <typename Scalar>
void round_row_if(const detail::QuantizationHooks<Scalar>& hooks, detail::RowPoint point, std::vector<Scalar>& row) {
  if (hooks.round_row) hooks.round_row(point, std::span<Scalar>(row));
}

std::string size_mismatch(int64_t rank, const char* tensor, const char* formula, int64_t expected, size_t got) {
  std::ostringstream s;
  s << "rank " << rank << ": " << tensor << " must have " << formula << " = " << expected << " elements, got "
    << got;
  return s.str();
}

// The weights every GEMM reads, indexed by global expert id. Without a weight hook they point into the
// owning rank's tensors; with one they point at rounded copies, made once per call.
template <typename Scalar>
class ExpertWeightTable {
 public:
  ExpertWeightTable(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                    const detail::QuantizationHooks<Scalar>& hooks) {
    const int64_t hidden = config.hidden;
    const int64_t intermediate = config.intermediate;
    const int64_t w13_elements = 2 * intermediate * hidden;
    const int64_t w2_elements = hidden * intermediate;
    const int64_t experts_per_rank = config.experts_per_rank();
    const bool rounded = static_cast<bool>(hooks.round_weight);
    if (rounded) {
      rounded_w13_.resize(config.num_experts);
      rounded_w2_.resize(config.num_experts);
    }
    views_.resize(config.num_experts);
    for (int64_t expert = 0; expert < config.num_experts; ++expert) {
      const RankInputs<Scalar>& owner = ranks[config.rank_of_expert(expert)];
      const int64_t local = expert % experts_per_rank;
      const Scalar* w13 = owner.w13.data() + local * w13_elements;
      const Scalar* w2 = owner.w2.data() + local * w2_elements;
      if (rounded) {
        rounded_w13_[expert].assign(w13, w13 + w13_elements);
        rounded_w2_[expert].assign(w2, w2 + w2_elements);
        hooks.round_weight(detail::WeightKind::kW13, std::span<Scalar>(rounded_w13_[expert]), 2 * intermediate,
                           hidden);
        hooks.round_weight(detail::WeightKind::kW2, std::span<Scalar>(rounded_w2_[expert]), hidden, intermediate);
        w13 = rounded_w13_[expert].data();
        w2 = rounded_w2_[expert].data();
      }
      views_[expert] = {w13, w2};
    }
  }

  const detail::ExpertWeightsView<Scalar>& view(int64_t expert) const { return views_[expert]; }

 private:
  std::vector<std::vector<Scalar>> rounded_w13_;
  std::vector<std::vector<Scalar>> rounded_w2_;
  std::vector<detail::ExpertWeightsView<Scalar>> views_;
};

template <typename Scalar>
std::span<const Scalar> token_row(const std::vector<Scalar>& tensor, int64_t token, int64_t width) {
  return std::span<const Scalar>(tensor.data() + token * width, static_cast<size_t>(width));
}

}  // namespace

template <typename Scalar>
Status check_inputs(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks) {
  MEGAMOE_RETURN_IF_ERROR(validate(config));
  if (static_cast<int64_t>(ranks.size()) != config.num_ranks) {
    std::ostringstream s;
    s << "ranks must have num_ranks (R) = " << config.num_ranks << " entries, got " << ranks.size();
    return Status::invalid(s.str());
  }
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;
  const int64_t experts_per_rank = config.experts_per_rank();
  for (int64_t r = 0; r < config.num_ranks; ++r) {
    const RankInputs<Scalar>& rank = ranks[r];
    const int64_t tokens = rank.num_tokens;
    if (tokens < 0 || tokens > config.max_tokens_per_rank) {
      std::ostringstream s;
      s << "rank " << r << ": num_tokens must be in [0, max_tokens_per_rank = " << config.max_tokens_per_rank
        << "], got " << tokens;
      return Status::invalid(s.str());
    }
    if (static_cast<int64_t>(rank.x.size()) != tokens * hidden)
      return Status::invalid(size_mismatch(r, "x", "num_tokens * H", tokens * hidden, rank.x.size()));
    if (static_cast<int64_t>(rank.topk_idx.size()) != tokens * top_k)
      return Status::invalid(size_mismatch(r, "topk_idx", "num_tokens * K", tokens * top_k, rank.topk_idx.size()));
    if (static_cast<int64_t>(rank.topk_weights.size()) != tokens * top_k)
      return Status::invalid(
          size_mismatch(r, "topk_weights", "num_tokens * K", tokens * top_k, rank.topk_weights.size()));
    const int64_t w13_elements = experts_per_rank * 2 * intermediate * hidden;
    if (static_cast<int64_t>(rank.w13.size()) != w13_elements)
      return Status::invalid(size_mismatch(r, "w13", "E_local * 2I * H", w13_elements, rank.w13.size()));
    const int64_t w2_elements = experts_per_rank * hidden * intermediate;
    if (static_cast<int64_t>(rank.w2.size()) != w2_elements)
      return Status::invalid(size_mismatch(r, "w2", "E_local * H * I", w2_elements, rank.w2.size()));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t expert = rank.topk_idx[t * top_k + j];
        if (expert < -1 || expert >= config.num_experts) {
          std::ostringstream s;
          s << "rank " << r << ": topk_idx[" << t << ", " << j << "] = " << expert
            << " must be -1 (masked) or in [0, num_experts (E) = " << config.num_experts << ")";
          return Status::invalid(s.str());
        }
      }
    }
  }
  return Status::ok();
}

namespace detail {

template <typename Scalar>
void expert_forward_row(const LayerConfig& config, const ExpertWeightsView<Scalar>& weights,
                        std::span<const Scalar> x_row, const QuantizationHooks<Scalar>& hooks,
                        ExpertRowForward<Scalar>* row) {
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;

  std::vector<Scalar> x_operand(x_row.begin(), x_row.end());
  round_row_if(hooks, RowPoint::kTokenInput, x_operand);

  row->gate_up.assign(2 * intermediate, Scalar(0));
  for (int64_t o = 0; o < 2 * intermediate; ++o)
    row->gate_up[o] = static_cast<Scalar>(dot(x_operand.data(), weights.w13 + o * hidden, hidden));
  round_row_if(hooks, RowPoint::kGateUp, row->gate_up);

  row->activation.assign(intermediate, Scalar(0));
  for (int64_t i = 0; i < intermediate; ++i) {
    const double gate = static_cast<double>(row->gate_up[i]);
    const double up = static_cast<double>(row->gate_up[intermediate + i]);
    row->activation[i] = static_cast<Scalar>(gate * sigmoid(gate) * up);
  }

  std::vector<Scalar> activation_operand = row->activation;
  round_row_if(hooks, RowPoint::kActivation, activation_operand);

  row->output.assign(hidden, Scalar(0));
  for (int64_t h = 0; h < hidden; ++h)
    row->output[h] = static_cast<Scalar>(dot(activation_operand.data(), weights.w2 + h * intermediate, intermediate));
  round_row_if(hooks, RowPoint::kExpertOutput, row->output);
}

template <typename Scalar>
void expert_backward_row(const LayerConfig& config, const ExpertWeightsView<Scalar>& weights,
                         const ExpertRowForward<Scalar>& forward, std::span<const Scalar> d_out_row,
                         Scalar routing_weight, const QuantizationHooks<Scalar>& hooks,
                         ExpertRowBackward<Scalar>* row) {
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;

  row->routing_weight_grad = static_cast<Scalar>(dot(d_out_row.data(), forward.output.data(), hidden));

  row->output_grad.assign(hidden, Scalar(0));
  for (int64_t h = 0; h < hidden; ++h)
    row->output_grad[h] = static_cast<Scalar>(static_cast<double>(routing_weight) * static_cast<double>(d_out_row[h]));
  std::vector<Scalar> output_grad_operand = row->output_grad;
  round_row_if(hooks, RowPoint::kOutputGrad, output_grad_operand);

  // da = dy . W2 runs down the columns of W2 [H, I]: accumulate whole rows of W2 into a double vector.
  std::vector<double> activation_grad(intermediate, 0.0);
  for (int64_t h = 0; h < hidden; ++h) {
    const double dy = static_cast<double>(output_grad_operand[h]);
    const Scalar* w2_row = weights.w2 + h * intermediate;
    for (int64_t i = 0; i < intermediate; ++i) activation_grad[i] += dy * static_cast<double>(w2_row[i]);
  }
  row->activation_grad.assign(intermediate, Scalar(0));
  for (int64_t i = 0; i < intermediate; ++i) row->activation_grad[i] = static_cast<Scalar>(activation_grad[i]);
  round_row_if(hooks, RowPoint::kActivationGrad, row->activation_grad);

  row->gate_up_grad.assign(2 * intermediate, Scalar(0));
  for (int64_t i = 0; i < intermediate; ++i) {
    const double gate = static_cast<double>(forward.gate_up[i]);
    const double up = static_cast<double>(forward.gate_up[intermediate + i]);
    const double da = static_cast<double>(row->activation_grad[i]);
    const double s = sigmoid(gate);
    row->gate_up_grad[i] = static_cast<Scalar>(da * up * s * (1.0 + gate * (1.0 - s)));
    row->gate_up_grad[intermediate + i] = static_cast<Scalar>(da * gate * s);
  }
  std::vector<Scalar> gate_up_grad_operand = row->gate_up_grad;
  round_row_if(hooks, RowPoint::kGateUpGrad, gate_up_grad_operand);

  std::vector<double> input_grad(hidden, 0.0);
  for (int64_t o = 0; o < 2 * intermediate; ++o) {
    const double dh = static_cast<double>(gate_up_grad_operand[o]);
    const Scalar* w13_row = weights.w13 + o * hidden;
    for (int64_t k = 0; k < hidden; ++k) input_grad[k] += dh * static_cast<double>(w13_row[k]);
  }
  row->input_grad.assign(hidden, Scalar(0));
  for (int64_t k = 0; k < hidden; ++k) row->input_grad[k] = static_cast<Scalar>(input_grad[k]);
  round_row_if(hooks, RowPoint::kInputGradPartial, row->input_grad);
}

template <typename Scalar>
std::vector<std::vector<RoutedRow>> route_rows(const LayerConfig& config,
                                               const std::vector<RankInputs<Scalar>>& ranks) {
  std::vector<std::vector<RoutedRow>> rows_of_expert(config.num_experts);
  for (int64_t r = 0; r < config.num_ranks; ++r) {
    const RankInputs<Scalar>& rank = ranks[r];
    for (int64_t window = 0; window < rank.num_tokens; window += kRoutingWindow) {
      const int64_t end = std::min(window + kRoutingWindow, rank.num_tokens);
      for (int64_t j = 0; j < config.top_k; ++j) {
        for (int64_t t = window; t < end; ++t) {
          const int64_t expert = rank.topk_idx[t * config.top_k + j];
          if (expert < 0) continue;  // masked slot
          rows_of_expert[expert].push_back({r, t, j});
        }
      }
    }
  }
  return rows_of_expert;
}

template <typename Scalar>
Status forward_impl(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                    const QuantizationHooks<Scalar>& hooks, std::vector<std::vector<Scalar>>* out) {
  MEGAMOE_RETURN_IF_ERROR(check_inputs(config, ranks));
  if (out == nullptr) return Status::invalid("out must not be null");

  const int64_t hidden = config.hidden;
  const int64_t top_k = config.top_k;
  const std::vector<std::vector<RoutedRow>> rows_of_expert = route_rows(config, ranks);
  const ExpertWeightTable<Scalar> weights(config, ranks, hooks);

  // The combine: out_t sums w_j * y_j in double; contributions arrive in expert order, then in the row
  // order of route_rows.
  std::vector<std::vector<double>> combined(config.num_ranks);
  for (int64_t r = 0; r < config.num_ranks; ++r) combined[r].assign(ranks[r].num_tokens * hidden, 0.0);

  ExpertRowForward<Scalar> row;
  for (int64_t expert = 0; expert < config.num_experts; ++expert) {
    for (const RoutedRow& routed : rows_of_expert[expert]) {
      const RankInputs<Scalar>& source = ranks[routed.rank];
      expert_forward_row(config, weights.view(expert), token_row(source.x, routed.token, hidden), hooks, &row);
      const double routing_weight = static_cast<double>(source.topk_weights[routed.token * top_k + routed.slot]);
      double* out_row = combined[routed.rank].data() + routed.token * hidden;
      for (int64_t h = 0; h < hidden; ++h) out_row[h] += routing_weight * static_cast<double>(row.output[h]);
    }
  }

  out->assign(config.num_ranks, {});
  for (int64_t r = 0; r < config.num_ranks; ++r) {
    (*out)[r].resize(combined[r].size());
    for (size_t k = 0; k < combined[r].size(); ++k) (*out)[r][k] = static_cast<Scalar>(combined[r][k]);
  }
  return Status::ok();
}

template <typename Scalar>
Status backward_impl(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                     const std::vector<std::vector<Scalar>>& d_out, const QuantizationHooks<Scalar>& hooks,
                     std::vector<RankGradients<Scalar>>* grads) {
  MEGAMOE_RETURN_IF_ERROR(check_inputs(config, ranks));
  if (grads == nullptr) return Status::invalid("grads must not be null");
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;
  if (static_cast<int64_t>(d_out.size()) != config.num_ranks) {
    std::ostringstream s;
    s << "d_out must have num_ranks (R) = " << config.num_ranks << " entries, got " << d_out.size();
    return Status::invalid(s.str());
  }
  for (int64_t r = 0; r < config.num_ranks; ++r) {
    if (static_cast<int64_t>(d_out[r].size()) != ranks[r].num_tokens * hidden)
      return Status::invalid(
          size_mismatch(r, "d_out", "num_tokens * H", ranks[r].num_tokens * hidden, d_out[r].size()));
  }

  const std::vector<std::vector<RoutedRow>> rows_of_expert = route_rows(config, ranks);
  const ExpertWeightTable<Scalar> weights(config, ranks, hooks);
  const int64_t experts_per_rank = config.experts_per_rank();

  grads->assign(config.num_ranks, {});
  std::vector<std::vector<double>> combined_d_x(config.num_ranks);
  for (int64_t r = 0; r < config.num_ranks; ++r) {
    RankGradients<Scalar>& g = (*grads)[r];
    const int64_t tokens = ranks[r].num_tokens;
    g.d_x.assign(tokens * hidden, Scalar(0));
    g.d_topk_weights.assign(tokens * top_k, Scalar(0));  // masked slots keep 0
    g.d_w13.assign(experts_per_rank * 2 * intermediate * hidden, Scalar(0));
    g.d_w2.assign(experts_per_rank * hidden * intermediate, Scalar(0));
    combined_d_x[r].assign(tokens * hidden, 0.0);
  }

  ExpertRowForward<Scalar> forward_row;
  ExpertRowBackward<Scalar> backward_row;
  for (int64_t expert = 0; expert < config.num_experts; ++expert) {
    const std::vector<RoutedRow>& rows = rows_of_expert[expert];
    const int64_t routed = static_cast<int64_t>(rows.size());
    if (routed == 0) continue;
    const ExpertWeightsView<Scalar>& view = weights.view(expert);

    // Weight-gradient operands gathered transposed, [channels, routed]: the reduction over routed rows
    // then walks contiguous memory, as the K-major operand of the GPU's weight-gradient GEMM does.
    std::vector<Scalar> output_grad_t(hidden * routed);
    std::vector<Scalar> activation_t(intermediate * routed);
    std::vector<Scalar> gate_up_grad_t(2 * intermediate * routed);
    std::vector<Scalar> token_input_t(hidden * routed);

    for (int64_t n = 0; n < routed; ++n) {
      const RoutedRow& row = rows[n];
      const RankInputs<Scalar>& source = ranks[row.rank];
      const std::span<const Scalar> x_row = token_row(source.x, row.token, hidden);
      const Scalar routing_weight = source.topk_weights[row.token * top_k + row.slot];
      expert_forward_row(config, view, x_row, hooks, &forward_row);
      expert_backward_row(config, view, forward_row, token_row(d_out[row.rank], row.token, hidden), routing_weight,
                          hooks, &backward_row);

      (*grads)[row.rank].d_topk_weights[row.token * top_k + row.slot] = backward_row.routing_weight_grad;
      double* d_x_row = combined_d_x[row.rank].data() + row.token * hidden;
      for (int64_t k = 0; k < hidden; ++k) d_x_row[k] += static_cast<double>(backward_row.input_grad[k]);

      for (int64_t h = 0; h < hidden; ++h) output_grad_t[h * routed + n] = backward_row.output_grad[h];
      for (int64_t i = 0; i < intermediate; ++i) activation_t[i * routed + n] = forward_row.activation[i];
      for (int64_t o = 0; o < 2 * intermediate; ++o) gate_up_grad_t[o * routed + n] = backward_row.gate_up_grad[o];
      for (int64_t k = 0; k < hidden; ++k) token_input_t[k * routed + n] = x_row[k];
    }

    if (hooks.round_wgrad_operand) {
      hooks.round_wgrad_operand(WgradOperand::kOutputGrad, std::span<Scalar>(output_grad_t), hidden, routed);
      hooks.round_wgrad_operand(WgradOperand::kActivation, std::span<Scalar>(activation_t), intermediate, routed);
      hooks.round_wgrad_operand(WgradOperand::kGateUpGrad, std::span<Scalar>(gate_up_grad_t), 2 * intermediate,
                                routed);
      hooks.round_wgrad_operand(WgradOperand::kTokenInput, std::span<Scalar>(token_input_t), hidden, routed);
    }

    // The gradients belong to the rank that owns the expert, whichever ranks the rows came from.
    RankGradients<Scalar>& owner = (*grads)[config.rank_of_expert(expert)];
    const int64_t local = expert % experts_per_rank;
    Scalar* d_w2 = owner.d_w2.data() + local * hidden * intermediate;
    for (int64_t h = 0; h < hidden; ++h)
      for (int64_t i = 0; i < intermediate; ++i)
        d_w2[h * intermediate + i] =
            static_cast<Scalar>(dot(output_grad_t.data() + h * routed, activation_t.data() + i * routed, routed));
    Scalar* d_w13 = owner.d_w13.data() + local * 2 * intermediate * hidden;
    for (int64_t o = 0; o < 2 * intermediate; ++o)
      for (int64_t k = 0; k < hidden; ++k)
        d_w13[o * hidden + k] =
            static_cast<Scalar>(dot(gate_up_grad_t.data() + o * routed, token_input_t.data() + k * routed, routed));
  }

  for (int64_t r = 0; r < config.num_ranks; ++r) {
    std::vector<Scalar>& d_x = (*grads)[r].d_x;
    for (size_t k = 0; k < d_x.size(); ++k) d_x[k] = static_cast<Scalar>(combined_d_x[r][k]);
  }
  return Status::ok();
}

}  // namespace detail

template <typename Scalar>
Status forward(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
               std::vector<std::vector<Scalar>>* out) {
  return detail::forward_impl(config, ranks, detail::QuantizationHooks<Scalar>{}, out);
}

template <typename Scalar>
Status backward(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                const std::vector<std::vector<Scalar>>& d_out, std::vector<RankGradients<Scalar>>* grads) {
  return detail::backward_impl(config, ranks, d_out, detail::QuantizationHooks<Scalar>{}, grads);
}

#define MEGAMOE_INSTANTIATE_REFERENCE_LAYER(Scalar)                                                            \
  template Status check_inputs<Scalar>(const LayerConfig&, const std::vector<RankInputs<Scalar>>&);            \
  template Status forward<Scalar>(const LayerConfig&, const std::vector<RankInputs<Scalar>>&,                  \
                                  std::vector<std::vector<Scalar>>*);                                          \
  template Status backward<Scalar>(const LayerConfig&, const std::vector<RankInputs<Scalar>>&,                 \
                                   const std::vector<std::vector<Scalar>>&, std::vector<RankGradients<Scalar>>*); \
  template void detail::expert_forward_row<Scalar>(const LayerConfig&, const detail::ExpertWeightsView<Scalar>&, \
                                                   std::span<const Scalar>,                                    \
                                                   const detail::QuantizationHooks<Scalar>&,                   \
                                                   detail::ExpertRowForward<Scalar>*);                         \
  template void detail::expert_backward_row<Scalar>(                                                           \
      const LayerConfig&, const detail::ExpertWeightsView<Scalar>&, const detail::ExpertRowForward<Scalar>&,   \
      std::span<const Scalar>, Scalar, const detail::QuantizationHooks<Scalar>&,                               \
      detail::ExpertRowBackward<Scalar>*);                                                                     \
  template std::vector<std::vector<detail::RoutedRow>> detail::route_rows<Scalar>(                             \
      const LayerConfig&, const std::vector<RankInputs<Scalar>>&);                                             \
  template Status detail::forward_impl<Scalar>(const LayerConfig&, const std::vector<RankInputs<Scalar>>&,     \
                                               const detail::QuantizationHooks<Scalar>&,                       \
                                               std::vector<std::vector<Scalar>>*);                             \
  template Status detail::backward_impl<Scalar>(                                                               \
      const LayerConfig&, const std::vector<RankInputs<Scalar>>&, const std::vector<std::vector<Scalar>>&,     \
      const detail::QuantizationHooks<Scalar>&, std::vector<RankGradients<Scalar>>*);

MEGAMOE_INSTANTIATE_REFERENCE_LAYER(float)
MEGAMOE_INSTANTIATE_REFERENCE_LAYER(double)

#undef MEGAMOE_INSTANTIATE_REFERENCE_LAYER

}  // namespace megamoe::reference
