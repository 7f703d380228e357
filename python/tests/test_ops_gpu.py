"""The GPU layer through the torch ops, against the fp32 reference (the checks of docs/MODEL.md): forward and every
gradient for 1, 2 and 4 virtual ranks and adversarial routing, torch.compile, CUDA graphs, input errors."""

import gc

import pytest
import torch

import megamoe
from megamoe import ops, reference


def _gpu_layer_available():
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        from megamoe import _lib
        if not _lib.built_with_cuda():
            return False, "libmegamoe was built without CUDA"
    except ImportError as e:
        return False, str(e)
    return True, ""


_available, _why = _gpu_layer_available()
pytestmark = pytest.mark.skipif(not _available, reason=_why)

@pytest.fixture(autouse=True)
def _settle_after_each_test():
    """Pins failures on the test that caused them: an asynchronous CUDA error surfaces here (not in a later
    test's call), and the finalizers of this test's modules (ops.release -> megamoe_vgroup_destroy) run now,
    not at a random later garbage collection."""
    yield
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.synchronize()


H, I, E, K = 256, 256, 16, 4
MAX_TOKENS = 384
TOL = 1e-2


def rel_err(got, want):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite values in the output"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def fp32_weight_grads(model, d_out, x, idx, w):
    """One micro-batch's weight gradients in fp32 (added by the GEMMs to zeroed fp32 buffers) through the op
    that takes main gradients; the lists hold one tensor per virtual rank of the module."""
    g13 = torch.zeros_like(model.w13, dtype=torch.float32)
    g2 = torch.zeros_like(model.w2, dtype=torch.float32)
    torch.ops.megamoe.moe_backward_into_main_grads(
        model._key, model.config.as_list(), d_out, x, idx, w, model.w13.detach(), model.w2.detach(), g13, g2,
        [torch.empty_like(t) for t in x], [torch.empty_like(t) for t in w])
    return g13, g2


def routing(kind, tokens, gen):
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    if kind == "one expert":  # every token's slot 0 to expert 0: one expert gets everything
        idx = torch.stack([torch.randperm(E - 1, generator=gen)[:K] + 1 for _ in range(tokens)])
        idx[:, 0] = 0
        return idx
    if kind == "masked":
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
        idx[torch.rand(tokens, K, generator=gen) < 0.4] = -1
        return idx
    if kind == "empty experts":  # only experts 0..K-1: the others (whole ranks when R > 1) get nothing
        return torch.stack([torch.randperm(K, generator=gen) for _ in range(tokens)])
    raise ValueError(kind)


def make(ranks, tokens, kind, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    per = E // ranks
    x = [torch.randn(t, H, generator=gen).bfloat16().to(device) for t in tokens]
    idx = [routing(kind, t, gen).to(device) if t else torch.zeros(0, K, dtype=torch.int64, device=device)
           for t in tokens]
    w = [torch.rand(t, K, generator=gen).to(device) for t in tokens]
    w13 = [(torch.randn(per, 2 * I, H, generator=gen) / H ** 0.5).bfloat16().to(device) for _ in range(ranks)]
    w2 = [(torch.randn(per, H, I, generator=gen) / I ** 0.5).bfloat16().to(device) for _ in range(ranks)]
    d_out = [torch.randn(t, H, generator=gen).bfloat16().to(device) for t in tokens]
    return x, idx, w, w13, w2, d_out


def run(fn, x, idx, w, w13, w2, d_out, up=False):
    leaves = [[t.detach().clone().float() if up else t.detach().clone() for t in ts] for ts in (x, w, w13, w2)]
    for t in (t for ts in leaves for t in ts):
        t.requires_grad_()
    outs = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    flat = [t for ts in leaves for t in ts]
    grads = torch.autograd.grad(outs, flat, [g.float() if up else g for g in d_out], allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, flat)]
    return list(outs), grads


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("kind", ["random", "one expert", "masked", "empty experts"])
def test_matches_fp32_reference(ranks, kind):
    tokens = [333, 0, 129, 7][:ranks] if ranks > 1 else [333]  # not tile multiples; T = 0 on a rank
    data = make(ranks, tokens, kind, seed=ranks)
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=ranks)
    got_out, got_g = run(lambda *a: ops.moe_ranks(*a, config=cfg), *data)
    want_out, want_g = run(reference.moe_ranks, *data, up=True)
    names = ["out"] * ranks + ["d_x"] * ranks + ["d_topk_weights"] * ranks + ["d_w13"] * ranks + ["d_w2"] * ranks
    for name, a, b in zip(names, got_out + got_g, want_out + want_g):
        assert a.dtype == (torch.float32 if name == "d_topk_weights" else torch.bfloat16), name
        if b.numel() and b.norm() > 0:
            assert rel_err(a, b) <= TOL, f"{name}: rel err {rel_err(a, b):.3g}"
        else:
            assert torch.all(a == 0), f"{name} must be zero"


