"""The MoE layer in plain PyTorch (docs/MODEL.md): the test oracle (at fp32 or fp64) and the
baseline of the benchmark (bf16 on CUDA, where it uses torch._grouped_mm).

Steps: permute the routed (token, slot) pairs into expert-major order, GEMM1 (gate+up), SwiGLU, GEMM2
(down), weighted combine with index_add. Gradients come from autograd.

Virtual ranks: rank r holds tokens xs[r] and the experts [r*E_local, (r+1)*E_local). Dispatch and combine
only move rows, so the multi-rank layer equals one layer over all ranks' tokens and all experts; the
reference computes exactly that and splits the result, which keeps it free of any communication code.

FP8 (moe_fp8, moe_ranks_fp8): the blockwise FP8 forward (docs/FP8.md), the same steps with x, W13, a and W2
rounded to E4M3 through their scales at the points where the GPU layer quantizes them;
moe_ranks_fp8_backward: its backward, with the backward's own quantization points (not autograd).

Process ranks (moe_distributed): each process holds its tokens and its E/R experts, as the GPU layer's
process groups do, so the reference has to communicate: the routed (token, slot) rows go to the rank of
their expert with an all_to_all, that rank runs its local grouped MLP, the results come back with the
inverse all_to_all and are combined with the weights. Autograd runs through both all_to_alls (the
gradient of an all_to_all is the all_to_all with the split sizes swapped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["moe", "moe_ranks", "moe_distributed", "check_ids", "fake_quantize_1x128", "fake_quantize_128x128",
           "quantize_128x128", "dequantize_128x128", "moe_fp8", "moe_ranks_fp8", "moe_ranks_fp8_backward"]


def check_ids(topk_idx: torch.Tensor, num_experts: int, what: str = "topk_idx") -> None:
    """Raises ValueError when an id is neither -1 (masked) nor in [0, num_experts). Syncs the host."""
    if topk_idx.numel() == 0:
        return
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        value = int(topk_idx[bad][0])
        raise ValueError(f"{what} holds expert id {value}, outside [0, {num_experts}) and not -1 (masked)")


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _expert_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [M, in] in expert-major order (counts[e] rows for expert e) times weight[e]^T ([E, out, in])."""
    if _use_grouped_mm(rows, weight) and rows.shape[0] > 0:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    pieces = [chunk @ weight[e].transpose(0, 1) for e, chunk in enumerate(torch.split(rows, counts.tolist()))]
    return torch.cat(pieces) if pieces else rows.new_zeros(0, weight.shape[1])


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
        w2: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """One rank holding every expert: x [T, H], topk_idx [T, K] (-1 = masked), topk_weights [T, K],
    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] -> out [T, H] in x's dtype.

    The combine accumulates in fp32 whatever the input dtype, as the GPU layer does."""
    return _moe(x, topk_idx, topk_weights, w13, w2, check=check).to(x.dtype)


def _moe(x, topk_idx, topk_weights, w13, w2, *, check: bool, round_a=None) -> torch.Tensor:
    """moe's steps, out in the accumulation dtype (fp64 for fp64 x, else fp32); round_a, if given, rounds a
    before GEMM2 (the FP8 layer's point F5)."""
    num_tokens, top_k = topk_idx.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if check:
        check_ids(topk_idx, num_experts)

    expert = topk_idx.reshape(-1).long()
    routed = expert >= 0
    token = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    # Permute: stable sort by expert, masked slots (key E) last and then dropped.
    order = torch.argsort(torch.where(routed, expert, num_experts), stable=True)
    counts = torch.bincount(expert[routed], minlength=num_experts)
    order = order[: int(counts.sum())]
    rows_token = token[order]

    h = _expert_matmul(x[rows_token], w13, counts)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = _expert_matmul(a if round_a is None else round_a(a), w2, counts)

    weights = topk_weights.reshape(-1)[order]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(num_tokens, hidden, dtype=acc, device=x.device)
    return out.index_add(0, rows_token, y.to(acc) * weights.to(acc).unsqueeze(1))


def moe_ranks(xs: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
              w13: list[torch.Tensor], w2: list[torch.Tensor], *, check: bool = True) -> list[torch.Tensor]:
    """R virtual ranks as lists of per-rank tensors (the shapes of docs/MODEL.md; ids are global, expert e
    lives on rank e // E_local). Returns every rank's out; autograd reaches every rank's inputs."""
    num_ranks = len(xs)
    if not (len(topk_idx) == len(topk_weights) == len(w13) == len(w2) == num_ranks) or num_ranks == 0:
        raise ValueError("moe_ranks needs one tensor per rank in every list, and at least one rank")
    out = moe(torch.cat(xs), torch.cat(topk_idx), torch.cat(topk_weights), torch.cat(w13), torch.cat(w2),
              check=check)
    return list(torch.split(out, [x.shape[0] for x in xs]))


