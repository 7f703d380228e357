"""The torch side of megamoe.ops on the CPU: op registration, autograd, input checks, the "latest forward"
rule and torch.compile, with the library swapped for a backend that computes with the reference and keeps
the routing of its latest forward exactly as the GPU layer does. The GPU layer itself: test_ops_gpu.py."""

import pytest
import torch
from reference_backend import ReferenceBackend

from megamoe import ops, reference


@pytest.fixture
def backend(monkeypatch):
    b = ReferenceBackend()
    monkeypatch.setattr(ops, "_backend", b)
    return b


def inputs(ranks=2, tokens=(5, 3), hidden=128, inter=128, experts=4, top_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = ops.LayerConfig(hidden=hidden, intermediate=inter, num_experts=experts, top_k=top_k,
                          max_tokens_per_rank=16, num_ranks=ranks)
    per = experts // ranks
    x = [torch.randn(t, hidden, generator=g).bfloat16().requires_grad_() for t in tokens[:ranks]]
    idx = [torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)]) if t else
           torch.zeros(0, top_k, dtype=torch.int64) for t in tokens[:ranks]]
    w = [torch.rand(t, top_k, generator=g).requires_grad_() for t in tokens[:ranks]]
    w13 = [(torch.randn(per, 2 * inter, hidden, generator=g) / hidden ** 0.5).bfloat16().requires_grad_()
           for _ in range(ranks)]
    w2 = [(torch.randn(per, hidden, inter, generator=g) / inter ** 0.5).bfloat16().requires_grad_()
          for _ in range(ranks)]
    return cfg, x, idx, w, w13, w2


def grads_of(fn, x, idx, w, w13, w2, d_out):
    leaves = [*x, *w, *w13, *w2]
    outs = fn(x, idx, w, w13, w2)
    return [o.float() for o in outs], torch.autograd.grad(outs, leaves, d_out)


def test_op_matches_reference_with_gradients(backend):
    cfg, x, idx, w, w13, w2 = inputs()
    d_out = [torch.randn_like(t) for t in x]
    got, got_g = grads_of(lambda *a: ops.moe_ranks(*a, config=cfg, key=ops.new_key()), x, idx, w, w13, w2, d_out)
    up = [[t.detach().float().requires_grad_() for t in ts] for ts in (x, w, w13, w2)]
    want, want_g = grads_of(reference.moe_ranks, up[0], idx, up[1], up[2], up[3], [g.float() for g in d_out])
    assert [g.dtype for g in got_g] == [t.dtype for t in (*x, *w, *w13, *w2)]
    for a, b in zip(got + list(got_g), want + list(want_g)):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