def test_int32_ids_give_the_same_result():
    x, idx, w, w13, w2, _ = make(2, [100, 50], "masked")
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=2)
    a = ops.moe_ranks(x, idx, w, w13, w2, config=cfg)
    b = ops.moe_ranks(x, [i.int() for i in idx], w, w13, w2, config=cfg)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("ranks", [1, 2])
def test_module_matches_reference_and_torchtitan_layout(ranks):
    torch.manual_seed(0)
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=ranks, device="cuda")
    x, idx, w, _, _, d_out = make(1, [200], "random")
    out = model(x[0], idx[0], w[0])
    want = reference.moe(x[0].float(), idx[0], w[0], model.w13.float(), model.w2.float())
    assert rel_err(out, want) <= TOL
    w1, w2_, w3 = model.w1_w2_w3()
    other = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=ranks, device="cuda")
    other.load_w1_w2_w3(w1, w2_, w3)
    assert torch.equal(other.w13, model.w13) and torch.equal(other.w2, model.w2)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_main_grads_accumulate_micro_batches(ranks, precision):
    """MegaMoE(main_grad=True) on the GPU layer: the GEMMs add each micro-batch's fp32 weight gradients to
    w13.main_grad / w2.main_grad (accumulate_weight_grads): bitwise the sum of the two separate fp32 gradients,
    within 1e-2 of the reference's sum (the fp32 layer's, or the FP8 backward's oracle), and no .grad on the
    weights."""
    torch.manual_seed(1)
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=ranks, device="cuda", main_grad=True,
                            precision=precision)
    separate13, separate2, want13, want2 = [], [], 0, 0
    for seed in (2, 3):
        x, idx, w, _, _, d_out = make(1, [96 * ranks], "masked", seed=seed)
        model(x[0], idx[0], w[0]).backward(d_out[0])
        assert model.w13.grad is None and model.w2.grad is None
        xs, ids, ws = (list(torch.tensor_split(t, ranks)) for t in (x[0], idx[0], w[0]))
        g13, g2 = fp32_weight_grads(model, list(torch.tensor_split(d_out[0], ranks)), xs, ids, ws)
        separate13.append(g13)
        separate2.append(g2)
        if precision == "fp8":
            per = E // ranks
            _, _, r13, r2 = reference.moe_ranks_fp8_backward(
                [t.double() for t in xs], ids, [t.double() for t in ws], list(model.w13.detach().double().split(per)),
                list(model.w2.detach().double().split(per)),
                [t.double() for t in torch.tensor_split(d_out[0], ranks)])
            r13, r2 = torch.cat(r13), torch.cat(r2)
        else:
            up = [t.detach().float().requires_grad_() for t in (model.w13, model.w2)]
            ref = reference.moe(x[0].float(), idx[0], w[0], up[0], up[1])
            r13, r2 = torch.autograd.grad(ref, up, d_out[0].float())
        want13, want2 = want13 + r13, want2 + r2
    megamoe.synchronize_and_check(model)
    assert torch.equal(model.w13.main_grad, separate13[0] + separate13[1])
    assert torch.equal(model.w2.main_grad, separate2[0] + separate2[1])
    assert rel_err(model.w13.main_grad, want13) <= TOL and rel_err(model.w2.main_grad, want2) <= TOL


