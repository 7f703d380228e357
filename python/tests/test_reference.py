"""CPU checks of megamoe.reference (the oracle) and of the weight converters; no GPU, no libmegamoe."""

import pytest
import torch

from megamoe import reference
from megamoe.module import w1_w3_from_w13, w13_from_w1_w3


def make_inputs(tokens, hidden, inter, experts, top_k, *, dtype=torch.float64, seed=0, mask_every=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    if mask_every:
        idx.view(-1)[::mask_every] = -1
    w = torch.rand(tokens, top_k, generator=g, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=dtype) / inter ** 0.5
    return x, idx, w, w13, w2


def per_token_loop(x, idx, w, w13, w2):
    """The forward of docs/MODEL.md written token by token, slot by slot."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += w[t, j] * (w2[e] @ a)
    return out


@pytest.mark.parametrize("mask_every", [0, 3])
def test_forward_matches_per_token_loop(mask_every):
    x, idx, w, w13, w2 = make_inputs(13, 16, 8, 6, 3, mask_every=mask_every)
    out = reference.moe(x, idx, w, w13, w2)
    torch.testing.assert_close(out, per_token_loop(x, idx, w, w13, w2), rtol=1e-12, atol=1e-12)


def test_int32_ids_and_fp32_give_the_same_result():
    x, idx, w, w13, w2 = make_inputs(9, 16, 8, 4, 2, dtype=torch.float32)
    torch.testing.assert_close(reference.moe(x, idx.int(), w, w13, w2), reference.moe(x, idx, w, w13, w2))


def test_gradients_match_finite_differences():
    x, idx, w, w13, w2 = make_inputs(5, 8, 4, 4, 2, mask_every=4)
    inputs = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    assert torch.autograd.gradcheck(lambda a, b, c, d: reference.moe(a, idx, b, c, d), inputs)


def test_gradients_match_per_token_loop():
    x, idx, w, w13, w2 = make_inputs(7, 16, 8, 5, 3, mask_every=5)
    d_out = torch.randn(7, 16, dtype=torch.float64)
    grads = []
    for fn in (reference.moe, per_token_loop):
        inputs = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
        out = fn(inputs[0], idx, inputs[1], inputs[2], inputs[3])
        grads.append(torch.autograd.grad(out, inputs, d_out))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Masked slots get a zero routing-weight gradient.
    assert torch.all(grads[0][1][idx < 0] == 0)


def adversarial_routings(tokens, experts, top_k):
    g = torch.Generator().manual_seed(1)
    yield "all to expert 0 and 1", torch.tensor([[0, 1][: top_k]] * tokens)
    yield "all masked", torch.full((tokens, top_k), -1)
    yield "empty experts", torch.randint(0, 2, (tokens, top_k), generator=g) * (experts - 1)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_virtual_ranks_equal_the_single_layer(ranks):
    experts = 8
    tokens = [5, 0, 7, 3][:ranks]  # T = 0 on one rank
    x, idx, w, w13, w2 = make_inputs(sum(tokens), 16, 8, experts, 2)
    single = reference.moe(x, idx, w, w13, w2)
    per = experts // ranks
    outs = reference.moe_ranks(list(torch.split(x, tokens)), list(torch.split(idx, tokens)),
                               list(torch.split(w, tokens)), [w13[r * per:(r + 1) * per] for r in range(ranks)],
                               [w2[r * per:(r + 1) * per] for r in range(ranks)])
    assert [o.shape[0] for o in outs] == tokens
    torch.testing.assert_close(torch.cat(outs), single, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", range(3))
def test_adversarial_routing_matches_loop(case):
    x, _, w, w13, w2 = make_inputs(6, 16, 8, 4, 2)
    name, idx = list(adversarial_routings(6, 4, 2))[case]
    torch.testing.assert_close(reference.moe(x, idx, w, w13, w2), per_token_loop(x, idx, w, w13, w2),
                               rtol=1e-12, atol=1e-12, msg=name)


def test_out_of_range_ids_raise():
    x, idx, w, w13, w2 = make_inputs(4, 16, 8, 4, 2)
    idx[2, 1] = 4
    with pytest.raises(ValueError, match="expert id 4"):
        reference.moe(x, idx, w, w13, w2)
    idx[2, 1] = -2
    with pytest.raises(ValueError, match="expert id -2"):
        reference.moe(x, idx, w, w13, w2)


def test_bf16_input_keeps_dtype():
    x, idx, w, w13, w2 = make_inputs(8, 16, 8, 4, 2, dtype=torch.float32)
    out = reference.moe(x.bfloat16(), idx, w, w13.bfloat16(), w2.bfloat16())
    assert out.dtype == torch.bfloat16
    want = reference.moe(x.bfloat16().float(), idx, w, w13.bfloat16().float(), w2.bfloat16().float())
    assert (out.float() - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converters_round_trip_exactly(dtype):
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(3, 8, 16, generator=g).to(dtype)
    w3 = torch.randn(3, 8, 16, generator=g).to(dtype)
    w13 = w13_from_w1_w3(w1, w3)
    assert w13.shape == (3, 16, 16) and w13.is_contiguous()
    assert torch.equal(w13[:, :8], w1) and torch.equal(w13[:, 8:], w3)
    back1, back3 = w1_w3_from_w13(w13)
    assert torch.equal(back1, w1) and torch.equal(back3, w3)
    assert back1.is_contiguous() and back3.is_contiguous()
    assert torch.equal(w13_from_w1_w3(back1, back3), w13)


def test_converted_weights_compute_torchtitans_mlp():
    # torchtitan's expert MLP: w2 @ (silu(w1 @ x) * (w3 @ x)), with w1, w3 [E, I, H] and w2 [E, H, I].
    x, idx, w, _, w2 = make_inputs(6, 16, 8, 3, 2)
    g = torch.Generator().manual_seed(3)
    w1 = torch.randn(3, 8, 16, generator=g, dtype=torch.float64)
    w3 = torch.randn(3, 8, 16, generator=g, dtype=torch.float64)
    want = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            e = int(idx[t, j])
            want[t] += w[t, j] * (w2[e] @ (torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    torch.testing.assert_close(reference.moe(x, idx, w, w13_from_w1_w3(w1, w3), w2), want)


def test_converters_reject_bad_shapes():
    with pytest.raises(ValueError):
        w13_from_w1_w3(torch.zeros(2, 4, 8), torch.zeros(2, 5, 8))
    with pytest.raises(ValueError):
        w1_w3_from_w13(torch.zeros(2, 5, 8))


# ---- blockwise FP8 (docs/FP8.md) ----

def _e4m3_exact(v):
    """Whether every value of v is an E4M3 value up to the fp32 rounding of value * scale / scale (E4M3
    neighbours lie at least 1/16 apart relatively, so 1e-6 cannot accept another code)."""
    return torch.allclose(v.to(torch.float8_e4m3fn).float(), v, rtol=1e-6, atol=0.0)


def test_fp8_rounding_is_to_nearest_even_with_the_group_scale():
    row = torch.zeros(1, 256)
    row[0, :4] = torch.tensor([448.0, 1.0625, 1.1875, -3.0])  # amax 448: scale 1; two midpoints of the 1/8 grid
    row[0, 128:131] = torch.tensor([4.48, 0.0123, -1e-9])       # amax 4.48: scale 0.01
    q = reference.fake_quantize_1x128(row)
    assert q[0, :4].tolist() == [448.0, 1.0, 1.25, -3.0]
    scaled = q[0, 128:] / torch.tensor(4.48 / 448.0)
    assert _e4m3_exact(scaled) and abs(float(q[0, 128]) - 4.48) < 1e-6
    assert float(q[0, 130]) == 0.0  # below half the smallest subnormal of the group's grid
    assert torch.equal(reference.fake_quantize_1x128(torch.zeros(2, 128)), torch.zeros(2, 128))


def test_fp8_special_values_follow_the_rules():
    nan_row = torch.ones(1, 128)
    nan_row[0, 5] = float("nan")
    q = reference.fake_quantize_1x128(nan_row)
    assert torch.isnan(q[0, 5]) and torch.equal(q[0, :5], torch.ones(5))  # NaN ignored by the scale, stays NaN
    inf_row = torch.ones(1, 256)
    inf_row[0, 7] = float("inf")
    q = reference.fake_quantize_1x128(inf_row)
    assert torch.isnan(q[0, :128]).all(), "an infinite element makes its whole group NaN"
    assert torch.equal(q[0, 128:], torch.ones(128)), "the next group is its own"


def test_fp8_token_major_groups_take_power_of_two_scales():
    """The weight gradients' token-major groups: the smallest power of two 2^k (k >= -126) with 448 2^k >= amax,
    written out from its definition, and every group's values E4M3 codes times it."""
    import math
    g = torch.Generator().manual_seed(9)
    amax = torch.cat([torch.tensor([0.0, 448.0, 449.0, 224.0, 3.0, 1e-45, 3.4e38, float("inf")]),
                      torch.exp2(torch.rand(2000, generator=g) * 200.0 - 100.0)])
    got = reference._power_of_two_scale(amax.float())
    for a, s in zip(amax.float().tolist(), got.tolist()):
        if a == 0.0:
            want = 1.0
        elif math.isinf(a):
            want = a
        else:
            k = -126
            while 448.0 * math.ldexp(1.0, k) < a:
                k += 1
            want = math.ldexp(1.0, k)
        assert s == want, (a, s, want)
    rows = torch.randn(300, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (1, 256), generator=g).float())
    q = reference._fake_quantize_token_major(rows)
    for begin in (0, 128, 256):
        group = rows[begin:begin + 128]
        scale = reference._power_of_two_scale(group.abs().amax(dim=0, keepdim=True))
        assert torch.equal(q[begin:begin + 128], (group / scale).to(torch.float8_e4m3fn).float() * scale)


