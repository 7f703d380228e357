"""The C ABI's virtual-rank calls check every rank's arguments before anything is enqueued for any rank: a bad
argument of rank 1 must not leave rank 0 waiting at a barrier for it (which would time out and break the
group for good). After the refused call the same group runs a valid call, correct against the fp32
reference, with no error recorded."""


import pytest
import torch
from gpu_support import why_no_gpu

from megamoe import _lib, reference

pytestmark = pytest.mark.skipif(bool(why_no_gpu()), reason=why_no_gpu() or "ok")

H, I, E, K, R, T = 128, 128, 4, 2, 2, 32


def _config():
    return _lib.Config(hidden=H, intermediate=I, num_experts=E, top_k=K, num_ranks=R, max_tokens_per_rank=T)


def _rank_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    w = torch.rand(T, K, generator=g).cuda()
    return x, idx, w


def _forward_args(x, idx, w, w13, w2, out, tokens=T):
    return _lib.ForwardArgs(num_tokens=tokens, x=x.data_ptr(), topk_idx=idx.data_ptr(), topk_idx_is_int32=0,
                            topk_weights=w.data_ptr(), w13=w13.data_ptr(), w2=w2.data_ptr(), out=out.data_ptr())


@pytest.fixture
def group():
    options = _lib.default_options()
    options.wait_timeout_seconds = 1.0  # a rank left waiting would show up as a timeout within a second
    g = _lib.VirtualRankGroup(_config(), options)
    yield g
    g.close()


def _weights():
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16().cuda()
    return w13, w2


def _valid_forward_is_right(group, ranks, w13, w2):
    outs = [torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    per_rank = E // R
    args = [_forward_args(*ranks[r], w13[r * per_rank:(r + 1) * per_rank], w2[r * per_rank:(r + 1) * per_rank],
                          outs[r]) for r in range(R)]
    group.forward(args, torch.cuda.current_stream().cuda_stream)
    group.synchronize_and_check()  # no timeout, no error recorded by the refused call
    for r in range(R):
        x, idx, w = ranks[r]
        want = reference.moe(x.float(), idx, w, w13.float(), w2.float())
        got = outs[r].double()
        assert torch.isfinite(got).all()
        assert float((got - want.double()).norm() / want.double().norm()) <= 1e-2


@pytest.mark.parametrize("breakage", ["too many tokens", "misaligned x", "no w13"])
def test_a_bad_argument_of_a_later_rank_enqueues_nothing(group, breakage):
    w13, w2 = _weights()
    ranks = [_rank_tensors(r) for r in range(R)]
    per_rank = E // R
    outs = [torch.empty(T, H, dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    args = [_forward_args(*ranks[r], w13[r * per_rank:(r + 1) * per_rank], w2[r * per_rank:(r + 1) * per_rank],
                          outs[r]) for r in range(R)]
    if breakage == "too many tokens":
        args[1].num_tokens = T + 1
    elif breakage == "misaligned x":
        args[1].x += 2
    else:
        args[1].w13 = None
    with pytest.raises(_lib.MegaMoEError, match="rank 1: .*nothing enqueued"):
        group.forward(args, torch.cuda.current_stream().cuda_stream)
    _valid_forward_is_right(group, ranks, w13, w2)


def test_a_bad_backward_argument_of_a_later_rank_enqueues_nothing(group):
    w13, w2 = _weights()
    ranks = [_rank_tensors(r) for r in range(R)]
    _valid_forward_is_right(group, ranks, w13, w2)
    per_rank = E // R
    grads = []
    for r in range(R):
        grads.append(dict(d_out=torch.randn(T, H, device="cuda").bfloat16(),
                          d_x=torch.empty(T, H, dtype=torch.bfloat16, device="cuda"),
                          d_w=torch.empty(T, K, device="cuda"),
                          d_w13=torch.empty(per_rank, 2 * I, H, device="cuda"),
                          d_w2=torch.empty(per_rank, H, I, device="cuda")))
    args = [_lib.BackwardArgs(d_out=g["d_out"].data_ptr(), d_x=g["d_x"].data_ptr(), d_topk_weights=g["d_w"].data_ptr(),
                              d_w13=g["d_w13"].data_ptr(), d_w2=g["d_w2"].data_ptr(), accumulate_weight_grads=0)
            for g in grads]
    args[1].d_w2 = None
    with pytest.raises(_lib.MegaMoEError, match="rank 1: .*nothing enqueued"):
        group.backward(args, torch.cuda.current_stream().cuda_stream)
    args[1].d_w2 = grads[1]["d_w2"].data_ptr()
    group.backward(args, torch.cuda.current_stream().cuda_stream)
    group.synchronize_and_check()
    for g in grads:
        assert all(torch.isfinite(t).all() for t in g.values())