@pytest.mark.parametrize("fused_backward", [False, True])
@pytest.mark.parametrize("ranks", [1, 2])
def test_bf16_weight_gradients_are_the_fp32_ones_rounded_once(ranks, fused_backward):
    """The .grad of the weights comes from the GEMMs in bf16 (no fp32 tensor, no conversion kernel): bitwise the
    fp32 gradients of the same backward rounded to bf16, on the modular and the fused backward, and in the FP8
    layer."""
    torch.manual_seed(8)
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=ranks, device="cuda",
                            fused_backward=fused_backward)
    x, idx, w, _, _, d_out = make(1, [130 * ranks], "masked", seed=9)
    model(x[0], idx[0], w[0]).backward(d_out[0])
    assert model.w13.grad.dtype == torch.bfloat16 and model.w2.grad.dtype == torch.bfloat16
    xs, ids, ws = (list(torch.tensor_split(t, ranks)) for t in (x[0], idx[0], w[0]))
    ds = list(torch.tensor_split(d_out[0], ranks))
    g13, g2 = fp32_weight_grads(model, ds, xs, ids, ws)
    megamoe.synchronize_and_check(model)
    assert g13.abs().sum() > 0 and g2.abs().sum() > 0
    assert torch.equal(model.w13.grad, g13.bfloat16()) and torch.equal(model.w2.grad, g2.bfloat16())
    _, _, b13, b2 = torch.ops.megamoe.moe_backward_all_experts(model._key, model.config.as_list(), ds, xs, ids, ws,
                                                               model.w13.detach(), model.w2.detach())
    assert b13.dtype == torch.bfloat16 and torch.equal(b13, g13.bfloat16()) and torch.equal(b2, g2.bfloat16())
    if fused_backward:  # the FP8 layer runs the modular paths only
        return
    fp8 = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=ranks, device="cuda", precision="fp8")
    fp8(x[0], idx[0], w[0]).backward(d_out[0])
    assert fp8.w13.grad.dtype == torch.bfloat16 and fp8.w2.grad.dtype == torch.bfloat16
    f13, f2 = fp32_weight_grads(fp8, ds, xs, ids, ws)
    megamoe.synchronize_and_check(fp8)
    assert f13.abs().sum() > 0 and f2.abs().sum() > 0
    assert torch.equal(fp8.w13.grad, f13.bfloat16()) and torch.equal(fp8.w2.grad, f2.bfloat16())


@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_kernels_and_recomputed_h_give_the_same_bits(ranks):
    """The module's forward and every gradient, bitwise the same with the fused forward kernel, the fused
    backward, and h recomputed in the backward as with the modular path keeping h."""
    results = []
    for fused, fused_bwd, recompute in ((False, False, False), (True, False, False), (False, True, False),
                                        (False, False, True), (True, True, True)):
        torch.manual_seed(4)
        model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=ranks, device="cuda", fused_forward=fused,
                                fused_backward=fused_bwd, recompute_h=recompute)
        x, idx, w, _, _, d_out = make(1, [150 * ranks], "masked", seed=6)
        x0, w0 = x[0].requires_grad_(), w[0].requires_grad_()
        out = model(x0, idx[0], w0)
        grads = torch.autograd.grad(out, [x0, w0, model.w13, model.w2], d_out[0])
        megamoe.synchronize_and_check(model)
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_torch_compile_without_graph_breaks():
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, device="cuda")
    x, idx, w, _, _, d_out = make(1, [256], "random")
    x0 = x[0].requires_grad_()

    def step(a, b, c):
        return model(a, b, c)

    explanation = torch._dynamo.explain(step)(x0, idx[0], w[0])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    out_c = compiled(x0, idx[0], w[0])
    g_c = torch.autograd.grad(out_c, [x0, model.w13, model.w2], d_out[0])
    out_e = step(x0, idx[0], w[0])
    g_e = torch.autograd.grad(out_e, [x0, model.w13, model.w2], d_out[0])
    assert torch.equal(out_c, out_e)
    for a, b in zip(g_c, g_e):
        assert rel_err(a, b) <= 1e-3


