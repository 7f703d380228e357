"""The GPU layer with one rank per process (megamoe_pgroup) over an NCCL group, against the distributed fp32
reference (reference.moe_distributed: all_to_all by destination rank, local grouped MLP, all_to_all back,
weighted combine): out and every gradient within rel err 1e-2, for random routing and masked slots.

test_process_group_spawned: min(4, GPUs) processes (torch.multiprocessing.spawn), needs 2+ GPUs.
test_ranks_with_different_configs_all_fail_naming_the_field, test_release_waits_for_every_rank: two
processes through the C ABI (needs 2 GPUs: NCCL refuses two ranks on one device).
test_process_group_of_one: one rank in this process (world size 1, TCP store on 127.0.0.1): the bootstrap
path end to end on any machine with a GPU, and the result against the virtual-rank layer's."""

import gc
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist

H, I, E, K = 256, 256, 16, 4
MAX_TOKENS = 384
TOL = 1e-2


def _why_not(min_gpus):
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.device_count() < min_gpus:
        return f"needs {min_gpus} GPUs, found {torch.cuda.device_count()}"
    if not (dist.is_available() and dist.is_nccl_available()):
        return "torch.distributed with NCCL is not available"
    try:
        from megamoe import _lib
        if not _lib.built_with_cuda():
            return "libmegamoe was built without CUDA"
        _lib.create_bootstrap_id()  # host only (no CUDA context): tells whether the library has NCCL
    except ImportError as e:
        return str(e)
    except _lib.MegaMoEError as e:
        return f"no process groups in this libmegamoe: {e}"
    return ""


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def global_data(tokens, kind, seed):
    """Every rank's tokens and all E experts, identical in every process (one seed)."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    idx = []
    for t in tokens:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else \
            torch.zeros(0, K, dtype=torch.int64)
        if kind == "masked" and t:
            ids[torch.rand(t, K, generator=g) < 0.4] = -1
        idx.append(ids)
    w = [torch.rand(t, K, generator=g) for t in tokens]
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    d_out = [torch.randn(t, H, generator=g).bfloat16() for t in tokens]
    return x, idx, w, w13, w2, d_out


def forward_backward(fn, x, idx, w, w13, w2, d_out, up):
    leaves = [t.detach().clone().float() if up else t.detach().clone() for t in (x, w, w13, w2)]
    for t in leaves:
        t.requires_grad_()
    out = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    grads = torch.autograd.grad(out, leaves, d_out.float() if up else d_out, allow_unused=True)
    return [out] + [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def compare(got, want, what):
    for name, a, b in zip(("out", "d_x", "d_topk_weights", "d_w13", "d_w2"), got, want):
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if b.numel() and b.norm() > 0:
            assert rel_err(a, b) <= TOL, f"{what} {name}: rel err {rel_err(a, b):.3g}"
        else:
            assert a.numel() == 0 or torch.all(a == 0), f"{what} {name} must be zero"


def settle(group):
    """Every rank's work done before any rank frees a workspace that its peers have mapped."""
    torch.cuda.synchronize()
    dist.barrier(group=group)
    torch.cuda.synchronize()


def check_layer(rank, world, group, device):
    import megamoe
    from megamoe import ops, reference

    per = E // world
    experts = slice(rank * per, (rank + 1) * per)
    cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS, num_ranks=world)
    token_counts = [333, 0, 129, 7][:world] if world > 1 else [333]  # T = 0 on a rank; not tile multiples
    for kind in ("random", "masked"):
        x, idx, w, w13, w2, d_out = global_data(token_counts, kind, seed=world)
        mine = [t.to(device) for t in (x[rank], idx[rank], w[rank], w13[experts].contiguous(),
                                       w2[experts].contiguous(), d_out[rank])]
        key = ops.new_key()
        got = forward_backward(lambda *a: ops.moe(*a, config=cfg, key=key, group=group), *mine[:5], mine[5], False)
        want = forward_backward(lambda *a: reference.moe_distributed(*a, group=group), *mine[:5], mine[5], True)
        compare(got, want, f"rank {rank}, {kind}:")
        ops.synchronize_and_check(cfg, key, device=device, group=group)
        settle(group)
        ops.release(key)

    # The module holds its rank's experts; its forward matches the reference with its weights.
    torch.manual_seed(rank)
    model = megamoe.MegaMoE(H, I, E, K, MAX_TOKENS, group=group, device=device)
    x, idx, w, _, _, d_out = global_data(token_counts, "random", seed=7)
    xr = x[rank].to(device).requires_grad_()
    out = model(xr, idx[rank].to(device), w[rank].to(device))
    out.backward(d_out[rank].to(device))
    want = forward_backward(lambda *a: reference.moe_distributed(*a, group=group), xr, idx[rank].to(device),
                            w[rank].to(device), model.w13, model.w2, d_out[rank].to(device), True)
    compare([out, xr.grad, torch.zeros(0), model.w13.grad, model.w2.grad],
            [want[0], want[1], torch.zeros(0), want[3], want[4]], f"rank {rank}, module:")
    return model


