"""nn.Module holding the experts' weights, and exact converters from torchtitan's three-tensor layout.

Layouts (docs/MODEL.md): w13 [E, 2I, H] with the gate rows (w1) first and the up rows (w3) after;
w2 [E, H, I]. torchtitan's GroupedExperts stores w1 and w3 as separate [E, I, H] tensors and w2 as
[E, H, I], so w2 is shared as is and w13 is a concatenation: the conversion moves values, never rounds.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from . import ops

__all__ = ["MegaMoE", "w13_from_w1_w3", "w1_w3_from_w13"]


def w13_from_w1_w3(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """w1 (gate), w3 (up), each [E, I, H] -> w13 [E, 2I, H], contiguous, same dtype (exact)."""
    if w1.dim() != 3 or w1.shape != w3.shape:
        raise ValueError(f"w1 and w3 must both be [E, I, H] with the same shape, got {tuple(w1.shape)} and "
                         f"{tuple(w3.shape)}")
    if w1.dtype != w3.dtype:
        raise TypeError(f"w1 and w3 must have the same dtype, got {w1.dtype} and {w3.dtype}")
    return torch.cat([w1, w3], dim=1).contiguous()


def w1_w3_from_w13(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] -> (w1, w3), each [E, I, H] and contiguous (exact)."""
    if w13.dim() != 3 or w13.shape[1] % 2 != 0:
        raise ValueError(f"w13 must be [E, 2I, H], got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    return w13[:, :inter].contiguous(), w13[:, inter:].contiguous()


class MegaMoE(nn.Module):
    """The expert MLPs of an MoE layer on megamoe's GPU kernels; routing comes from the caller.

    forward(x [T, H] bf16, topk_idx [T, K] int64/int32, topk_weights [T, K] fp32) -> [T, H] bf16.

    virtual_ranks=R runs the expert-parallel path with R ranks on this one GPU (tests, single-GPU runs of
    the multi-rank code): the module then holds all E experts, rank r owns [r*E/R, (r+1)*E/R), and the T
    tokens are split into R contiguous chunks of at most max_tokens_per_rank each. The result equals the
    single-rank layer's.

    group=pg (a torch.distributed ProcessGroup, one process per GPU) runs one rank of the layer in each
    process of pg: R = pg.size(), and this module holds only its rank's experts [first_expert,
    first_expert + E/R) (w13 [E/R, 2I, H], w2 [E/R, H, I]) and its process's tokens (at most
    max_tokens_per_rank; ranks may have different T). Every rank must construct the module and call it
    (forward and backward) in the same order: see megamoe.ops on collective use.

    fused_forward=True runs the forward as one persistent kernel per rank (dispatch, both expert GEMMs and the
    combine, with the communication overlapped), fused_backward=True the backward's data path likewise (the
    weight gradients follow as their own GEMMs); recompute_h=True keeps no h between forward and backward
    (the backward runs GEMM1 again). Results are bitwise the same either way (docs/LAYER.md).

    precision="fp8" runs DeepSeek-V3's blockwise FP8 recipe (docs/FP8.md): the forward quantizes x per token,
    the weights in 128 x 128 blocks (on every call) and the SwiGLU output per row; the backward quantizes
    d_out per token, dh per row and the weight gradients' operands along the routed rows, with every GEMM in
    FP8; the weights stay bf16 parameters and their gradients come in fp32 (main_grad) or the parameters'
    dtype. Not with the fused kernels or recompute_h; H and I are multiples of 128.

    main_grad=True: the weight gradients are added to fp32 buffers `w13.main_grad` and `w2.main_grad` (made
    here, zeroed; or the caller's, if it set them before the first forward) by the GEMMs themselves, and w13
    and w2 get no `.grad`: gradient accumulation over micro-batches without a gradient tensor, a conversion or
    an add per step. The caller zeroes the buffers when an accumulation starts (as Megatron-style trainers
    do with `param.main_grad`).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, max_tokens_per_rank: int,
                 *, virtual_ranks: int = 1, group=None, init_std: float = 0.02, device=None,
                 dtype=torch.bfloat16, main_grad: bool = False, fused_forward: bool = False,
                 fused_backward: bool = False, recompute_h: bool = False, precision: str = "bf16"):
        super().__init__()
        if group is not None and virtual_ranks != 1:
            raise ValueError("megamoe: virtual_ranks and group exclude each other (group= runs one rank per process)")
        ranks = virtual_ranks if group is None else group.size()
        self.config = ops.LayerConfig(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                                      top_k=top_k, num_ranks=ranks, max_tokens_per_rank=max_tokens_per_rank,
                                      precision=ops.precision_from_name(precision), fused_forward=fused_forward,
                                      recompute_h=recompute_h, fused_backward=fused_backward)
        self.config.validate()
        self.group = group
        # The name, taken once: forward then hands the op a string constant (torch.compile never has to
        # trace the group object).
        self._group_name = None if group is None else ops.group_name(group)
        local = num_experts if group is None else num_experts // ranks
        self.first_expert = 0 if group is None else group.rank() * local
        # Its own library state, so that its backward always finds its own forward's routing.
        self._key = ops.new_key()
        weakref.finalize(self, ops.release, self._key)
        self.init_std = init_std
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(local, hidden, intermediate, device=device, dtype=dtype))
        self.reset_parameters()
        self.main_grad = bool(main_grad)
        if self.main_grad:
            for param in (self.w13, self.w2):
                param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def reset_parameters(self, init_std: float | None = None) -> None:
        """torchtitan's GroupedExperts init: truncated normal (cut at +-2, absolute), std 0.02 for the gate
        (w1) and init_std for up (w3) and down (w2); drawn in fp32, then rounded to the parameter dtype."""
        std = self.init_std if init_std is None else init_std
        inter = self.config.intermediate

        def trunc_normal(shape, s):
            t = torch.empty(shape, dtype=torch.float32, device=self.w13.device)
            return nn.init.trunc_normal_(t, mean=0.0, std=s, a=-2.0, b=2.0)

        e, h = self.w13.shape[0], self.config.hidden
        self.w13[:, :inter].copy_(trunc_normal((e, inter, h), 0.02))
        self.w13[:, inter:].copy_(trunc_normal((e, inter, h), std))
        self.w2.copy_(trunc_normal((e, h, inter), std))

    @torch.no_grad()
    def load_w1_w2_w3(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
        """Copies torchtitan-layout weights (w1, w3 [E, I, H], w2 [E, H, I]) into this module (with group=:
        this rank's experts only, [E/R, ...])."""
        w13 = w13_from_w1_w3(w1, w3)
        if w13.shape != self.w13.shape or w2.shape != self.w2.shape:
            raise ValueError(f"weights of shape w1/w3 {tuple(w1.shape)}, w2 {tuple(w2.shape)} do not fit this "
                             f"module (w13 {tuple(self.w13.shape)}, w2 {tuple(self.w2.shape)})")
        self.w13.copy_(w13)
        self.w2.copy_(w2)

    @torch.no_grad()
    def w1_w2_w3(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This module's weights in torchtitan's layout (copies)."""
        w1, w3 = w1_w3_from_w13(self.w13)
        return w1, self.w2.detach().clone(), w3

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        main_grads = (self.w13.main_grad, self.w2.main_grad) if self.main_grad else None
        if self._group_name is not None:
            return ops._moe_process(x, topk_idx, topk_weights, self.w13, self.w2, config=self.config, key=self._key,
                                    name=self._group_name, main_grads=main_grads)
        ranks = self.config.num_ranks
        outs = ops.moe_ranks_all_experts(
            list(torch.tensor_split(x, ranks)), list(torch.tensor_split(topk_idx, ranks)),
            list(torch.tensor_split(topk_weights, ranks)), self.w13, self.w2, config=self.config, key=self._key,
            main_grads=main_grads)
        return outs[0] if ranks == 1 else torch.cat(outs)

    def synchronize_and_check(self) -> None:
        """Waits for this layer's GPU work and raises MegaMoEError for an error the GPU recorded (bad expert
        id, capacity, timeout); megamoe.synchronize_and_check(layer) does the same."""
        ops.synchronize_and_check(self)

    def extra_repr(self) -> str:
        c = self.config
        ranks = (f"virtual_ranks={c.num_ranks}" if self.group is None else
                 f"process_ranks={c.num_ranks}, experts=[{self.first_expert}, {self.first_expert + self.w13.shape[0]})")
        return (f"hidden={c.hidden}, intermediate={c.intermediate}, num_experts={c.num_experts}, top_k={c.top_k}, "
                f"{ranks}, max_tokens_per_rank={c.max_tokens_per_rank}" + (", precision='fp8'" if c.fp8 else ""))
