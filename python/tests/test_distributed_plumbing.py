"""The process-group path on the CPU: two processes on a gloo group check reference.moe_distributed against the
single-process reference, and the process ops' torch plumbing (group by name, autograd, fake impls, input
checks, the collective "latest forward" rule, the bootstrap broadcast) with the library swapped for a backend
that computes with reference.moe_distributed. The GPU layer over NCCL: test_distributed_gpu.py."""

import concurrent.futures
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

WORLD = 2
H, I, E, K = 128, 128, 8, 2
MAX_TOKENS = 16

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


class DistributedReferenceBackend:
    """Stands in for libmegamoe's process groups: the reference over the group, keeping the latest forward's
    inputs for the backward as the library keeps its routing."""

    def __init__(self):
        self.forwards = 0
        self.latest = None

    def supports(self, device):
        return True

    def process_forward(self, state, name, x, idx, w, w13, w2, out):
        from megamoe import ops, reference

        self.forwards += 1
        group = ops._resolve_group(name)
        assert group.size() == state.config.num_ranks
        self.latest = (x.float(), idx, w.float(), w13.float(), w2.float(), group)
        out.copy_(reference.moe_distributed(*self.latest[:5], group=group))

    def process_backward(self, state, name, d_out, d_x, d_w, d_w13, d_w2, accumulate=False):
        from megamoe import reference

        def grads():
            x, idx, w, w13, w2, group = self.latest
            leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
            out = reference.moe_distributed(leaves[0], idx, leaves[1], leaves[2], leaves[3], group=group)
            return torch.autograd.grad(out, leaves, d_out.float(), allow_unused=True)

        # An op implementation runs below the autograd dispatch keys (thread-local): use a fresh thread.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            result = pool.submit(grads).result()
        for k, (dst, src) in enumerate(zip((d_x, d_w, d_w13, d_w2), result)):
            value = torch.zeros_like(dst) if src is None else src
            if accumulate and k >= 2:  # the weight gradients, as the library's accumulate_weight_grads
                dst.add_(value)
            else:
                dst.copy_(value)

    def process_synchronize_and_check(self, state, name, device):
        pass


def global_data(tokens, seed, masked=False):
    """Every rank's inputs (the same on every process: one seed), and the experts of all ranks."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    idx = []
    for t in tokens:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else \
            torch.zeros(0, K, dtype=torch.int64)
        if masked and t:
            ids[torch.rand(t, K, generator=g) < 0.4] = -1
        idx.append(ids)
    w = [torch.rand(t, K, generator=g) for t in tokens]
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    d_out = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    return x, idx, w, w13, w2, d_out


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0 or want.norm() == 0:
        return float(got.abs().max()) if got.numel() else 0.0
    return float((got - want).norm() / want.norm())


def _check_reference(rank, group):
    """reference.moe_distributed (fp64) equals this rank's slice of the single-process reference."""
    from megamoe import reference

    per = E // WORLD
    for tokens, masked in (([7, 5], False), ([6, 0], True), ([0, 3], False)):
        x, idx, w, w13, w2, d_out = global_data(tokens, seed=sum(tokens), masked=masked)
        full = [t.double().requires_grad_() for t in (torch.cat(x), torch.cat(w), w13, w2)]
        out = reference.moe(full[0], torch.cat(idx), full[1], full[2], full[3])
        want_g = torch.autograd.grad(out, full, torch.cat(d_out).double())
        start = sum(tokens[:rank])
        rows = slice(start, start + tokens[rank])
        experts = slice(rank * per, (rank + 1) * per)
        mine = [t.double().requires_grad_() for t in (x[rank], w[rank], w13[experts], w2[experts])]
        got = reference.moe_distributed(mine[0], idx[rank], mine[1], mine[2], mine[3], group=group)
        got_g = torch.autograd.grad(got, mine, d_out[rank].double(), allow_unused=True)
        got_g = [torch.zeros_like(t) if g is None else g for g, t in zip(got_g, mine)]
        assert rel_err(got, out[rows]) < 1e-12
        for name, a, b in zip(("d_x", "d_w", "d_w13", "d_w2"), got_g,
                              (want_g[0][rows], want_g[1][rows], want_g[2][experts], want_g[3][experts])):
            assert rel_err(a, b) < 1e-12, (name, tokens, rel_err(a, b))