def test_backward_of_an_older_forward_recomputes_it(backend):
    cfg, x, idx, w, w13, w2 = inputs(seed=1)
    _, x2, idx2, w_2, _, _ = inputs(seed=2)
    key = ops.new_key()
    first = ops.moe_ranks(x, idx, w, w13, w2, config=cfg, key=key)
    second = ops.moe_ranks(x2, idx2, w_2, w13, w2, config=cfg, key=key)
    assert backend.forwards == 2
    d = [torch.ones_like(t) for t in first]
    g_first = torch.autograd.grad(first, x, d, retain_graph=True)
    assert backend.forwards == 3  # first's routing was no longer the latest
    g_second = torch.autograd.grad(second, x2, d[:1] + [torch.ones_like(second[1])])
    assert backend.forwards == 4
    _, want = grads_of(reference.moe_ranks, x, idx, w, w13, w2, d)
    for a, b in zip(g_first, want[:2]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert all(g.shape == t.shape for g, t in zip(g_second, x2))


def _misaligned(t):
    """The same values in a contiguous view that starts 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    view = flat[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16
    return view


@pytest.mark.parametrize("bad, error, match", [
    (lambda a: a[0].__setitem__(0, a[0][0].float()), TypeError, "x\\[0\\] must be torch.bfloat16"),
    (lambda a: a[1].__setitem__(1, a[1][1].float()), TypeError, "topk_idx\\[1\\] must be"),
    (lambda a: a[2].__setitem__(0, a[2][0].double()), TypeError, "topk_weights\\[0\\] must be torch.float32"),
    (lambda a: a[3].__setitem__(0, a[3][0][:, :10]), ValueError, "w13\\[0\\] must have shape"),
    (lambda a: a[4].__setitem__(1, a[4][1].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "w2\\[1\\] must be contiguous"),
    (lambda a: a[0].__setitem__(0, a[0][0].t().contiguous().t()), ValueError, "x\\[0\\] must be contiguous"),
    (lambda a: a[1].__setitem__(0, a[1][0] + 4), ValueError, "topk_idx\\[0\\] holds expert id"),
    (lambda a: a[0].__setitem__(1, _misaligned(a[0][1])), ValueError, "x\\[1\\] must start at a 16-byte aligned"),
    (lambda a: a[3].__setitem__(0, _misaligned(a[3][0])), ValueError, "w13\\[0\\] must start at a 16-byte aligned"),
    (lambda a: a[0].pop(), ValueError, "one tensor per rank"),
])
def test_bad_inputs_raise_clear_errors(backend, bad, error, match):
    cfg, *lists = inputs()
    lists = [list(t) for t in lists]
    bad(lists)
    with pytest.raises(error, match=match):
        ops.moe_ranks(*lists, config=cfg)


def test_too_many_tokens(backend):
    cfg, x, idx, w, w13, w2 = inputs(ranks=1, tokens=(17,))
    with pytest.raises(ValueError, match="max_tokens_per_rank=16"):
        ops.moe_ranks(x, idx, w, w13, w2, config=cfg)


def test_compile_has_no_graph_break_and_matches_eager(backend):
    cfg, x, idx, w, w13, w2 = inputs(ranks=1, tokens=(6,))
    key = ops.new_key()

    def step(x0, idx0, w0, a, b):
        return ops.moe_ranks([x0], [idx0], [w0], [a], [b], config=cfg, key=key)[0].float().square().sum()

    explanation = torch._dynamo.explain(step)(x[0], idx[0], w[0], w13[0], w2[0])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    leaves = [x[0], w[0], w13[0], w2[0]]
    got = torch.autograd.grad(compiled(x[0], idx[0], w[0], w13[0], w2[0]), leaves)
    want = torch.autograd.grad(step(x[0], idx[0], w[0], w13[0], w2[0]), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_opcheck(backend):
    cfg, x, idx, w, w13, w2 = inputs()
    args = (ops.new_key(), cfg.as_list(), x, idx, w, w13, w2)
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_all_experts_in_one_tensor_give_the_per_rank_results_bitwise(backend):
    cfg, x, idx, w, w13, w2 = inputs(ranks=2, experts=4)
    w13_all = torch.cat([t.detach() for t in w13]).requires_grad_()
    w2_all = torch.cat([t.detach() for t in w2]).requires_grad_()
    d_out = [torch.randn_like(t) for t in x]
    got = ops.moe_ranks_all_experts(x, idx, w, w13_all, w2_all, config=cfg, key=ops.new_key())
    got_g = torch.autograd.grad(got, [*x, *w, w13_all, w2_all], d_out)
    want = ops.moe_ranks(x, idx, w, w13, w2, config=cfg, key=ops.new_key())
    want_g = torch.autograd.grad(want, [*x, *w, *w13, *w2], d_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got_g[:4], want_g[:4]):
        assert torch.equal(a, b)
    assert torch.equal(got_g[4], torch.cat(want_g[4:6])) and got_g[4].dtype == torch.bfloat16
    assert torch.equal(got_g[5], torch.cat(want_g[6:8])) and got_g[5].dtype == torch.bfloat16


def _feeders(root, param):
    """The autograd nodes that hand a gradient to param's accumulator."""
    seen, found, stack = set(), [], [root]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and type(nxt).__name__ == "AccumulateGrad" and nxt.variable is param:
                found.append(type(fn).__name__)
            stack.append(nxt)
    return found


@pytest.mark.parametrize("recorded", [7, 9])
def test_backward_returns_one_gradient_per_recorded_input(backend, recorded):
    # torch 2.11 records the all-experts op's inputs without the main-gradient arguments left at their default
    # (7 inputs) and refuses a longer result; torch 2.15 records all 9. The backward must fit either.
    cfg, x, idx, w, w13, w2 = inputs(ranks=2, experts=4)
    w13_all = torch.cat([t.detach() for t in w13])
    w2_all = torch.cat([t.detach() for t in w2])
    key = ops.new_key()
    ops.moe_ranks_all_experts(x, idx, w, w13_all, w2_all, config=cfg, key=key)

    class Ctx:
        pass
    ctx = Ctx()
    ctx.key, ctx.config, ctx.ranks, ctx.main_grads = key, cfg.as_list(), len(x), None
    ctx.saved_tensors = (*x, *idx, *w, w13_all, w2_all)
    ctx.needs_input_grad = (False,) * recorded
    grads = ops._backward_all_experts(ctx, [torch.randn_like(t) for t in x])
    assert len(grads) == recorded
    assert grads[5].shape == w13_all.shape and grads[6].shape == w2_all.shape


@pytest.mark.parametrize("ranks", [2, 4])
def test_module_weight_gradients_come_back_in_one_piece(backend, ranks):
    """With virtual ranks the module's parameters hold every rank's experts; their gradients must come back
    from the layer's op as one tensor, not as one slice per rank that autograd widens to the full size
    (zero-filled) and adds up."""
    from megamoe import MegaMoE

    module = MegaMoE(hidden=128, intermediate=128, num_experts=8, top_k=2, max_tokens_per_rank=16,
                     virtual_ranks=ranks, device="cpu")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * ranks, 128, generator=g).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4 * ranks)])
    w = torch.rand(4 * ranks, 2, generator=g).requires_grad_()
    out = module(x, idx, w)
    for param in (module.w13, module.w2):
        feeders = _feeders(out.grad_fn, param)
        assert len(feeders) == 1 and "Slice" not in feeders[0], feeders
    out.float().square().sum().backward()
    want = reference.moe(x.detach().float(), idx, w.detach(), module.w13.detach().float(), module.w2.detach().float())
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert module.w13.grad.shape == module.w13.shape and module.w2.grad.shape == module.w2.shape