def test_fp8_weight_blocks_are_independent():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 256, 384, generator=g)
    q = reference.fake_quantize_128x128(w)
    louder = w.clone()
    louder[1, 128:, 256:] *= 1024.0  # one block of the second matrix
    q2 = reference.fake_quantize_128x128(louder)
    changed = torch.zeros_like(w, dtype=torch.bool)
    changed[1, 128:, 256:] = True
    assert torch.equal(q[~changed], q2[~changed])
    assert torch.equal(q2[changed], q[changed] * 1024.0)  # a power of two scales codes and scale alike
    for m in range(2):
        for r in range(0, 256, 128):
            for c in range(0, 384, 128):
                block = q[m, r:r + 128, c:c + 128]
                scale = w[m, r:r + 128, c:c + 128].abs().amax() / 448.0
                assert _e4m3_exact(block / scale)
    with pytest.raises(ValueError, match="multiples of 128"):
        reference.fake_quantize_128x128(torch.zeros(100, 128))


def per_token_loop_fp8(x, idx, w, w13, w2):
    """The FP8 forward of docs/FP8.md token by token, slot by slot (fp32)."""
    inter = w13.shape[1] // 2
    xq = reference.fake_quantize_1x128(x)
    w13q, w2q = reference.fake_quantize_128x128(w13), reference.fake_quantize_128x128(w2)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = w13q[e] @ xq[t]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += w[t, j].float() * (w2q[e] @ reference.fake_quantize_1x128(a[None])[0])
    return out


@pytest.mark.parametrize("mask_every", [0, 3])
def test_fp8_forward_matches_per_token_loop(mask_every):
    x, idx, w, w13, w2 = make_inputs(21, 256, 128, 5, 2, dtype=torch.float32, mask_every=mask_every)
    out = reference.moe_fp8(x, idx, w, w13, w2)
    want = per_token_loop_fp8(x, idx, w, w13, w2)
    # Only the fp32 summation order differs (which may move an element of a to its other E4M3 neighbour).
    assert float((out - want).norm() / want.norm()) < 1e-4
    exact = reference.moe(x.double(), idx, w.double(), w13.double(), w2.double())
    distance = float((out.double() - exact).norm() / exact.norm())
    assert 1e-3 < distance < 0.1, f"FP8 against the exact layer: {distance}"
    parts = reference.moe_ranks_fp8(list(x.split([10, 11])), list(idx.split([10, 11])), list(w.split([10, 11])),
                                    list(w13.split([3, 2])), list(w2.split([3, 2])))
    assert torch.equal(torch.cat(parts), out)
