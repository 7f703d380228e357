"""A stand-in for libmegamoe's virtual-rank groups that computes with megamoe.reference (on any device,
the CPU included) and keeps, per layer state, the inputs of its latest forward for the backward, as the
library keeps its routing. Tests swap it in as megamoe.ops._backend to check the torch side without a GPU."""

import concurrent.futures

import torch

from megamoe import reference


class ReferenceBackend:
    def __init__(self):
        self.forwards = 0
        self.backwards = 0
        self.latest = {}  # id(state) -> the float copies of its latest forward's inputs

    def supports(self, device):
        return True

    def forward(self, state, x, idx, w, w13, w2, out):
        self.forwards += 1
        latest = [t.float() for t in x], list(idx), [t.float() for t in w], [t.float() for t in w13], \
            [t.float() for t in w2]
        self.latest[id(state)] = latest
        layer = reference.moe_ranks_fp8 if state.config.fp8 else reference.moe_ranks
        for o, r in zip(out, layer(*latest)):
            o.copy_(r)

    def forward_fp8_weights(self, state, x, idx, w, fp8_weights, out):
        self.forwards += 1
        self.latest.pop(id(state), None)  # no bf16 weights to differentiate
        w13_q, w13_s, w2_q, w2_s = fp8_weights
        w13 = [reference.dequantize_128x128(q, s) for q, s in zip(w13_q, w13_s)]
        w2 = [reference.dequantize_128x128(q, s) for q, s in zip(w2_q, w2_s)]
        outs = reference.moe_ranks_fp8([t.float() for t in x], list(idx), [t.float() for t in w], w13, w2,
                                       weights_quantized=True)
        for o, r in zip(out, outs):
            o.copy_(r)

    def backward(self, state, d_out, d_x, d_w, d_w13, d_w2, accumulate=False):
        self.backwards += 1
        latest = self.latest[id(state)]

        def reference_grads():
            if state.config.fp8:  # the FP8 backward's own quantization points, not autograd
                d_x_, d_w_, d_w13_, d_w2_ = reference.moe_ranks_fp8_backward(*latest, [g.float() for g in d_out])
                return [*d_x_, *d_w_, *d_w13_, *d_w2_]
            x, idx, w, w13, w2 = [[t.detach().clone().requires_grad_(t.is_floating_point()) for t in ts]
                                  for ts in latest]
            outs = reference.moe_ranks(x, idx, w, w13, w2)
            return torch.autograd.grad(outs, [*x, *w, *w13, *w2], [g.float() for g in d_out])

        # An op implementation runs below the autograd dispatch keys (thread-local): use a fresh thread.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            grads = pool.submit(reference_grads).result()
        r = len(d_out)
        assert len(grads) == 4 * r
        for dst, src in zip([*d_x, *d_w], grads[:2 * r]):
            dst.copy_(src)
        for dst, src in zip([*d_w13, *d_w2], grads[2 * r:]):
            if accumulate:  # as the library's accumulate_weight_grads: one fp32 add
                dst.add_(src)
            else:
                dst.copy_(src)

    def synchronize_and_check(self, state, device):
        pass