@pytest.mark.parametrize("ranks", [1, 2])
def test_cuda_graph_replays_give_the_same_results(ranks):
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=ranks)
    key = ops.new_key()
    x, idx, w, w13, w2, d_out = make(ranks, [160] * ranks, "masked", seed=5)
    leaves = [t.requires_grad_() for t in (*x, *w, *w13, *w2)]

    def step():
        outs = ops.moe_ranks(x, idx, w, w13, w2, config=cfg, key=key)
        return outs, torch.autograd.grad(outs, leaves, d_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: creates the workspace, checks the ids
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outs, static_grads = step()

    for seed in (11, 12):
        nx, nidx, nw, _, _, nd = make(ranks, [160] * ranks, "random", seed=seed)
        with torch.no_grad():
            for dst, src in zip([*x, *idx, *w, *d_out], [*nx, *nidx, *nw, *nd]):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want_outs, want_grads = step()
        for a, b in zip([*static_outs, *static_grads], [*want_outs, *want_grads]):
            assert torch.equal(a, b) or rel_err(a, b) <= 1e-3
    ops.synchronize_and_check(cfg, key)


def _inputs_for_errors():
    x, idx, w, w13, w2, _ = make(1, [32], "random")
    return ops.LayerConfig(H, I, E, K, MAX_TOKENS), [x[0], idx[0], w[0], w13[0], w2[0]]


@pytest.mark.parametrize("position, change, error, match", [
    (0, lambda t: t.float(), TypeError, "x must be torch.bfloat16"),
    (1, lambda t: t.float(), TypeError, "topk_idx must be torch.int64 or torch.int32"),
    (2, lambda t: t.bfloat16(), TypeError, "topk_weights must be torch.float32"),
    (3, lambda t: t.float(), TypeError, "w13 must be torch.bfloat16"),
    (0, lambda t: t.cpu(), ValueError, "runs on CUDA tensors|on cpu"),
    (4, lambda t: t.cpu(), ValueError, "w2 is on cpu"),
    (0, lambda t: t[:, :128], ValueError, "x must have shape"),
    (1, lambda t: t[:, :2], ValueError, "topk_idx must have shape"),
    (4, lambda t: t[:, :, :128], ValueError, "w2 must have shape"),
    (0, lambda t: t.t().contiguous().t(), ValueError, "x must be contiguous"),
    (0, lambda t: torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape), ValueError, "x must start at a 16-byte"),
    (4, lambda t: torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape), ValueError, "w2 must start at a 16-byte"),
    (3, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), ValueError, "w13 must be contiguous"),
    (1, lambda t: torch.where(t == 3, E, t), ValueError, "expert id 16"),
    (1, lambda t: torch.where(t == 3, -5, t), ValueError, "expert id -5"),
])
def test_bad_inputs_raise_python_errors(position, change, error, match):
    cfg, args = _inputs_for_errors()
    args[position] = change(args[position])
    with pytest.raises(error, match=match):
        ops.moe(*args, config=cfg)
    # The layer is still usable afterwards.
    cfg, args = _inputs_for_errors()
    assert torch.isfinite(ops.moe(*args, config=cfg)).all()


def test_bad_config_raises():
    with pytest.raises(megamoe.MegaMoEError, match="hidden \\(H\\) must be a multiple of 128"):
        megamoe.MegaMoE(100, I, E, K, MAX_TOKENS)
    with pytest.raises(megamoe.MegaMoEError, match="divisible by num_ranks"):
        megamoe.MegaMoE(H, I, 6, 2, MAX_TOKENS, virtual_ranks=4)