def _check_ops(rank, group):
    import megamoe
    from megamoe import ops, reference

    backend = DistributedReferenceBackend()
    ops._backend = backend
    per = E // WORLD
    experts = slice(rank * per, (rank + 1) * per)
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=WORLD)

    # The op against the reference, gradients included; rank 1 has no tokens.
    x, idx, w, w13, w2, d_out = global_data([9, 0], seed=3, masked=True)
    leaves = [t.clone().requires_grad_() for t in (x[rank], w[rank], w13[experts].contiguous(),
                                                   w2[experts].contiguous())]
    out = ops.moe(leaves[0], idx[rank], leaves[1], leaves[2], leaves[3], config=cfg, key=ops.new_key(), group=group)
    assert out.dtype == torch.bfloat16 and out.shape == x[rank].shape
    grads = torch.autograd.grad(out, leaves, d_out[rank])
    assert [g.dtype for g in grads] == [t.dtype for t in leaves]
    up = [t.detach().float().requires_grad_() for t in leaves]
    want = reference.moe_distributed(up[0], idx[rank], up[1], up[2], up[3], group=group)
    want_g = torch.autograd.grad(want, up, d_out[rank].float(), allow_unused=True)
    assert rel_err(out, want) <= 1e-2
    for g, wg, t in zip(grads, want_g, up):
        assert rel_err(g, torch.zeros_like(t) if wg is None else wg) <= 1e-2

    # The backward of an older forward re-runs it on every rank, the rank without tokens included (its
    # zero-row tensors all have data pointer 0).
    key = ops.new_key()
    a = ops.moe(leaves[0], idx[rank], leaves[1], leaves[2], leaves[3], config=cfg, key=key, group=group)
    x2, idx2, w_2, _, _, _ = global_data([4, 0], seed=4)
    x2r = x2[rank].clone().requires_grad_()
    b = ops.moe(x2r, idx2[rank], w_2[rank], leaves[2], leaves[3], config=cfg, key=key, group=group)
    before = backend.forwards
    torch.autograd.grad(a, leaves[0], torch.ones_like(a), retain_graph=True)
    assert backend.forwards == before + 1
    torch.autograd.grad(b, x2r, torch.ones_like(b))
    assert backend.forwards == before + 2
    counts = [None] * WORLD
    dist.all_gather_object(counts, backend.forwards, group=group)
    assert len(set(counts)) == 1, counts

    # The module holds this rank's experts and names them.
    torch.manual_seed(rank)
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, group=group)
    assert model.w13.shape == (per, 2 * I, H) and model.w2.shape == (per, H, I)
    assert model.first_expert == rank * per and f"experts=[{rank * per}, {(rank + 1) * per})" in repr(model)
    out = model(x[rank], idx[rank], w[rank])
    want = reference.moe_distributed(x[rank].float(), idx[rank], w[rank], model.w13.float(), model.w2.float(),
                                     group=group)
    assert rel_err(out, want) <= 1e-2
    out.float().sum().backward()
    assert model.w13.grad is not None and model.w13.grad.shape == model.w13.shape

    # Input checks: the same as the virtual-rank ops', with the local expert count.
    with pytest.raises(ValueError, match="w13 must have shape \\[4, 256, 128\\]"):
        ops.moe(x[rank], idx[rank], w[rank], w13, w2[experts].contiguous(), config=cfg, group=group)
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        ops.moe(x[rank].float(), idx[rank], w[rank], leaves[2], leaves[3], config=cfg, group=group)
    with pytest.raises(ValueError, match="num_ranks=1 but the process group has 2 ranks"):
        ops.moe(x[rank], idx[rank], w[rank], leaves[2], leaves[3],
                config=ops.LayerConfig(H, I, E, K, MAX_TOKENS), group=group)
    with pytest.raises(ValueError, match="exclude each other"):
        megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, virtual_ranks=2, group=group)
    with pytest.raises(TypeError, match="must be a torch.distributed ProcessGroup"):
        ops.moe(x[rank], idx[rank], w[rank], leaves[2], leaves[3], config=cfg, group="not a group")

    # Fake tensors: shapes without running anything.
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = [t.detach() for t in (x[0], idx[0], w[0], leaves[2], leaves[3])]
    with FakeTensorMode() as mode:
        fx, fi, fw, fa, fb = (mode.from_tensor(t) for t in real)
        fo = torch.ops.megamoe.moe_process_forward(ops.new_key(), cfg.as_list(), ops.group_name(group), fx, fi, fw,
                                                   fa, fb)
        assert fo.shape == x[0].shape and fo.dtype == torch.bfloat16
        grads = torch.ops.megamoe.moe_process_backward(ops.new_key(), cfg.as_list(), ops.group_name(group), fx, fx,
                                                       fi, fw, fa, fb)
        # A bf16 layer's weight gradients come in bf16, straight from the GEMMs.
        assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    assert backend.forwards == before + 3  # only the module's forward ran since: checks fail before running

    # main_grad: two backwards add their fp32 gradients to this rank's main gradients; no .grad.
    torch.manual_seed(rank)
    accumulating = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, group=group, main_grad=True)
    separate = []
    for seed in (5, 6):
        xs, ids, ws, _, _, ds = global_data([5, 3], seed=seed)
        accumulating(xs[rank], ids[rank], ws[rank]).backward(ds[rank])
        assert accumulating.w13.grad is None and accumulating.w2.grad is None
        # The same micro-batch's fp32 gradients on their own, added to zeroed fp32 buffers.
        alone = (torch.zeros_like(accumulating.w13, dtype=torch.float32),
                 torch.zeros_like(accumulating.w2, dtype=torch.float32))
        torch.ops.megamoe.moe_process_backward_into_main_grads(
            accumulating._key, cfg.as_list(), ops.group_name(group), ds[rank], xs[rank], ids[rank], ws[rank],
            accumulating.w13.detach(), accumulating.w2.detach(), *alone)
        separate.append(alone)
    assert torch.equal(accumulating.w13.main_grad, separate[0][0] + separate[1][0])
    assert torch.equal(accumulating.w2.main_grad, separate[0][1] + separate[1][1])
    # Both forwards first, then both backwards: the main gradients are added to, not saved for the backward.
    accumulating.w13.main_grad.zero_()
    accumulating.w2.main_grad.zero_()
    outs = []
    for seed in (5, 6):
        xs, ids, ws, _, _, ds = global_data([5, 3], seed=seed)
        outs.append((accumulating(xs[rank], ids[rank], ws[rank]), ds[rank]))
    torch.autograd.backward([o for o, _ in outs], [d for _, d in outs])
    torch.testing.assert_close(accumulating.w13.main_grad, separate[0][0] + separate[1][0])
    torch.testing.assert_close(accumulating.w2.main_grad, separate[0][1] + separate[1][1])

    ops._backend = ops._LibraryBackend()


def _check_bootstrap(rank, group):
    """The bootstrap id of rank 0 reaches every rank, or rank 0's failure does."""
    from megamoe import _lib, ops

    try:
        _lib.lib()
    except ImportError:
        return
    try:
        got = ops.bootstrap_id(group)
    except _lib.MegaMoEError as e:
        assert "rank 0 of the group could not create an id" in str(e)
        got = None
    ids = [None] * WORLD
    dist.all_gather_object(ids, got, group=group)
    assert ids[0] == ids[1]
    assert got is None or (isinstance(got, bytes) and len(got) == _lib.BOOTSTRAP_ID_BYTES)


def _worker(rank, store_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD)))  # not the default group: found by its name all the same
        _check_reference(rank, group)
        _check_ops(rank, group)
        _check_bootstrap(rank, group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_process_ops_over_gloo():
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(os.path.join(tmp, "store"),), nprocs=WORLD, join=True)
