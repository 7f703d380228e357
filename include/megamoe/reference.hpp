// CPU reference of the whole expert-parallel MoE layer (docs/MODEL.md), forward and backward,
// over all ranks at once. It is the oracle of every GPU test: readable over fast.
//
// Storage is the template scalar (float for GPU checks, double for finite differences); every sum is
// accumulated in double. Tensors are flat row-major std::vectors with the shapes of docs/MODEL.md.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/status.hpp"

namespace megamoe::reference {

// What one rank holds: its tokens and its local experts' weights.
template <typename Scalar>
struct RankInputs {
  int64_t num_tokens = 0;             // T_r, may be 0
  std::vector<Scalar> x;              // [T, H]
  std::vector<int64_t> topk_idx;      // [T, K] global expert ids, -1 = masked slot
  std::vector<Scalar> topk_weights;   // [T, K]
  std::vector<Scalar> w13;            // [E_local, 2I, H]: rows 0..I-1 gate, I..2I-1 up
  std::vector<Scalar> w2;             // [E_local, H, I]
};

template <typename Scalar>
struct RankGradients {
  std::vector<Scalar> d_x;             // [T, H]
  std::vector<Scalar> d_topk_weights;  // [T, K]; 0 for masked slots
  std::vector<Scalar> d_w13;           // [E_local, 2I, H]
  std::vector<Scalar> d_w2;            // [E_local, H, I]
};

// Checks that every rank's tensors have the sizes the config implies and that every expert id is -1
// or in [0, E). The message names the rank and the tensor.
template <typename Scalar>
Status check_inputs(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks);

// out[r] = [T_r, H] for every rank r.
template <typename Scalar>
Status forward(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
               std::vector<std::vector<Scalar>>* out);

// Gradients of sum_r <d_out[r], out[r]> with respect to every input of every rank.
template <typename Scalar>
Status backward(const LayerConfig& config, const std::vector<RankInputs<Scalar>>& ranks,
                const std::vector<std::vector<Scalar>>& d_out,
                std::vector<RankGradients<Scalar>>* grads);

}  // namespace megamoe::reference