def test_too_many_tokens_raise():
    cfg, args = _inputs_for_errors()
    x, idx, w, _, _, _ = make(1, [MAX_TOKENS + 1], "random")
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        ops.moe(x[0], idx[0], w[0], args[3], args[4], config=cfg)


# ---- precision="fp8": the blockwise FP8 forward against the FP8 reference (reference.moe_fp8, fp32) ----

@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("kind", ["random", "masked", "one expert"])
def test_fp8_forward_matches_the_fp8_reference(ranks, kind):
    tokens = [333, 0, 129, 7][:ranks] if ranks > 1 else [333]
    x, idx, w, w13, w2, _ = make(ranks, tokens, kind, seed=10 + ranks)
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=ranks, precision=ops.precision_from_name("fp8"))
    with torch.no_grad():
        got = ops.moe_ranks(x, idx, w, w13, w2, config=cfg)
        again = ops.moe_ranks(x, idx, w, w13, w2, config=cfg)
    # The oracle in float64 (reference.moe_fp8's docstring: an fp32 one on the GPU is itself 1% off).
    want = reference.moe_ranks_fp8([t.double() for t in x], idx, [t.double() for t in w], [t.double() for t in w13],
                                   [t.double() for t in w2])
    exact = reference.moe_ranks([t.double() for t in x], idx, [t.double() for t in w], [t.double() for t in w13],
                                [t.double() for t in w2])
    for r in range(ranks):
        assert torch.equal(got[r], again[r]), f"rank {r}: not deterministic"
        if tokens[r] == 0:
            continue
        assert rel_err(got[r], want[r]) <= TOL, f"rank {r}: {rel_err(got[r], want[r]):.3g} from the FP8 reference"
        # FP8 rounds x, the weights and a: clearly away from the exact layer, but the same layer.
        assert 1e-3 < rel_err(got[r], exact[r]) < 0.15, f"rank {r}: {rel_err(got[r], exact[r]):.3g} from exact"


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("kind", ["random", "masked", "one expert"])
def test_fp8_gradients_match_the_fp8_reference(ranks, kind):
    """Every gradient of the FP8 layer against reference.moe_ranks_fp8_backward in float64 (the FP8 backward's
    own quantization points, the routed rows in the GPU's order: "one expert" gives expert 0 more than 128
    rows, so its weight gradients take several token-major groups); bitwise repeatable."""
    tokens = [333, 0, 129, 7][:ranks] if ranks > 1 else [333]
    x, idx, w, w13, w2, d_out = make(ranks, tokens, kind, seed=20 + ranks)
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=ranks, precision=ops.precision_from_name("fp8"))

    def grads():
        leaves = [[t.detach().clone().requires_grad_() for t in ts] for ts in (x, w, w13, w2)]
        outs = ops.moe_ranks(leaves[0], idx, leaves[1], leaves[2], leaves[3], config=cfg)
        torch.autograd.backward(outs, d_out)
        return [[t.grad for t in ts] for ts in leaves]

    got, again = grads(), grads()
    want = reference.moe_ranks_fp8_backward([t.double() for t in x], idx, [t.double() for t in w],
                                            [t.double() for t in w13], [t.double() for t in w2],
                                            [t.double() for t in d_out])
    for name, g, g2, ref in zip(["d_x", "d_topk_weights", "d_w13", "d_w2"], got, again, want):
        for r in range(ranks):
            assert torch.equal(g[r], g2[r]), f"{name} of rank {r}: not deterministic"
            if ref[r].numel() == 0:
                continue
            err = rel_err(g[r], ref[r])
            assert err <= TOL, f"{name} of rank {r}: {err:.3g} from the FP8 reference"