@pytest.mark.parametrize("ranks", [1, 2])
def test_main_grads_accumulate_micro_batches_without_grad_tensors(backend, ranks):
    """main_grad=True: two micro-batches add their fp32 weight gradients to w13.main_grad / w2.main_grad, bitwise
    the sum of the two separate fp32 gradients; the weights get no .grad; x and the routing weights still do."""
    from megamoe import MegaMoE

    module = MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16,
                     virtual_ranks=ranks, device="cpu", main_grad=True)
    assert module.w13.main_grad.dtype == torch.float32 and not module.w13.main_grad.any()
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        x = torch.randn(3 * ranks, 128, generator=g).bfloat16().requires_grad_()
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3 * ranks)])
        w = torch.rand(3 * ranks, 2, generator=g).requires_grad_()
        batches.append((x, idx, w, torch.randn(3 * ranks, 128, generator=g).bfloat16()))
    separate13, separate2 = [], []
    for x, idx, w, d in batches:
        out = module(x, idx, w)
        out.backward(d)
        assert module.w13.grad is None and module.w2.grad is None
        assert x.grad is not None and w.grad is not None
        # The same micro-batch's fp32 gradients on their own, added to zeroed fp32 buffers.
        xs, ids, ws = (list(torch.tensor_split(t, ranks)) for t in (x.detach(), idx, w.detach()))
        g13 = torch.zeros_like(module.w13, dtype=torch.float32)
        g2 = torch.zeros_like(module.w2, dtype=torch.float32)
        torch.ops.megamoe.moe_backward_into_main_grads(
            module._key, module.config.as_list(), list(torch.tensor_split(d, ranks)), xs, ids, ws,
            module.w13.detach(), module.w2.detach(), g13, g2, [torch.empty_like(t) for t in xs],
            [torch.empty_like(t) for t in ws])
        separate13.append(g13)
        separate2.append(g2)
    assert torch.equal(module.w13.main_grad, separate13[0] + separate13[1])
    assert torch.equal(module.w2.main_grad, separate2[0] + separate2[1])