# ---- blockwise FP8 (docs/FP8.md: the scale and rounding rules of include/megamoe/fp8.hpp) ----

_E4M3_MAX = 448.0


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp8.hpp's power_of_two_scale_from_amax of fp32 amax (never NaN here): the smallest 2^k, k >= -126, with
    448 2^k >= amax, from the bits of amax; 1 for 0, +inf for +inf."""
    bits = amax.view(torch.int32)
    k = torch.clamp((bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32), min=-126)
    scale = ((k + 127) << 23).view(torch.float32)
    return torch.where(amax > 0, torch.where(torch.isinf(amax), amax, scale), torch.ones_like(amax))


def _quantize_groups(groups: torch.Tensor, dims, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [..., g] (g elements sharing one scale along dims) -> (E4M3 codes, fp32 scales, dims kept).
    Scale amax / 448, or with power_of_two the smallest power of two at least that (NaN ignored, an all-zero or
    all-NaN group 1); e4m3(v / scale) rounds to nearest even and saturates finite values at +-448; an infinite
    element makes the scale infinite (the group dequantizes to NaN); NaN stays NaN."""
    v = groups.float()
    magnitude = v.abs()
    amax = torch.where(torch.isnan(magnitude), 0.0, magnitude).amax(dim=dims, keepdim=True)
    if power_of_two:
        scale = _power_of_two_scale(amax)
    else:
        # A tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal, which is off
        # by an ulp in about half the groups and then breaks v / scale's exact E4M3 ties (frequent on bf16 data)
        # the other way: 1.2% on a layer's output (docs/PERF.md run 45). fp8.hpp's rule is one IEEE division.
        scale = torch.where(amax > 0, amax / torch.full_like(amax, _E4M3_MAX), torch.ones_like(amax))
    return torch.clamp(v / scale, -_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn), scale


def _fake_quantize_groups(groups: torch.Tensor, dims, power_of_two: bool = False) -> torch.Tensor:
    """groups [..., g] -> their E4M3 values times their scale (_quantize_groups), fp32; float64 input gets them
    as float64 (exactly), so that a float64 reference keeps its GEMMs in float64."""
    q, scale = _quantize_groups(groups, dims, power_of_two)
    return (q.float() * scale).to(torch.promote_types(groups.dtype, torch.float32))


