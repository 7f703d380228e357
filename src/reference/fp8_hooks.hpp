// The blockwise FP8 reference's quantization points as hooks of the reference layer (layer_math.hpp):
// what reference::forward_fp8 / backward_fp8 run with, for internal users that compose them with more
// (the CPU tests perturb the GEMM results around them). Not part of the public API.
#pragma once

#include "reference/layer_math.hpp"

namespace megamoe::reference::detail {

// F1-F8 and B1-B9 of fp8_reference_layer.cpp: E4M3 round trips at the operand points, the weights and the
// weight-gradient operands; the GEMM result points left as they are.
QuantizationHooks<float> fp8_quantization_hooks();

}  // namespace megamoe::reference::detail