def _main_grad_module(ranks):
    from megamoe import MegaMoE

    return MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16,
                   virtual_ranks=ranks, device="cpu", main_grad=True)


def _micro_batch(ranks, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * ranks, 128, generator=g).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3 * ranks)])
    w = torch.rand(3 * ranks, 2, generator=g).requires_grad_()
    return x, idx, w


@pytest.mark.parametrize("ranks", [1, 2])
def test_main_grads_with_several_forwards_in_flight(backend, ranks):
    """Micro-batch forwards first, their backwards after (pipeline schedules, a module called twice): every
    backward adds to the same main gradients, which autograd must not take for a saved input modified in place."""
    module = _main_grad_module(ranks)
    batches = [_micro_batch(ranks, seed) for seed in (11, 12, 13)]
    outs = [module(*b) for b in batches]
    sum(o.float().square().sum() for o in outs).backward()
    want = _main_grad_module(ranks)
    with torch.no_grad():
        want.w13.copy_(module.w13)
        want.w2.copy_(module.w2)
    for b in batches:
        x, idx, w = (t.detach().requires_grad_(t.is_floating_point()) for t in b)
        want(x, idx, w).float().square().sum().backward()
    torch.testing.assert_close(module.w13.main_grad, want.w13.main_grad)
    torch.testing.assert_close(module.w2.main_grad, want.w2.main_grad)
    assert module.w13.grad is None and all(b[0].grad is not None for b in batches)


def test_main_grads_under_torch_compile(backend):
    module = _main_grad_module(2)
    x, idx, w = _micro_batch(2, 21)

    def step(a, b, c):
        return module(a, b, c).float().square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(x, idx, w).backward()
    got13, got2 = module.w13.main_grad.clone(), module.w2.main_grad.clone()
    module.w13.main_grad.zero_()
    module.w2.main_grad.zero_()
    torch._dynamo.reset()
    step(x.detach().requires_grad_(), idx, w.detach().requires_grad_()).backward()
    assert torch.equal(got13, module.w13.main_grad) and torch.equal(got2, module.w2.main_grad)
    assert got13.any()


@pytest.mark.parametrize("change, error, match", [
    (lambda g13, g2: (g13.bfloat16(), g2), TypeError, "w13.main_grad must be a torch.float32"),
    (lambda g13, g2: (g13, g2[:1]), ValueError, "w2.main_grad must have w2's shape"),
    (lambda g13, g2: (g13, None), ValueError, "both or neither"),
    (lambda g13, g2: (g13.transpose(1, 2).contiguous().transpose(1, 2), g2), ValueError, "contiguous"),
])
def test_bad_main_grads_are_refused(backend, change, error, match):
    cfg, x, idx, w, w13, w2 = inputs()
    w13_all = torch.cat([t.detach() for t in w13]).requires_grad_()
    w2_all = torch.cat([t.detach() for t in w2]).requires_grad_()
    g13, g2 = change(torch.zeros_like(w13_all, dtype=torch.float32), torch.zeros_like(w2_all, dtype=torch.float32))
    with pytest.raises(error, match=match):
        ops.moe_ranks_all_experts(x, idx, w, w13_all, w2_all, config=cfg, main_grads=(g13, g2))


def test_the_config_carries_how_the_layer_runs():
    cfg = ops.LayerConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16,
                          num_ranks=2, fused_forward=True, recompute_h=True, fused_backward=True)
    assert ops.LayerConfig.from_list(cfg.as_list()) == cfg
    plain = ops.LayerConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
    assert ops.LayerConfig.from_list(plain.as_list()) == plain and plain != cfg
    try:
        options = cfg.options_c()
    except ImportError as e:  # the library is needed for its defaults
        pytest.skip(str(e))
    assert options.forward_path == 1 and options.recompute_h == 1 and options.backward_path == 1
    assert options.wait_timeout_seconds > 0
    assert plain.options_c().forward_path == 0 and plain.options_c().recompute_h == 0
    assert plain.options_c().backward_path == 0


def test_module_options_reach_its_config():
    from megamoe import MegaMoE

    module = MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16,
                     virtual_ranks=2, device="cpu", fused_forward=True, recompute_h=True, fused_backward=True)
    assert module.config.fused_forward and module.config.recompute_h and module.config.fused_backward