def fake_quantize_1x128(t: torch.Tensor) -> torch.Tensor:
    """t [..., K] (K a multiple of 128), one scale per 128 consecutive elements of a row -> fp32 values."""
    k = t.shape[-1]
    if k % 128:
        raise ValueError(f"1 x 128 groups need the last dimension to be a multiple of 128, got {k}")
    return _fake_quantize_groups(t.reshape(*t.shape[:-1], k // 128, 128), (-1,)).reshape(t.shape)


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (N and K multiples of 128) -> (codes [..., N, K] torch.float8_e4m3fn, scales
    [..., N / 128, K / 128] fp32): the layout the layer's pre-quantized FP8 weights take (ops.moe_ranks_fp8_weights),
    DeepSeek-V3's checkpoint format (its `weight_scale_inv` is this scale)."""
    n, k = w.shape[-2:]
    if n % 128 or k % 128:
        raise ValueError(f"128 x 128 blocks need both matrix dimensions to be multiples of 128, got {n} x {k}")
    codes, scales = _quantize_groups(w.reshape(*w.shape[:-2], n // 128, 128, k // 128, 128), (-3, -1))
    return codes.reshape(w.shape), scales.reshape(*w.shape[:-2], n // 128, k // 128)


def dequantize_128x128(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values of 128 x 128-block FP8 weights: codes [..., N, K], scales [..., N / 128, K / 128]."""
    n, k = codes.shape[-2:]
    blocks = codes.view(torch.float8_e4m3fn).float().reshape(*codes.shape[:-2], n // 128, 128, k // 128, 128)
    return (blocks * scales.float().reshape(*codes.shape[:-2], n // 128, 1, k // 128, 1)).reshape(codes.shape)


def fake_quantize_128x128(w: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] (N and K multiples of 128), one scale per 128 x 128 block of each matrix -> fp32 values
    (float64 for float64 w, exactly the same values)."""
    return dequantize_128x128(*quantize_128x128(w)).to(torch.promote_types(w.dtype, torch.float32))


def moe_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, *, check: bool = True, weights_quantized: bool = False) -> torch.Tensor:
    """The blockwise FP8 forward of one rank holding every expert (docs/FP8.md F1-F8): x per token and a per
    routed row in 1 x 128 groups, W13 and W2 in 128 x 128 blocks, the GEMMs and the SwiGLU in fp32, the
    combine in fp32; out in x's dtype. The GPU also rounds y to bf16 before the combine.

    float64 x (and weights) run the GEMMs in float64: the oracle for the GPU layer. In fp32 the GEMMs may run
    in a reduced-precision mode (TF32 on CUDA where allowed), and the quantization of a after them amplifies
    that: such a reference was 1.1% away from the float64 one at H = I = 256 (docs/PERF.md run 43).

    weights_quantized: w13 and w2 are already the values of FP8 weights (dequantize_128x128), used as they are."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    round_w = (lambda w: w) if weights_quantized else fake_quantize_128x128
    return _moe(fake_quantize_1x128(x), topk_idx, topk_weights.to(acc), round_w(w13).to(acc), round_w(w2).to(acc),
                check=check, round_a=fake_quantize_1x128).to(x.dtype)


def moe_ranks_fp8(xs: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
                  w13: list[torch.Tensor], w2: list[torch.Tensor], *, check: bool = True,
                  weights_quantized: bool = False) -> list[torch.Tensor]:
    """moe_fp8 over R virtual ranks (as moe_ranks: one layer over all ranks' tokens and experts)."""
    if not (len(xs) == len(topk_idx) == len(topk_weights) == len(w13) == len(w2)) or not xs:
        raise ValueError("moe_ranks_fp8 needs one tensor per rank in every list, and at least one rank")
    out = moe_fp8(torch.cat(xs), torch.cat(topk_idx), torch.cat(topk_weights), torch.cat(w13), torch.cat(w2),
                  check=check, weights_quantized=weights_quantized)
    return list(torch.split(out, [x.shape[0] for x in xs]))


_ROUTING_WINDOW = 32  # the GPU layout numbers a rank's routed rows per window of 32 tokens (docs/FP8.md)


def _fake_quantize_token_major(rows: torch.Tensor) -> torch.Tensor:
    """rows [n, C] (one expert's routed rows in order) -> the values of its token-major FP8 copy: one
    power-of-two scale per channel and group of 128 consecutive rows, the last group partial (zero padding
    leaves amax alone)."""
    n, c = rows.shape
    padded = torch.cat([rows, rows.new_zeros((-n) % 128, c)]) if n % 128 else rows
    return _fake_quantize_groups(padded.reshape(-1, 128, c), (-2,), power_of_two=True).reshape(-1, c)[:n]


def moe_ranks_fp8_backward(xs: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
                           w13: list[torch.Tensor], w2: list[torch.Tensor], d_out: list[torch.Tensor]
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The blockwise FP8 backward over R virtual ranks (docs/FP8.md; the CPU reference's points B1-B9 of
    src/reference/fp8_reference_layer.cpp): d_x, d_topk_weights, d_w13 and d_w2 per rank, in the inputs' float
    dtype (pass float64: the oracle of the GPU layer). Not the autograd of moe_fp8: the FP8 backward quantizes
    d_out per token, dh per row, and the weight gradients' operands along the routed rows.

    Per routed row of expert e (the forward recomputed): g = q(dOut_t) W2q[e]; d_topk_weights = <g, a> (a the
    unquantized activation); dh = SwiGLU'(w g); d_x_t += q(dh) W13q[e]. Per expert, its rows in the GPU's
    order (source rank, windows of 32 tokens, slot, token): dW2 = T(w q(dOut))^T T(a), dW13 = T(dh)^T T(q(x)),
    T(.) the token-major quantization in groups of 128 rows from the expert's first row."""
    ranks = len(xs)
    if not (len(topk_idx) == len(topk_weights) == len(w13) == len(w2) == len(d_out) == ranks) or ranks == 0:
        raise ValueError("moe_ranks_fp8_backward needs one tensor per rank in every list, and at least one rank")
    acc = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    per_rank = w13[0].shape[0]
    w13q = fake_quantize_128x128(torch.cat(w13)).to(acc)
    w2q = fake_quantize_128x128(torch.cat(w2)).to(acc)
    inter = w13q.shape[1] // 2
    xq = [fake_quantize_1x128(x).to(acc) for x in xs]
    doutq = [fake_quantize_1x128(d).to(acc) for d in d_out]
    d_x = [torch.zeros_like(x, dtype=acc) for x in xs]
    d_w = [torch.zeros_like(w, dtype=acc) for w in topk_weights]
    d_w13 = torch.zeros_like(w13q)
    d_w2 = torch.zeros_like(w2q)
    for e in range(w13q.shape[0]):
        rows = []  # (rank, token, slot) in the GPU's order
        for r in range(ranks):
            if topk_idx[r].numel() == 0:
                continue
            token, slot = (topk_idx[r] == e).nonzero(as_tuple=True)
            key = (token // _ROUTING_WINDOW) * (topk_idx[r].shape[1] * xs[r].shape[0]) + slot * xs[r].shape[0] + token
            order = torch.argsort(key)
            rows += [(r, token[order], slot[order])]
        if sum(len(t) for _, t, _ in rows) == 0:
            continue
        xs_e = torch.cat([xq[r][t] for r, t, _ in rows])
        dout_e = torch.cat([doutq[r][t] for r, t, _ in rows])
        w_e = torch.cat([topk_weights[r][t, j].to(acc) for r, t, j in rows]).unsqueeze(1)
        h = xs_e @ w13q[e].T
        gate, up = h[:, :inter], h[:, inter:]
        a = (F.silu(gate) * up).float().to(acc)  # the GPU's a is fp32
        g = (dout_e @ w2q[e]).float().to(acc)    # the dgrad's fp32 output
        s = torch.sigmoid(gate)
        da = w_e * g
        dh = torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], 1).float().to(acc)
        dx_e = fake_quantize_1x128(dh).to(acc) @ w13q[e]
        dy = (w_e * dout_e).float().to(acc)
        d_w2[e] = _fake_quantize_token_major(dy).T @ _fake_quantize_token_major(a)
        d_w13[e] = _fake_quantize_token_major(dh).T @ _fake_quantize_token_major(xs_e)
        at = 0
        for r, t, j in rows:
            n = len(t)
            d_x[r].index_add_(0, t, dx_e[at:at + n])
            d_w[r][t, j] = (g[at:at + n] * a[at:at + n]).sum(1)
            at += n
    return d_x, d_w, list(torch.split(d_w13, per_rank)), list(torch.split(d_w2, per_rank))


class _AllToAll(torch.autograd.Function):
    """Rows of input, in blocks of in_splits[p] rows for rank p, to out_splits[p] rows from rank p."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _all_to_all(rows, out_splits, in_splits, group):
    import torch.distributed as dist

    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


def _local_mlp(rows: torch.Tensor, expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Each row through its (local) expert's SwiGLU MLP; rows stay in their order."""
    inter = w13.shape[1] // 2
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=w13.shape[0])
    h = _expert_matmul(rows[order], w13, counts)
    y_sorted = _expert_matmul(F.silu(h[:, :inter]) * h[:, inter:], w2, counts)
    return y_sorted[torch.argsort(order)]


def moe_distributed(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, *, group=None, check: bool = True) -> torch.Tensor:
    """This process's rank of the layer over a torch.distributed group of R processes: x [T, H], topk_idx
    [T, K] global expert ids (-1 = masked; expert e lives on group rank e // E_local), topk_weights [T, K],
    this rank's experts w13 [E_local, 2I, H] and w2 [E_local, H, I] -> out [T, H] in x's dtype.

    Collective: every rank of the group calls it. T may differ between ranks (0 too). The combine
    accumulates in fp32 (fp64 for fp64 inputs). Tensors must be on a device the group's backend serves
    (CUDA for NCCL, CPU for gloo)."""
    import torch.distributed as dist

    num_ranks = dist.get_world_size(group)
    num_tokens, top_k = topk_idx.shape
    local_experts, _, hidden = w13.shape
    if check:
        check_ids(topk_idx, local_experts * num_ranks)

    expert = topk_idx.reshape(-1).long()
    routed = expert >= 0
    token = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    destination = torch.where(routed, expert // local_experts, num_ranks)
    # Rank-major send order (stable, so rows keep token order within a rank); masked slots last, dropped.
    order = torch.argsort(destination, stable=True)
    send_counts = torch.bincount(destination[routed], minlength=num_ranks)
    order = order[: int(send_counts.sum())]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()

    rows_token = token[order]
    received = _AllToAll.apply(x[rows_token], recv, send, group)
    received_expert = _all_to_all(expert[order] % local_experts, recv, send, group)
    y = _AllToAll.apply(_local_mlp(received, received_expert, w13, w2), send, recv, group)

    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros(num_tokens, hidden, dtype=acc, device=x.device)
    out = out.index_add(0, rows_token, y.to(acc) * weights.to(acc).unsqueeze(1))
    return out.to(x.dtype)
