"""The GPU layer as torch custom ops (torch.library) with autograd.

Ops (opaque to torch.compile, so no graph break inside them; shapes come from register_fake):
  megamoe::moe_forward(key, config, x[], topk_idx[], topk_weights[], w13[], w2[]) -> out[]
  megamoe::moe_backward(key, config, d_out[], x[], topk_idx[], topk_weights[], w13[], w2[])
      -> (d_x[], d_topk_weights[], d_w13[] fp32, d_w2[] fp32)
Each list holds one tensor per virtual rank. `key` names the layer state (its symmetric workspace) and
`config` its shape; both are plain ints so that compile and CUDA graphs see constants.

The library keeps the forward's routing for the backward, per group ("the latest forward"). A backward
whose forward is no longer the latest one of its group (two layers sharing a key, a module called twice,
activation checkpointing) re-runs that forward first, so results stay right; give each layer its own key
(MegaMoE does) to avoid the extra work.

Checks: dtype, device, shape and contiguity are checked before any pointer goes to the library (also at
trace time, on fake tensors). Expert ids and the errors the device records (capacity, timeouts) need the
host to wait for the GPU; that happens while debug checks are on (default; set_debug_checks(False) or
MEGAMOE_DEBUG_CHECKS=0 for speed) and never during CUDA graph capture.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading

import torch
from torch import Tensor

from . import _lib
from .reference import check_ids

__all__ = ["LayerConfig", "moe", "moe_ranks", "new_key", "release", "release_all", "set_debug_checks", "debug_checks",
           "synchronize_and_check", "MegaMoEError"]

MegaMoEError = _lib.MegaMoEError


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    num_ranks: int = 1
    precision: int = _lib.PRECISION_BF16

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def as_list(self) -> list[int]:
        return [self.hidden, self.intermediate, self.num_experts, self.top_k, self.max_tokens_per_rank,
                self.num_ranks, self.precision]

    @classmethod
    def from_list(cls, values) -> "LayerConfig":
        return cls(*(int(v) for v in values))

    def to_c(self) -> _lib.Config:
        return _lib.Config(hidden=self.hidden, intermediate=self.intermediate, num_experts=self.num_experts,
                           top_k=self.top_k, num_ranks=self.num_ranks, max_tokens_per_rank=self.max_tokens_per_rank,
                           precision=self.precision, reserved=0)

    def validate(self) -> None:
        """The library's rules (C++ megamoe::validate); raises MegaMoEError naming the broken rule."""
        _lib.validate_config(self.to_c())


_debug_checks = os.environ.get("MEGAMOE_DEBUG_CHECKS", "1") != "0"


def set_debug_checks(enabled: bool) -> None:
    global _debug_checks
    _debug_checks = bool(enabled)


def debug_checks() -> bool:
    return _debug_checks


def _host_may_wait() -> bool:
    return _debug_checks and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# ---- layer state: one library group per (key, device), created on first use ----

class _State:
    def __init__(self, config: LayerConfig):
        self.config = config
        self.groups: dict[int, _lib.VirtualRankGroup] = {}
        self.latest_forward: dict[int, tuple] = {}


_states: dict[int, _State] = {}
_states_lock = threading.Lock()
_keys = itertools.count(1)


def new_key() -> int:
    """A fresh layer-state key (its own workspace, so its own "latest forward")."""
    return next(_keys)


def release(key: int) -> None:
    """Frees the GPU state of key (it is re-created if the key is used again). Waits for the key's work; a
    CUDA graph that captured this key's calls must not be replayed afterwards."""
    with _states_lock:
        state = _states.pop(key, None)
    if state is not None:
        for group in state.groups.values():
            group.close()


def release_all() -> None:
    """Frees the GPU state of every key (tests, and before tearing CUDA down)."""
    with _states_lock:
        keys = list(_states)
    for key in keys:
        release(key)


def _state(key: int, config: LayerConfig) -> _State:
    with _states_lock:
        state = _states.get(key)
        if state is None or state.config != config:
            if state is not None:
                raise ValueError(f"megamoe key {key} is already used by a layer of another shape "
                                 f"({state.config} vs {config})")
            state = _states[key] = _State(config)
        return state