def test_opcheck_all_experts(backend):
    cfg, x, idx, w, w13, w2 = inputs()
    w13_all = torch.cat([t.detach() for t in w13]).requires_grad_()
    w2_all = torch.cat([t.detach() for t in w2]).requires_grad_()
    args = (ops.new_key(), cfg.as_list(), x, idx, w, w13_all, w2_all)
    torch.library.opcheck(torch.ops.megamoe.moe_forward_all_experts.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


class CountingBackend(ReferenceBackend):
    def __init__(self):
        super().__init__()
        self.checked = []

    def synchronize_and_check(self, state, device):
        self.checked.append((state.config, device))


def test_synchronize_and_check_takes_a_module_a_config_or_nothing(monkeypatch):
    import megamoe

    backend = CountingBackend()
    monkeypatch.setattr(ops, "_backend", backend)
    monkeypatch.setattr(ops.LayerConfig, "validate", lambda self: None)
    layer = megamoe.MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
    megamoe.synchronize_and_check(layer)
    layer.synchronize_and_check()
    assert [c for c, _ in backend.checked] == [layer.config, layer.config]
    assert all(d == layer.w13.device for _, d in backend.checked)
    cfg, *_ = inputs(ranks=1, tokens=(3,))
    megamoe.synchronize_and_check(cfg, device="cpu")
    assert backend.checked[-1] == (cfg, torch.device("cpu"))
    megamoe.synchronize_and_check()  # every live library group: none exists with this backend
    with pytest.raises(TypeError, match="takes a MegaMoE module, a LayerConfig or None"):
        megamoe.synchronize_and_check("layer")


def test_synchronize_and_check_before_any_gpu_work_checks_nothing_and_allocates_nothing():
    import megamoe
    from megamoe import _lib

    try:
        _lib.lib()
    except ImportError as e:
        pytest.skip(str(e))
    layer = megamoe.MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
    megamoe.synchronize_and_check(layer)  # a CPU module: nothing ran on a GPU
    megamoe.synchronize_and_check()
    cfg, *_ = inputs(ranks=1, tokens=(3,))
    megamoe.synchronize_and_check(cfg, device="cpu")
    assert not ops._states[layer._key].groups, "a check created a library group"


# ---- precision="fp8": the forward is moe_fp8, the gradients moe_ranks_fp8_backward (not autograd) ----

def test_fp8_module_forward_and_gradients_are_the_fp8_reference(backend):
    from megamoe import MegaMoE

    torch.manual_seed(0)
    module = MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16,
                     virtual_ranks=2, device="cpu", precision="fp8")
    assert module.config.fp8 and "precision='fp8'" in module.extra_repr()
    _, x, idx, w, _, _ = inputs()
    x_all, idx_all = torch.cat([t.detach() for t in x]), torch.cat(idx)
    w_all = torch.cat([t.detach() for t in w]).requires_grad_()
    out = module(x_all, idx_all, w_all)
    want = reference.moe_fp8(x_all.float(), idx_all, w_all.detach(), module.w13.float(), module.w2.float())
    assert torch.equal(out, want.bfloat16())
    assert not torch.equal(out, reference.moe(x_all.float(), idx_all, w_all.detach(), module.w13.float(),
                                              module.w2.float()).bfloat16())
    d_out = torch.randn_like(out)
    out.backward(d_out)
    assert backend.backwards == 1
    # The module's two virtual ranks: contiguous token chunks (torch.tensor_split), experts [0, 2) and [2, 4).
    def chunks(t):
        return list(torch.tensor_split(t, 2))
    d_x, d_w, d_w13, d_w2 = reference.moe_ranks_fp8_backward(
        chunks(x_all.float()), chunks(idx_all), chunks(w_all.detach()), list(module.w13.detach().float().split(2)),
        list(module.w2.detach().float().split(2)), chunks(d_out.float()))
    assert torch.equal(w_all.grad, torch.cat(d_w))
    assert torch.equal(module.w13.grad, torch.cat(d_w13).to(module.w13.dtype))
    assert torch.equal(module.w2.grad, torch.cat(d_w2).to(module.w2.dtype))