def test_fp8_training_curve_stays_within_2_percent_of_bf16():
    """A routed classifier (router, these experts, head; AdamW, 300 steps, labels with an irreducible loss)
    trained with the FP8 layer and with the BF16 layer from the same init on the same data: the FP8 loss curve
    (moving average over 50 steps) stays within 2% of the BF16 one. Control: with the expert weights frozen
    the curve is far more than 2% away, so the bar sees expert gradients that are lost or wrong."""
    from routed_training import loss_curve, smoothed

    bf16 = smoothed(loss_curve("bf16"), 50)
    fp8 = smoothed(loss_curve("fp8"), 50)
    frozen = smoothed(loss_curve("fp8", train_experts=False), 50)
    worst = max(abs(f - b) / b for f, b in zip(fp8, bf16))
    control = max(abs(f - b) / b for f, b in zip(frozen, bf16))
    print(f"[fp8 training] loss {bf16[0]:.4f} -> bf16 {bf16[-1]:.4f}, fp8 {fp8[-1]:.4f}; worst relative "
          f"difference {worst:.4f}; frozen experts {frozen[-1]:.4f} ({control:.4f} away)")
    assert bf16[-1] < 0.85 * bf16[0], "the model must learn for the comparison to mean anything"
    assert worst <= 0.02
    assert control > 0.05


@pytest.mark.parametrize("ranks", [1, 2])
def test_fp8_prequantized_weights_match_the_layers_own_quantization(ranks):
    """ops.moe_ranks_fp8_weights on reference.quantize_128x128's codes and scales gives bitwise what the layer
    gives quantizing the bf16 weights itself (the same rule, IEEE divisions); with other scales (a
    checkpoint's), the oracle on the dequantized weights, used as they are."""
    tokens = [333, 129][:ranks]
    x, idx, w, w13, w2, _ = make(ranks, tokens, "random", seed=40 + ranks)
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=ranks, precision=ops.precision_from_name("fp8"))
    q13 = [reference.quantize_128x128(t) for t in w13]
    q2 = [reference.quantize_128x128(t) for t in w2]
    with torch.no_grad():
        own = ops.moe_ranks(x, idx, w, w13, w2, config=cfg)
        given = ops.moe_ranks_fp8_weights(x, idx, w, [c for c, _ in q13], [s for _, s in q13], [c for c, _ in q2],
                                          [s for _, s in q2], config=cfg)
        scaled = [s * 0.75 for _, s in q2]
        other = ops.moe_ranks_fp8_weights(x, idx, w, [c for c, _ in q13], [s for _, s in q13], [c for c, _ in q2],
                                          scaled, config=cfg)
        back = ops.moe_ranks(x, idx, w, w13, w2, config=cfg)  # the bf16 weights again after pre-quantized ones
    want = reference.moe_ranks_fp8([t.double() for t in x], idx, [t.double() for t in w],
                                   [reference.dequantize_128x128(c, s).double() for c, s in q13],
                                   [reference.dequantize_128x128(c, s).double() for (c, _), s in zip(q2, scaled)],
                                   weights_quantized=True)
    for r in range(ranks):
        assert torch.equal(own[r], given[r]), f"rank {r}: pre-quantized weights differ from the layer's own"
        assert torch.equal(own[r], back[r]), f"rank {r}: the bf16 weights after pre-quantized ones differ"
        assert rel_err(other[r], want[r]) <= TOL, f"rank {r}: {rel_err(other[r], want[r]):.3g} from the oracle"


def test_fp8_module_trains_and_runs_inference():
    torch.manual_seed(0)
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=2, device="cuda", precision="fp8")
    x, idx, w, _, _, _ = make(1, [200], "random")
    with torch.inference_mode():
        out = model(x[0], idx[0], w[0])
    want = reference.moe_fp8(x[0].double(), idx[0], w[0].double(), model.w13.double(), model.w2.double())
    assert rel_err(out, want) <= TOL
    trained = model(x[0], idx[0], w[0])  # the weights need their gradient: the FP8 backward runs
    assert torch.equal(trained, out)
    trained.float().square().sum().backward()
    assert model.w13.grad is not None and model.w2.grad is not None
    assert torch.isfinite(model.w13.grad).all() and model.w13.grad.abs().sum() > 0