class _LibraryBackend:
    """Runs the ops on libmegamoe. Tests swap in another backend to check the torch plumbing without a GPU."""

    def group(self, state: _State, device: torch.device) -> _lib.VirtualRankGroup:
        index = device.index if device.index is not None else torch.cuda.current_device()
        group = state.groups.get(index)
        if group is None:
            with torch.cuda.device(index):
                group = _lib.VirtualRankGroup(state.config.to_c())
            state.groups[index] = group
        return group

    def forward(self, state, x, topk_idx, topk_weights, w13, w2, out) -> None:
        group = self.group(state, x[0].device)
        args = [_lib.ForwardArgs(num_tokens=xi.shape[0], x=xi.data_ptr(), topk_idx=ii.data_ptr(),
                                 topk_idx_is_int32=int(ii.dtype == torch.int32), reserved=0,
                                 topk_weights=wi.data_ptr(), w13=a.data_ptr(), w2=b.data_ptr(), out=o.data_ptr())
                for xi, ii, wi, a, b, o in zip(x, topk_idx, topk_weights, w13, w2, out)]
        group.forward(args, torch.cuda.current_stream(x[0].device).cuda_stream)

    def backward(self, state, d_out, d_x, d_topk_weights, d_w13, d_w2) -> None:
        group = self.group(state, d_out[0].device)
        args = [_lib.BackwardArgs(d_out=g.data_ptr(), d_x=dx.data_ptr(), d_topk_weights=dw.data_ptr(),
                                  d_w13=a.data_ptr(), d_w2=b.data_ptr(), accumulate_weight_grads=0, reserved=0)
                for g, dx, dw, a, b in zip(d_out, d_x, d_topk_weights, d_w13, d_w2)]
        group.backward(args, torch.cuda.current_stream(d_out[0].device).cuda_stream)

    def synchronize_and_check(self, state, device) -> None:
        self.group(state, device).synchronize_and_check()

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"


_backend = _LibraryBackend()


# ---- checks ----

def _check_inputs(cfg: LayerConfig, x, topk_idx, topk_weights, w13, w2, d_out=None) -> None:
    ranks = cfg.num_ranks
    lists = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    if d_out is not None:
        lists["d_out"] = d_out
    for name, values in lists.items():
        if len(values) != ranks:
            raise ValueError(f"megamoe: {name} needs one tensor per rank ({ranks}), got {len(values)}")
    device = x[0].device
    if not _backend.supports(device):
        raise ValueError(f"megamoe runs on CUDA tensors; x is on {device}")
    h, i, k, e_local = cfg.hidden, cfg.intermediate, cfg.top_k, cfg.experts_per_rank
    for r in range(ranks):
        t = x[r].shape[0] if x[r].dim() >= 1 else -1
        expected = {
            "x": ((t, h), (torch.bfloat16,)),
            "topk_idx": ((t, k), (torch.int64, torch.int32)),
            "topk_weights": ((t, k), (torch.float32,)),
            "w13": ((e_local, 2 * i, h), (torch.bfloat16,)),
            "w2": ((e_local, h, i), (torch.bfloat16,)),
        }
        if d_out is not None:
            expected["d_out"] = ((t, h), (torch.bfloat16,))
        for name, (shape, dtypes) in expected.items():
            tensor = lists[name][r]
            label = name if ranks == 1 else f"{name}[{r}]"
            if not isinstance(tensor, Tensor):
                raise TypeError(f"megamoe: {label} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype not in dtypes:
                raise TypeError(f"megamoe: {label} must be {' or '.join(str(d) for d in dtypes)}, got {tensor.dtype}")
            if tensor.device != device:
                raise ValueError(f"megamoe: {label} is on {tensor.device}, x on {device}; all must be on one device")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"megamoe: {label} must have shape {list(shape)} (H={h}, I={i}, K={k}, "
                                 f"E_local={e_local}), got {list(tensor.shape)}")
            if not tensor.is_contiguous():
                raise ValueError(f"megamoe: {label} must be contiguous (row-major), got strides {tensor.stride()}; "
                                 f"call .contiguous()")
        if t > cfg.max_tokens_per_rank:
            raise ValueError(f"megamoe: {'x' if ranks == 1 else f'x[{r}]'} has {t} tokens, more than "
                             f"max_tokens_per_rank={cfg.max_tokens_per_rank}")


def _check_ids(cfg: LayerConfig, topk_idx) -> None:
    for r, ids in enumerate(topk_idx):
        check_ids(ids, cfg.num_experts, "topk_idx" if cfg.num_ranks == 1 else f"topk_idx[{r}]")


def _forward_key(x, topk_idx, topk_weights, w13, w2) -> tuple:
    return tuple((t.data_ptr(), t.shape[0]) for t in itertools.chain(x, topk_idx, topk_weights, w13, w2))


def _run_forward(key, cfg, x, topk_idx, topk_weights, w13, w2) -> list[Tensor]:
    state = _state(key, cfg)
    if _host_may_wait():
        _check_ids(cfg, topk_idx)
    out = [torch.empty_like(xi) for xi in x]
    _backend.forward(state, x, topk_idx, topk_weights, w13, w2, out)
    state.latest_forward[x[0].device.index] = _forward_key(x, topk_idx, topk_weights, w13, w2)
    if _host_may_wait():
        _backend.synchronize_and_check(state, x[0].device)
    return out


# ---- the ops ----

@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def _moe_forward(key: int, config: list[int], x: list[Tensor], topk_idx: list[Tensor],
                 topk_weights: list[Tensor], w13: list[Tensor], w2: list[Tensor]) -> list[Tensor]:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, w13, w2)
    return _run_forward(key, cfg, x, topk_idx, topk_weights, w13, w2)