def test_fp8_functional_gradients_are_the_fp8_backward(backend):
    cfg, x, idx, w, w13, w2 = inputs()
    cfg8 = ops.LayerConfig(**{**cfg.__dict__, "precision": ops.precision_from_name("fp8")})
    d_out = [torch.randn_like(t) for t in x]
    outs, grads = grads_of(lambda *a: ops.moe_ranks(*a, config=cfg8, key=ops.new_key()), x, idx, w, w13, w2, d_out)
    up = [[t.detach().float() for t in ts] for ts in (x, w, w13, w2)]
    want = reference.moe_ranks_fp8(up[0], idx, up[1], up[2], up[3])
    for got, ref in zip(outs, want):
        assert torch.equal(got, ref.bfloat16().float())
    d_x, d_w, d_w13, d_w2 = reference.moe_ranks_fp8_backward(up[0], idx, up[1], up[2], up[3],
                                                             [g.float() for g in d_out])
    assert [g.dtype for g in grads] == [t.dtype for t in (*x, *w, *w13, *w2)]
    for got, ref in zip(grads, [*d_x, *d_w, *d_w13, *d_w2]):
        assert torch.equal(got, ref.to(got.dtype))
    # Not the autograd of the FP8 forward: the backward quantizes at its own points.
    _, exact = grads_of(reference.moe_ranks, [t.detach().float().requires_grad_() for t in x], idx,
                        [t.detach().float().requires_grad_() for t in w],
                        [t.detach().float().requires_grad_() for t in w13],
                        [t.detach().float().requires_grad_() for t in w2], [g.float() for g in d_out])
    assert not torch.equal(grads[0].float(), exact[0])


def test_fp8_backward_order_of_routed_rows():
    """The weight gradients' token-major groups of 128 rows depend on the order of an expert's routed rows (the
    GPU's: rank, window of 32 tokens, slot, token): with more than 128 rows on one expert, another order gives
    other weight gradients, so the GPU tests that compare with this oracle check the order too."""
    g = torch.Generator().manual_seed(5)
    tokens, hidden, inter = 200, 128, 128
    x = [torch.randn(tokens, hidden, generator=g).double()]
    idx = [torch.stack([torch.tensor([0, 1]) if t % 2 else torch.tensor([1, 0]) for t in range(tokens)])]
    w = [torch.rand(tokens, 2, generator=g).double()]
    w13 = [(torch.randn(2, 2 * inter, hidden, generator=g) / hidden ** 0.5).double()]
    w2 = [(torch.randn(2, hidden, inter, generator=g) / inter ** 0.5).double()]
    d_out = [torch.randn(tokens, hidden, generator=g).double()]
    _, _, d_w13, _ = reference.moe_ranks_fp8_backward(x, idx, w, w13, w2, d_out)
    # The same problem with the tokens in reverse order reaches the experts' rows in another order.
    flip = [t.flip(0) for t in x], [t.flip(0) for t in idx], [t.flip(0) for t in w]
    _, _, d_w13_flipped, _ = reference.moe_ranks_fp8_backward(*flip, w13, w2, [t.flip(0) for t in d_out])
    diff = float((d_w13[0] - d_w13_flipped[0]).norm() / d_w13[0].norm())
    assert 0 < diff < 0.05  # other groups of 128, the same gradient up to FP8 rounding


def _fp8_config(cfg):
    return ops.LayerConfig(**{**cfg.__dict__, "precision": ops.precision_from_name("fp8")})