def _spawned(rank, world, store_path):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            device_id=device)
    try:
        from megamoe import ops

        model = check_layer(rank, world, dist.group.WORLD, device)
        settle(dist.group.WORLD)
        del model  # its finalizer releases its key: after the barrier, so no peer still uses the workspace
        gc.collect()
        ops.release_all()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(bool(_why_not(2)), reason=_why_not(2) or "ok")
def test_process_group_spawned():
    world = min(4, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_spawned, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


def _library_group(rank, world, store_path, hidden, timeout=20.0):
    """A library process group made straight through the C ABI (torch's gloo group only carries the
    bootstrap id), with this rank's hidden size."""
    from megamoe import _lib, ops

    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    cfg = _lib.Config(hidden=hidden, intermediate=I, num_experts=E, top_k=K, num_ranks=world,
                      max_tokens_per_rank=MAX_TOKENS)
    options = _lib.default_options()
    options.wait_timeout_seconds = timeout
    return _lib.ProcessRankGroup(cfg, rank, ops.bootstrap_id(dist.group.WORLD), options)


def _spawned_disagreeing(rank, world, store_path):
    from megamoe import _lib

    try:
        with pytest.raises(_lib.MegaMoEError, match=f"disagree on hidden: rank 0 has {H}, rank 1 has {H + 128}"):
            _library_group(rank, world, store_path, H + 128 if rank == 1 else H)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(bool(_why_not(2)), reason=_why_not(2) or "ok")
def test_ranks_with_different_configs_all_fail_naming_the_field():
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_spawned_disagreeing, args=(2, os.path.join(tmp, "store")), nprocs=2, join=True)


def _spawned_release(rank, world, store_path):
    import time

    try:
        group = _library_group(rank, world, store_path, H)
        dist.barrier()
        start = time.monotonic()
        if rank == 1:
            time.sleep(3.0)  # still "working" while rank 0 releases
        group.close()
        waited = time.monotonic() - start
        if rank == 0:
            assert waited >= 2.5, f"rank 0 freed its workspace after {waited:.2f} s, before rank 1 released"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(bool(_why_not(2)), reason=_why_not(2) or "ok")
def test_release_waits_for_every_rank():
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_spawned_release, args=(2, os.path.join(tmp, "store")), nprocs=2, join=True)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(bool(_why_not(1)), reason=_why_not(1) or "ok")
def test_process_group_of_one(monkeypatch):
    from megamoe import ops

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method="env://", rank=0, world_size=1, device_id=device)
    try:
        check_layer(0, 1, dist.group.WORLD, device)
        # One process rank computes what one virtual rank computes (same kernels, same order).
        x, idx, w, w13, w2, _ = global_data([200], "masked", seed=9)
        args = [t.to(device) for t in (x[0], idx[0], w[0], w13, w2)]
        cfg = ops.LayerConfig(H, I, E, K, MAX_TOKENS)
        a = ops.moe(*args, config=cfg, key=ops.new_key(), group=dist.group.WORLD)
        b = ops.moe(*args, config=cfg, key=ops.new_key())
        assert torch.equal(a, b) or rel_err(a, b) <= 1e-3
        gc.collect()
        torch.cuda.synchronize()
    finally:
        ops.release_all()
        dist.destroy_process_group()