@_moe_forward.register_fake
def _(key, config, x, topk_idx, topk_weights, w13, w2):
    _check_inputs(LayerConfig.from_list(config), x, topk_idx, topk_weights, w13, w2)
    return [torch.empty_like(xi) for xi in x]


@torch.library.custom_op("megamoe::moe_backward", mutates_args=())
def _moe_backward(key: int, config: list[int], d_out: list[Tensor], x: list[Tensor], topk_idx: list[Tensor],
                  topk_weights: list[Tensor], w13: list[Tensor], w2: list[Tensor]
                  ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, w13, w2, d_out)
    state = _state(key, cfg)
    if state.latest_forward.get(x[0].device.index) != _forward_key(x, topk_idx, topk_weights, w13, w2):
        _run_forward(key, cfg, x, topk_idx, topk_weights, w13, w2)  # restores this forward's routing
    d_x = [torch.empty_like(xi) for xi in x]
    d_topk_weights = [torch.empty_like(wi) for wi in topk_weights]
    d_w13 = [torch.empty_like(wi, dtype=torch.float32) for wi in w13]
    d_w2 = [torch.empty_like(wi, dtype=torch.float32) for wi in w2]
    _backend.backward(state, d_out, d_x, d_topk_weights, d_w13, d_w2)
    if _host_may_wait():
        _backend.synchronize_and_check(state, x[0].device)
    return d_x, d_topk_weights, d_w13, d_w2


@_moe_backward.register_fake
def _(key, config, d_out, x, topk_idx, topk_weights, w13, w2):
    _check_inputs(LayerConfig.from_list(config), x, topk_idx, topk_weights, w13, w2, d_out)
    return ([torch.empty_like(xi) for xi in x], [torch.empty_like(wi) for wi in topk_weights],
            [torch.empty_like(wi, dtype=torch.float32) for wi in w13],
            [torch.empty_like(wi, dtype=torch.float32) for wi in w2])


def _setup_context(ctx, inputs, output):
    key, config, x, topk_idx, topk_weights, w13, w2 = inputs
    ctx.key, ctx.config, ctx.ranks = key, config, len(x)
    ctx.save_for_backward(*x, *topk_idx, *topk_weights, *w13, *w2)


def _backward(ctx, grads):
    r = ctx.ranks
    saved = ctx.saved_tensors
    x, topk_idx, topk_weights, w13, w2 = (list(saved[j * r:(j + 1) * r]) for j in range(5))
    # Autograd may hand over expanded or strided gradients (e.g. from .sum()); the kernels need row-major.
    d_out = [torch.zeros_like(xi) if g is None else g.to(xi.dtype).contiguous() for g, xi in zip(grads, x)]
    d_x, d_w, d_w13, d_w2 = torch.ops.megamoe.moe_backward(ctx.key, ctx.config, d_out, x, topk_idx, topk_weights,
                                                           w13, w2)
    d_w13 = [g.to(w.dtype) for g, w in zip(d_w13, w13)]
    d_w2 = [g.to(w.dtype) for g, w in zip(d_w2, w2)]
    return None, None, d_x, [None] * r, d_w, d_w13, d_w2


_moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- public functions ----

_default_keys: dict[LayerConfig, int] = {}


def _key_for(config: LayerConfig, key: int | None) -> int:
    if key is not None:
        return key
    if config not in _default_keys:
        _default_keys.setdefault(config, new_key())
    return _default_keys[config]


def moe_ranks(x: list[Tensor], topk_idx: list[Tensor], topk_weights: list[Tensor], w13: list[Tensor],
              w2: list[Tensor], *, config: LayerConfig, key: int | None = None) -> list[Tensor]:
    """R virtual ranks on one GPU: one tensor per rank in each list (DESIGN.md section 3 shapes; rank r holds
    experts [r*E/R, (r+1)*E/R), ids are global). Differentiable in x, topk_weights, w13 and w2."""
    return torch.ops.megamoe.moe_forward(_key_for(config, key), config.as_list(), list(x), list(topk_idx),
                                         list(topk_weights), list(w13), list(w2))


def moe(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, *,
        config: LayerConfig, key: int | None = None) -> Tensor:
    """One rank holding every expert (config.num_ranks == 1)."""
    if config.num_ranks != 1:
        raise ValueError(f"megamoe.ops.moe is the single-rank layer; config has num_ranks={config.num_ranks}: "
                         f"use moe_ranks")
    return moe_ranks([x], [topk_idx], [topk_weights], [w13], [w2], config=config, key=key)[0]


def synchronize_and_check(config: LayerConfig, key: int | None = None, device=None) -> None:
    """Waits for the layer's work on device and raises MegaMoEError for any error the GPU recorded."""
    state = _state(_key_for(config, key), config)
    _backend.synchronize_and_check(state, torch.device("cuda", torch.cuda.current_device()) if device is None
                                   else torch.device(device))