def test_fp8_prequantized_weights_are_the_layers_own_quantization(backend):
    cfg, x, idx, w, w13, w2 = inputs()
    cfg8 = _fp8_config(cfg)
    q13 = [reference.quantize_128x128(t.detach()) for t in w13]
    q2 = [reference.quantize_128x128(t.detach()) for t in w2]
    with torch.no_grad():
        own = ops.moe_ranks(x, idx, w, w13, w2, config=cfg8)
        given = ops.moe_ranks_fp8_weights(x, idx, w, [c for c, _ in q13], [s for _, s in q13], [c for c, _ in q2],
                                          [s for _, s in q2], config=cfg8)
        # uint8 codes are the same bytes
        as_bytes = ops.moe_ranks_fp8_weights(x, idx, w, [c.view(torch.uint8) for c, _ in q13], [s for _, s in q13],
                                             [c.view(torch.uint8) for c, _ in q2], [s for _, s in q2], config=cfg8)
    for a, b, c in zip(own, given, as_bytes):
        assert torch.equal(a, b) and torch.equal(a, c)
    # Weights whose scales are not amax / 448 (a checkpoint's): used as given, not quantized again.
    halved = [s * 2 for _, s in q13]
    with torch.no_grad():
        other = ops.moe_ranks_fp8_weights(x, idx, w, [c for c, _ in q13], halved, [c for c, _ in q2],
                                          [s for _, s in q2], config=cfg8)
    want = reference.moe_ranks_fp8([t.detach().float() for t in x], idx, [t.detach() for t in w],
                                   [reference.dequantize_128x128(c, s) for (c, _), s in zip(q13, halved)],
                                   [reference.dequantize_128x128(c, s) for c, s in q2], weights_quantized=True)
    for got, ref in zip(other, want):
        assert torch.equal(got, ref.bfloat16())
    assert not torch.equal(other[0], own[0])


def test_fp8_prequantized_weights_are_checked(backend):
    cfg, x, idx, w, w13, w2 = inputs()
    cfg8 = _fp8_config(cfg)
    q13 = [reference.quantize_128x128(t.detach()) for t in w13]
    q2 = [reference.quantize_128x128(t.detach()) for t in w2]
    args = [[c for c, _ in q13], [s for _, s in q13], [c for c, _ in q2], [s for _, s in q2]]
    with torch.no_grad():
        with pytest.raises(ValueError, match="precision 'fp8'"):
            ops.moe_ranks_fp8_weights(x, idx, w, *args, config=cfg)
        with pytest.raises(TypeError, match="w13_fp8\\[0\\] must be"):
            ops.moe_ranks_fp8_weights(x, idx, w, [t.detach() for t in w13], *args[1:], config=cfg8)
        with pytest.raises(ValueError, match="w2_scales\\[1\\] must have shape"):
            ops.moe_ranks_fp8_weights(x, idx, w, *args[:3], [args[3][0], args[3][1][:1]], config=cfg8)
        with pytest.raises(ValueError, match="one tensor per rank"):
            ops.moe_ranks_fp8_weights(x, idx, w, args[0][:1], *args[1:], config=cfg8)
    forwards = backend.forwards
    with pytest.raises(NotImplementedError, match="forward only"):
        ops.moe_ranks_fp8_weights(x, idx, w, *args, config=cfg8)  # x requires grad
    assert backend.forwards == forwards


@pytest.mark.parametrize("option", ["fused_forward", "fused_backward", "recompute_h"])
def test_fp8_refuses_what_it_does_not_run_yet(option):
    from megamoe import MegaMoE

    with pytest.raises(ValueError, match="modular paths only"):
        MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16, device="cpu",
                precision="fp8", **{option: True})


def test_unknown_precision_is_refused():
    from megamoe import MegaMoE

    with pytest.raises(ValueError, match=r"precision must be one of \['bf16', 'fp8'\], got 'fp16'"):
        MegaMoE(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16, device="cpu",
                precision="fp16")


def test_weight_gradient_buffers_name_their_fields_by_dtype():
    """The BackwardArgs fields a pair of weight-gradient buffers fills: the fp32 pair d_w13 / d_w2, the bf16 pair
    d_w13_bf16 / d_w2_bf16; a mixed or other pair is refused."""
    a32, b32 = torch.zeros(4), torch.zeros(2)
    a16, b16 = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)
    assert ops._weight_grad_fields(a32, b32) == {"d_w13": a32.data_ptr(), "d_w2": b32.data_ptr()}
    assert ops._weight_grad_fields(a16, b16) == {"d_w13_bf16": a16.data_ptr(), "d_w2_bf16": b16.data_ptr()}
    for pair in ((a32, b16), (a16.half(), b16.half())):
        with pytest.raises(TypeError, match="must both be float32 or both bfloat16"):
            ops._weight_grad_fields(*pair)
