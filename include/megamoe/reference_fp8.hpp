// CPU reference of the expert-parallel MoE layer in blockwise FP8 (DeepSeek-V3 recipe, docs/MODEL.md):
// the exact layer of reference.hpp with E4M3 quantize-dequantize round trips at exactly the places where
// the GPU FP8 path quantizes, and fp32 everywhere else. It is the oracle the GPU FP8 path is compared
// against (relative error, as docs/MODEL.md describes); it is not expected to match the GPU bitwise
// (the GPU accumulates in a different order, with the FP8 wgmma's limited-precision accumulator).
//
// The list of quantization points, in the order the GPU follows them, is at the top of
// src/reference/fp8_reference_layer.cpp; what each point does is summarised here:
//   forward   x        1x128 groups along H, per token                        (operand of GEMM1)
//             W13      128x128 blocks of [2I, H], per expert                  (GEMM1, and dgrad of GEMM1)
//             a        1x128 groups along I, per routed row                   (operand of GEMM2)
//             W2       128x128 blocks of [H, I], per expert                   (GEMM2, and dgrad of GEMM2)
//             h, y, out: fp32, not quantized
//   backward  dy       1x128 groups along H, per routed row                   (operand of da = dy . W2)
//             dh       1x128 groups along 2I, per routed row                  (operand of dx = dh . W13)
//             dy^T, a^T, dh^T, x^T: 1x128 groups along the routed-row (token) axis, per expert, the last
//                      group partial                                           (operands of dW2, dW13);
//                      dy^T and x^T from the rows' 1x128 copies above (the dispatched FP8 values, rounded
//                      again), a^T and dh^T from the fp32 values
//             da, dx partials, dx, dW2, dW13: fp32, not quantized
//             d_topk_weights = <q(dOut_t) . W2q[e], a> with a the unquantized fp32 SwiGLU output.
// Nothing is rounded to bf16 (the GPU's bf16 stores are not modelled; see the .cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.hpp"
#include "megamoe/reference.hpp"
#include "megamoe/status.hpp"

namespace megamoe::reference {

// Same contract as forward<float> (reference.hpp); config.precision is not read.
Status forward_fp8(const LayerConfig& config, const std::vector<RankInputs<float>>& ranks,
                   std::vector<std::vector<float>>* out);

// Same contract as backward<float> (reference.hpp); config.precision is not read.
Status backward_fp8(const LayerConfig& config, const std::vector<RankInputs<float>>& ranks,
                    const std::vector<std::vector<float>>& d_out, std::vector<RankGradients<float>>* grads);

// Quantize-dequantize round trip of a weight-gradient operand laid out [channels, routed_rows]
// (row-major, the routed-row axis contiguous): every channel row is cut into groups of 128 consecutive
// routed rows starting at routed row 0, the last group partial (routed_rows need not be a multiple of 128);
// each group gets its own power-of-two scale (fp8::power_of_two_scale_from_amax) over the elements it has.
// Element arithmetic is that of fp8::fake_quantize_rows_1x128_power_of_two (a partial group gives what a
// zero-padded full group would give).
// Throws std::invalid_argument when channels or routed_rows is negative.
void fake_quantize_token_major_1x128(float* operand, int64_t channels, int64_t routed_rows);

}  // namespace megamoe::reference
