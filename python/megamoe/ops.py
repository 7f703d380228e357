"""The GPU layer as torch custom ops (torch.library) with autograd.

Ops (opaque to torch.compile, so no graph break inside them; shapes come from register_fake):
  megamoe::moe_forward(key, config, x[], topk_idx[], topk_weights[], w13[], w2[]) -> out[]
  megamoe::moe_backward(key, config, d_out[], x[], topk_idx[], topk_weights[], w13[], w2[])
      -> (d_x[], d_topk_weights[], d_w13[], d_w2[])
  megamoe::moe_forward_all_experts / moe_backward_all_experts: the same with w13, w2 (and their
      gradients) one tensor each holding every rank's experts; with fp32 main gradients given to the
      forward, its backward is megamoe::moe_backward_into_main_grads, which adds the weight gradients to them.
The weight gradients these return are bf16, the weights' dtype (either precision), each value rounded once
by the GEMM that makes it, so autograd takes them as they are. Each list holds one tensor per virtual rank.
`key` names the layer state (its symmetric workspace) and `config` its shape; both are plain ints so that
compile and CUDA graphs see constants.

Process groups (one process per GPU, a torch.distributed ProcessGroup of config.num_ranks processes):
  megamoe::moe_process_forward(key, config, group_name, x, topk_idx, topk_weights, w13, w2) -> out
  megamoe::moe_process_backward(key, config, group_name, d_out, x, topk_idx, topk_weights, w13, w2)
      -> (d_x, d_topk_weights, d_w13, d_w2)
take this process's tensors (its tokens, its E/R experts). The group travels as its name (as in
torch's functional collectives), a string constant to compile. The library group is created on the first
call of a (key, group, device): rank 0 of the group makes a bootstrap id, torch.distributed broadcasts it,
and every rank joins. Everything about these ops is collective: every rank must make the same calls in
the same order (the first forward of a layer included), and every rank must run the backward of every
forward it differentiates. A rank that fails an input check raises while the others wait for it at the
device barriers until their timeout (LayerOptions.wait_timeout_seconds) turns that into an error. The
collective create is bounded the same way: ranks whose configs differ all fail with the field named, a
rank whose own setup fails tells the others, and a rank that never joins is a timeout on the others.

The library keeps the forward's routing for the backward, per group ("the latest forward"). A backward
whose forward is no longer the latest one of its group (two layers sharing a key, a module called twice,
activation checkpointing) re-runs that forward first, so results stay right; give each layer its own key
(MegaMoE does) to avoid the extra work. That decision is made on the host when the backward is called, so a
CUDA graph replays whatever was decided at capture: in a captured step (torch.compile's "reduce-overhead",
torch.cuda.graphs) every backward must have the same latest forward at replay as at capture, which holds
when each forward's backward runs before the next forward of the same key.

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
from typing import Optional

import torch
from torch import Tensor

from . import _lib
from .reference import check_ids

__all__ = ["LayerConfig", "PRECISIONS", "precision_from_name", "moe", "moe_ranks", "moe_ranks_all_experts", "new_key", "release", "release_all", "set_debug_checks", "debug_checks",
           "synchronize_and_check", "group_name", "MegaMoEError"]

MegaMoEError = _lib.MegaMoEError


# The layer's arithmetic by name (MegaMoE(precision=...)): bf16, or DeepSeek-V3's blockwise FP8 (docs/FP8.md).
PRECISIONS = {"bf16": _lib.PRECISION_BF16, "fp8": _lib.PRECISION_FP8_BLOCKWISE}


def precision_from_name(name: str) -> int:
    if name not in PRECISIONS:
        raise ValueError(f"megamoe: precision must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The layer's shape (the C config) and how it runs (the C options: fused_forward / fused_backward, the
    fused persistent kernels instead of the modular sequences of kernels; recompute_h, the backward recomputes
    h instead of the forward keeping it). Every choice computes bitwise the same results.

    precision: PRECISION_BF16, or PRECISION_FP8_BLOCKWISE (precision_from_name("fp8")): DeepSeek-V3's blockwise
    FP8 forward and backward (docs/FP8.md), modular paths only (no fused kernels, no recompute_h)."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    num_ranks: int = 1
    precision: int = _lib.PRECISION_BF16
    fused_forward: bool = False
    recompute_h: bool = False
    fused_backward: bool = False

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def as_list(self) -> list[int]:
        return [self.hidden, self.intermediate, self.num_experts, self.top_k, self.max_tokens_per_rank,
                self.num_ranks, self.precision, int(self.fused_forward), int(self.recompute_h),
                int(self.fused_backward)]

    @classmethod
    def from_list(cls, values) -> "LayerConfig":
        v = [int(x) for x in values]
        return cls(*v[:7], *(bool(x) for x in v[7:]))

    def options_c(self) -> _lib.Options:
        """The library's options for this layer: its defaults with this config's choices."""
        options = _lib.default_options()
        options.forward_path = _lib.FORWARD_FUSED if self.fused_forward else _lib.FORWARD_MODULAR
        options.recompute_h = int(self.recompute_h)
        options.backward_path = _lib.BACKWARD_FUSED if self.fused_backward else _lib.BACKWARD_MODULAR
        return options

    def to_c(self) -> _lib.Config:
        return _lib.Config(hidden=self.hidden, intermediate=self.intermediate, num_experts=self.num_experts,
                           top_k=self.top_k, num_ranks=self.num_ranks, max_tokens_per_rank=self.max_tokens_per_rank,
                           precision=self.precision, reserved=0)

    @property
    def fp8(self) -> bool:
        return self.precision == _lib.PRECISION_FP8_BLOCKWISE

    def validate(self) -> None:
        """The library's rules (C++ megamoe::validate); raises MegaMoEError naming the broken rule, and
        ValueError for a way of running the layer its precision does not offer yet (which the library
        would refuse at its first call)."""
        if self.fp8 and (self.fused_forward or self.fused_backward or self.recompute_h):
            raise ValueError("megamoe: precision='fp8' runs the modular paths only so far: fused_forward, "
                             "fused_backward and recompute_h are not available with it")
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
        # Process groups per (torch group name, device index); their latest forward under the same key.
        self.process_groups: dict[tuple[str, int], _lib.ProcessRankGroup] = {}
        self.latest_forward: dict[int | tuple[str, int], tuple] = {}


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
        for group in [*state.groups.values(), *state.process_groups.values()]:
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


# ---- process groups: torch.distributed side ----

def group_name(group) -> str:
    """The name the process ops take for a torch.distributed ProcessGroup (its c10d group name)."""
    name = getattr(group, "group_name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"megamoe: group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    return name


def _resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def bootstrap_id(group) -> bytes:
    """Collective over group: rank 0 makes a bootstrap id and every rank gets its bytes. A failure on rank 0
    reaches every rank (as MegaMoEError), so no rank is left waiting in the library's create."""
    import torch.distributed as dist

    payload: list = [None]
    if group.rank() == 0:
        try:
            payload[0] = _lib.create_bootstrap_id()
        except _lib.MegaMoEError as e:
            # A tuple, not the exception: MegaMoEError does not round-trip through pickle.
            payload[0] = (e.code, str(e))
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(payload[0], tuple):
        code, message = payload[0]
        raise _lib.MegaMoEError(code, "bootstrap failed", f"rank 0 of the group could not create an id: {message}")
    return payload[0]


def _check_group_size(cfg: LayerConfig, group) -> None:
    if group.size() != cfg.num_ranks:
        raise ValueError(f"megamoe: config.num_ranks={cfg.num_ranks} but the process group has {group.size()} "
                         f"ranks; they must be equal (one rank per process)")


class _LibraryBackend:
    """Runs the ops on libmegamoe. Tests swap in another backend to check the torch plumbing without a GPU."""

    def group(self, state: _State, device: torch.device) -> _lib.VirtualRankGroup:
        index = device.index if device.index is not None else torch.cuda.current_device()
        group = state.groups.get(index)
        if group is None:
            with torch.cuda.device(index):
                group = _lib.VirtualRankGroup(state.config.to_c(), state.config.options_c())
            state.groups[index] = group
        return group

    def _forward(self, state, x, topk_idx, topk_weights, out, weights) -> None:
        """weights: per rank, the ForwardArgs fields that name its expert weights."""
        group = self.group(state, x[0].device)
        args = [_lib.ForwardArgs(num_tokens=xi.shape[0], x=xi.data_ptr(), topk_idx=ii.data_ptr(),
                                 topk_idx_is_int32=int(ii.dtype == torch.int32), reserved=0,
                                 topk_weights=wi.data_ptr(), out=o.data_ptr(), **named)
                for xi, ii, wi, o, named in zip(x, topk_idx, topk_weights, out, weights)]
        group.forward(args, torch.cuda.current_stream(x[0].device).cuda_stream)

    def forward(self, state, x, topk_idx, topk_weights, w13, w2, out) -> None:
        self._forward(state, x, topk_idx, topk_weights, out,
                      [dict(w13=a.data_ptr(), w2=b.data_ptr()) for a, b in zip(w13, w2)])

    def forward_fp8_weights(self, state, x, topk_idx, topk_weights, fp8_weights, out) -> None:
        """fp8_weights: (w13_fp8, w13_scales, w2_fp8, w2_scales), one tensor per rank each."""
        self._forward(state, x, topk_idx, topk_weights, out,
                      [dict(w13_fp8=a.data_ptr(), w13_scales=a_s.data_ptr(), w2_fp8=b.data_ptr(),
                            w2_scales=b_s.data_ptr()) for a, a_s, b, b_s in zip(*fp8_weights)])

    def backward(self, state, d_out, d_x, d_topk_weights, d_w13, d_w2, accumulate=False) -> None:
        group = self.group(state, d_out[0].device)
        args = [_lib.BackwardArgs(d_out=g.data_ptr(), d_x=dx.data_ptr(), d_topk_weights=dw.data_ptr(),
                                  accumulate_weight_grads=int(accumulate), reserved=0, **_weight_grad_fields(a, b))
                for g, dx, dw, a, b in zip(d_out, d_x, d_topk_weights, d_w13, d_w2)]
        group.backward(args, torch.cuda.current_stream(d_out[0].device).cuda_stream)

    def synchronize_and_check(self, state, device) -> None:
        # A group that does not exist yet has recorded nothing; creating one here would only allocate.
        if device.type != "cuda":
            return
        group = state.groups.get(device.index if device.index is not None else torch.cuda.current_device())
        if group is not None:
            group.synchronize_and_check()

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def process_group(self, state: _State, name: str, device: torch.device) -> _lib.ProcessRankGroup:
        index = device.index if device.index is not None else torch.cuda.current_device()
        group = state.process_groups.get((name, index))
        if group is None:
            torch_group = _resolve_group(name)
            _check_group_size(state.config, torch_group)
            with torch.cuda.device(index):  # the NCCL broadcast and the library's create use this device
                group = _lib.ProcessRankGroup(state.config.to_c(), torch_group.rank(), bootstrap_id(torch_group),
                                              state.config.options_c())
            state.process_groups[(name, index)] = group
        return group

    def process_forward(self, state, name, x, topk_idx, topk_weights, w13, w2, out) -> None:
        group = self.process_group(state, name, x.device)
        args = _lib.ForwardArgs(num_tokens=x.shape[0], x=x.data_ptr(), topk_idx=topk_idx.data_ptr(),
                                topk_idx_is_int32=int(topk_idx.dtype == torch.int32), reserved=0,
                                topk_weights=topk_weights.data_ptr(), w13=w13.data_ptr(), w2=w2.data_ptr(),
                                out=out.data_ptr())
        group.forward(args, torch.cuda.current_stream(x.device).cuda_stream)

    def process_backward(self, state, name, d_out, d_x, d_topk_weights, d_w13, d_w2, accumulate=False) -> None:
        group = self.process_group(state, name, d_out.device)
        args = _lib.BackwardArgs(d_out=d_out.data_ptr(), d_x=d_x.data_ptr(), d_topk_weights=d_topk_weights.data_ptr(),
                                 accumulate_weight_grads=int(accumulate), reserved=0,
                                 **_weight_grad_fields(d_w13, d_w2))
        group.backward(args, torch.cuda.current_stream(d_out.device).cuda_stream)

    def process_synchronize_and_check(self, state, name, device) -> None:
        # Never create a process group here: creating one is collective.
        if device.type != "cuda":
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        group = state.process_groups.get((name, index))
        if group is not None:
            group.synchronize_and_check()


_backend = _LibraryBackend()


def _weight_grad_fields(d_w13: Tensor, d_w2: Tensor) -> dict:
    """The BackwardArgs fields of a pair of weight-gradient buffers: d_w13 / d_w2 for fp32 ones, d_w13_bf16 /
    d_w2_bf16 for bf16 ones (the library rounds each value once where it stores it)."""
    if d_w13.dtype != d_w2.dtype or d_w13.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"megamoe: weight-gradient buffers must both be float32 or both bfloat16, got {d_w13.dtype} "
                        f"and {d_w2.dtype}")
    suffix = "_bf16" if d_w13.dtype == torch.bfloat16 else ""
    return {"d_w13" + suffix: d_w13.data_ptr(), "d_w2" + suffix: d_w2.data_ptr()}


# ---- checks ----

# Tensors whose rows the kernels move 16 bytes at a time.
_ROWS16 = frozenset(("x", "w13", "w2", "d_out"))


def _address(tensor: Tensor) -> int | None:
    """The data pointer of a tensor with real storage; None under tracing (fake and meta tensors have none)."""
    if tensor.device.type == "meta":
        return None
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _check_tensor(label: str, tensor, shape: tuple, dtypes: tuple, device, dims: str, alignment: int | None) -> None:
    """One input tensor: its type, dtype, device, shape (dims: the sizes the shape comes from, for the message),
    contiguity and, if given, the alignment of its start (the kernels move it `alignment` bytes at a time)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"megamoe: {label} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"megamoe: {label} must be {' or '.join(str(d) for d in dtypes)}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"megamoe: {label} is on {tensor.device}, x on {device}; all must be on one device")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"megamoe: {label} must have shape {list(shape)} ({dims}), got {list(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"megamoe: {label} must be contiguous (row-major), got strides {tensor.stride()}; "
                         f"call .contiguous()")
    address = _address(tensor)
    if alignment is not None and address is not None and address % alignment:
        raise ValueError(f"megamoe: {label} must start at a {alignment}-byte aligned address (it is moved "
                         f"{alignment} bytes at a time), got data_ptr() % {alignment} = {address % alignment} (a "
                         f"view at an odd offset); call .clone()")


def _check_inputs(cfg: LayerConfig, x, topk_idx, topk_weights, w13, w2, d_out=None, *, local: bool = False) -> None:
    """local: the lists hold one process's rank of a process group (one tensor each, E/R experts)."""
    ranks = 1 if local else cfg.num_ranks
    lists = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    if w13 is None and w2 is None:  # pre-quantized FP8 weights instead (_check_fp8_weights)
        del lists["w13"], lists["w2"]
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
            if name not in lists:
                continue
            _check_tensor(name if ranks == 1 else f"{name}[{r}]", lists[name][r], shape, dtypes, device,
                          f"H={h}, I={i}, K={k}, E_local={e_local}", 16 if name in _ROWS16 else None)
        if t > cfg.max_tokens_per_rank:
            raise ValueError(f"megamoe: {'x' if ranks == 1 else f'x[{r}]'} has {t} tokens, more than "
                             f"max_tokens_per_rank={cfg.max_tokens_per_rank}")


def _check_fp8_weights(cfg: LayerConfig, device, w13_fp8, w13_scales, w2_fp8, w2_scales) -> None:
    """Pre-quantized FP8 weights (docs/FP8.md): per rank, e4m3 codes and the fp32 scales of their 128 x 128
    blocks, in the layout of reference.quantize_128x128."""
    if not cfg.fp8:
        raise ValueError("megamoe: pre-quantized FP8 weights need a layer of precision 'fp8' "
                         "(LayerConfig(precision=ops.precision_from_name('fp8')))")
    h, i, e = cfg.hidden, cfg.intermediate, cfg.experts_per_rank
    expected = {
        "w13_fp8": (w13_fp8, (e, 2 * i, h), (torch.float8_e4m3fn, torch.uint8), 16),
        "w13_scales": (w13_scales, (e, 2 * i // 128, h // 128), (torch.float32,), 4),
        "w2_fp8": (w2_fp8, (e, h, i), (torch.float8_e4m3fn, torch.uint8), 16),
        "w2_scales": (w2_scales, (e, h // 128, i // 128), (torch.float32,), 4),
    }
    for name, (values, shape, dtypes, alignment) in expected.items():
        if len(values) != cfg.num_ranks:
            raise ValueError(f"megamoe: {name} needs one tensor per rank ({cfg.num_ranks}), got {len(values)}")
        for r, tensor in enumerate(values):
            _check_tensor(name if cfg.num_ranks == 1 else f"{name}[{r}]", tensor, shape, dtypes, device,
                          f"H={h}, I={i}, E_local={e}", alignment)


def _check_ids(cfg: LayerConfig, topk_idx) -> None:
    for r, ids in enumerate(topk_idx):
        check_ids(ids, cfg.num_experts, "topk_idx" if len(topk_idx) == 1 else f"topk_idx[{r}]")


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


@torch.library.custom_op("megamoe::moe_forward_fp8_weights", mutates_args=())
def _moe_forward_fp8_weights(key: int, config: list[int], x: list[Tensor], topk_idx: list[Tensor],
                             topk_weights: list[Tensor], w13_fp8: list[Tensor], w13_scales: list[Tensor],
                             w2_fp8: list[Tensor], w2_scales: list[Tensor]) -> list[Tensor]:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, None, None)
    _check_fp8_weights(cfg, x[0].device, w13_fp8, w13_scales, w2_fp8, w2_scales)
    state = _state(key, cfg)
    if _host_may_wait():
        _check_ids(cfg, topk_idx)
    out = [torch.empty_like(xi) for xi in x]
    _backend.forward_fp8_weights(state, x, topk_idx, topk_weights, (w13_fp8, w13_scales, w2_fp8, w2_scales), out)
    # The workspace now holds these weights: a later backward of a bf16-weight forward runs that forward again.
    state.latest_forward[x[0].device.index] = None
    if _host_may_wait():
        _backend.synchronize_and_check(state, x[0].device)
    return out


@_moe_forward_fp8_weights.register_fake
def _(key, config, x, topk_idx, topk_weights, w13_fp8, w13_scales, w2_fp8, w2_scales):
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, None, None)
    _check_fp8_weights(cfg, x[0].device, w13_fp8, w13_scales, w2_fp8, w2_scales)
    return [torch.empty_like(xi) for xi in x]


@_moe_forward.register_fake
def _(key, config, x, topk_idx, topk_weights, w13, w2):
    _check_inputs(LayerConfig.from_list(config), x, topk_idx, topk_weights, w13, w2)
    return [torch.empty_like(xi) for xi in x]


def _run_backward(key, cfg, d_out, x, topk_idx, topk_weights, w13, w2, d_w13, d_w2, accumulate=False,
                  d_x=None, d_topk_weights=None) -> tuple[list, list]:
    """The backward of the forward on these inputs into the weight-gradient buffers d_w13 / d_w2 (one per rank,
    the shapes of w13 / w2; fp32, or bf16 in either precision; added to them with accumulate); returns d_x and
    d_topk_weights (written into the given lists of tensors, or new ones)."""
    state = _state(key, cfg)
    if state.latest_forward.get(x[0].device.index) != _forward_key(x, topk_idx, topk_weights, w13, w2):
        _run_forward(key, cfg, x, topk_idx, topk_weights, w13, w2)  # restores this forward's routing
    if d_x is None:
        d_x = [torch.empty_like(xi) for xi in x]
    if d_topk_weights is None:
        d_topk_weights = [torch.empty_like(wi) for wi in topk_weights]
    _backend.backward(state, d_out, d_x, d_topk_weights, d_w13, d_w2, accumulate)
    if _host_may_wait():
        _backend.synchronize_and_check(state, x[0].device)
    return d_x, d_topk_weights


@torch.library.custom_op("megamoe::moe_backward", mutates_args=())
def _moe_backward(key: int, config: list[int], d_out: list[Tensor], x: list[Tensor], topk_idx: list[Tensor],
                  topk_weights: list[Tensor], w13: list[Tensor], w2: list[Tensor]
                  ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, w13, w2, d_out)
    d_w13 = [torch.empty_like(wi) for wi in w13]
    d_w2 = [torch.empty_like(wi) for wi in w2]
    d_x, d_topk_weights = _run_backward(key, cfg, d_out, x, topk_idx, topk_weights, w13, w2, d_w13, d_w2)
    return d_x, d_topk_weights, d_w13, d_w2


@_moe_backward.register_fake
def _(key, config, d_out, x, topk_idx, topk_weights, w13, w2):
    _check_inputs(LayerConfig.from_list(config), x, topk_idx, topk_weights, w13, w2, d_out)
    return ([torch.empty_like(xi) for xi in x], [torch.empty_like(wi) for wi in topk_weights],
            [torch.empty_like(wi) for wi in w13], [torch.empty_like(wi) for wi in w2])


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
    return None, None, d_x, [None] * r, d_w, d_w13, d_w2


_moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- virtual ranks whose experts live in one tensor (MegaMoE with virtual_ranks) ----
# The same layer with w13 [E, 2I, H] and w2 [E, H, I] holding every rank's experts: each rank's weights are a
# view, and the backward writes one gradient tensor for all of them. Slicing the parameter per rank in front
# of moe_forward instead makes autograd give every slice's gradient back as a zero-filled full-size tensor
# and add them up (R full-size fills, copies and adds per step).

def _rank_views(cfg: LayerConfig, *tensors: Tensor) -> list[list[Tensor]]:
    """Each [E, ...] tensor as R views of its ranks' experts [E/R, ...] (contiguous when it is)."""
    for t in tensors:
        if not isinstance(t, Tensor) or t.dim() < 1 or t.shape[0] != cfg.num_experts:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"megamoe: the experts' weights must hold all E={cfg.num_experts} experts in their "
                             f"first dimension, got {shape}")
    per = cfg.experts_per_rank
    return [[t[r * per:(r + 1) * per] for r in range(cfg.num_ranks)] for t in tensors]


def _check_main_grads(w13: Tensor, w2: Tensor, main_grad13: Tensor | None, main_grad2: Tensor | None) -> None:
    """The fp32 buffers the weight gradients are added to: both or neither, each shaped like its weight."""
    if (main_grad13 is None) != (main_grad2 is None):
        raise ValueError("megamoe: the main gradients of w13 and w2 come together (both or neither)")
    for name, grad, weight in (("w13", main_grad13, w13), ("w2", main_grad2, w2)):
        if grad is None:
            continue
        if not isinstance(grad, Tensor) or grad.dtype != torch.float32:
            raise TypeError(f"megamoe: {name}.main_grad must be a torch.float32 tensor, got "
                            f"{getattr(grad, 'dtype', type(grad).__name__)}")
        if tuple(grad.shape) != tuple(weight.shape) or grad.device != weight.device:
            raise ValueError(f"megamoe: {name}.main_grad must have {name}'s shape {list(weight.shape)} and device "
                             f"{weight.device}, got {list(grad.shape)} on {grad.device}")
        address = _address(grad)
        if not grad.is_contiguous() or (address is not None and address % 16):
            raise ValueError(f"megamoe: {name}.main_grad must be contiguous and 16-byte aligned")


@torch.library.custom_op("megamoe::moe_forward_all_experts", mutates_args=())
def _moe_forward_all_experts(key: int, config: list[int], x: list[Tensor], topk_idx: list[Tensor],
                             topk_weights: list[Tensor], w13: Tensor, w2: Tensor,
                             main_grad13: Optional[Tensor] = None,
                             main_grad2: Optional[Tensor] = None) -> list[Tensor]:
    cfg = LayerConfig.from_list(config)
    w13s, w2s = _rank_views(cfg, w13, w2)
    _check_inputs(cfg, x, topk_idx, topk_weights, w13s, w2s)
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    return _run_forward(key, cfg, x, topk_idx, topk_weights, w13s, w2s)


@_moe_forward_all_experts.register_fake
def _(key, config, x, topk_idx, topk_weights, w13, w2, main_grad13=None, main_grad2=None):
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, *_rank_views(cfg, w13, w2))
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    return [torch.empty_like(xi) for xi in x]


@torch.library.custom_op("megamoe::moe_backward_all_experts", mutates_args=())
def _moe_backward_all_experts(key: int, config: list[int], d_out: list[Tensor], x: list[Tensor],
                              topk_idx: list[Tensor], topk_weights: list[Tensor], w13: Tensor, w2: Tensor
                              ) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    cfg = LayerConfig.from_list(config)
    w13s, w2s = _rank_views(cfg, w13, w2)
    _check_inputs(cfg, x, topk_idx, topk_weights, w13s, w2s, d_out)
    d_w13 = torch.empty_like(w13)
    d_w2 = torch.empty_like(w2)
    d_w13s, d_w2s = _rank_views(cfg, d_w13, d_w2)
    d_x, d_topk_weights = _run_backward(key, cfg, d_out, x, topk_idx, topk_weights, w13s, w2s, d_w13s, d_w2s)
    return d_x, d_topk_weights, d_w13, d_w2


@_moe_backward_all_experts.register_fake
def _(key, config, d_out, x, topk_idx, topk_weights, w13, w2):
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, *_rank_views(cfg, w13, w2), d_out)
    return ([torch.empty_like(xi) for xi in x], [torch.empty_like(wi) for wi in topk_weights],
            torch.empty_like(w13), torch.empty_like(w2))


@torch.library.custom_op("megamoe::moe_backward_into_main_grads",
                         mutates_args=("d_x", "d_topk_weights", "main_grad13", "main_grad2"))
def _moe_backward_into_main_grads(key: int, config: list[int], d_out: list[Tensor], x: list[Tensor],
                                  topk_idx: list[Tensor], topk_weights: list[Tensor], w13: Tensor, w2: Tensor,
                                  main_grad13: Tensor, main_grad2: Tensor, d_x: list[Tensor],
                                  d_topk_weights: list[Tensor]) -> None:
    """The backward with the weight gradients added by the GEMMs to the fp32 main gradients (no gradient
    tensor, no conversion, no separate add); d_x and d_topk_weights are written into the caller's tensors
    (a mutating op that returned lists of tensors would not pass torch.compile's functionalization)."""
    cfg = LayerConfig.from_list(config)
    w13s, w2s = _rank_views(cfg, w13, w2)
    _check_inputs(cfg, x, topk_idx, topk_weights, w13s, w2s, d_out)
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    for name, outs, like in (("d_x", d_x, x), ("d_topk_weights", d_topk_weights, topk_weights)):
        if len(outs) != len(like) or any(o.shape != t.shape or o.dtype != t.dtype or not o.is_contiguous()
                                         for o, t in zip(outs, like)):
            raise ValueError(f"megamoe: {name} must hold one contiguous tensor per rank shaped like its input")
    m13s, m2s = _rank_views(cfg, main_grad13, main_grad2)
    _run_backward(key, cfg, d_out, x, topk_idx, topk_weights, w13s, w2s, m13s, m2s, accumulate=True, d_x=d_x,
                  d_topk_weights=d_topk_weights)


@_moe_backward_into_main_grads.register_fake
def _(key, config, d_out, x, topk_idx, topk_weights, w13, w2, main_grad13, main_grad2, d_x, d_topk_weights):
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, x, topk_idx, topk_weights, *_rank_views(cfg, w13, w2), d_out)
    _check_main_grads(w13, w2, main_grad13, main_grad2)


def _grads_of_inputs(ctx, grads: tuple) -> tuple:
    """One gradient per input the op's call recorded: some torch releases record the inputs without the optional
    main-gradient arguments left at their default (and check the backward's result against that), others with
    them; ctx.needs_input_grad has one entry per recorded input either way."""
    return grads[:len(ctx.needs_input_grad)]


def _setup_all_experts_context(ctx, inputs, output):
    key, config, x, topk_idx, topk_weights, w13, w2, *main_grads = inputs
    ctx.key, ctx.config, ctx.ranks = key, config, len(x)
    # The main gradients are kept as they are, not saved: every backward adds to them (bumping their version),
    # and a saved tensor would then fail autograd's version check for the next forward's backward.
    ctx.main_grads = tuple(main_grads) if len(main_grads) == 2 and main_grads[0] is not None else None
    ctx.save_for_backward(*x, *topk_idx, *topk_weights, w13, w2)


def _backward_all_experts(ctx, grads):
    r = ctx.ranks
    saved = ctx.saved_tensors
    x, topk_idx, topk_weights = (list(saved[j * r:(j + 1) * r]) for j in range(3))
    w13, w2 = saved[3 * r], saved[3 * r + 1]
    d_out = [torch.zeros_like(xi) if g is None else g.to(xi.dtype).contiguous() for g, xi in zip(grads, x)]
    if ctx.main_grads is not None:
        # The weight gradients went into the main gradients: the weights' .grad gets nothing.
        d_x = [torch.empty_like(xi) for xi in x]
        d_w = [torch.empty_like(wi) for wi in topk_weights]
        torch.ops.megamoe.moe_backward_into_main_grads(ctx.key, ctx.config, d_out, x, topk_idx, topk_weights, w13,
                                                       w2, *ctx.main_grads, d_x, d_w)
        return _grads_of_inputs(ctx, (None, None, d_x, [None] * r, d_w, None, None, None, None))
    d_x, d_w, d_w13, d_w2 = torch.ops.megamoe.moe_backward_all_experts(ctx.key, ctx.config, d_out, x, topk_idx,
                                                                       topk_weights, w13, w2)
    return _grads_of_inputs(ctx, (None, None, d_x, [None] * r, d_w, d_w13, d_w2, None, None))


_moe_forward_all_experts.register_autograd(_backward_all_experts, setup_context=_setup_all_experts_context)


# ---- the process-group ops (one rank per process) ----

def _tensor_identity(t: Tensor) -> tuple:
    # The storage object, not only the data pointer: every zero-token x has data pointer 0, so pointers
    # alone would call two forwards of a rank with no tokens the same while the ranks that have tokens
    # tell them apart, and only some ranks would re-run the (collective) forward.
    return t.untyped_storage()._cdata, t.storage_offset(), t.data_ptr(), t.shape[0]


def _process_forward_key(x, topk_idx, topk_weights, w13, w2) -> tuple:
    return tuple(_tensor_identity(t) for t in (x, topk_idx, topk_weights, w13, w2))


def _run_process_forward(key, cfg, name, x, topk_idx, topk_weights, w13, w2) -> Tensor:
    state = _state(key, cfg)
    if _host_may_wait():
        check_ids(topk_idx, cfg.num_experts)
    out = torch.empty_like(x)
    _backend.process_forward(state, name, x, topk_idx, topk_weights, w13, w2, out)
    state.latest_forward[(name, x.device.index)] = _process_forward_key(x, topk_idx, topk_weights, w13, w2)
    if _host_may_wait():
        _backend.process_synchronize_and_check(state, name, x.device)
    return out


@torch.library.custom_op("megamoe::moe_process_forward", mutates_args=())
def _moe_process_forward(key: int, config: list[int], group_name: str, x: Tensor, topk_idx: Tensor,
                         topk_weights: Tensor, w13: Tensor, w2: Tensor, main_grad13: Optional[Tensor] = None,
                         main_grad2: Optional[Tensor] = None) -> Tensor:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, [x], [topk_idx], [topk_weights], [w13], [w2], local=True)
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    return _run_process_forward(key, cfg, group_name, x, topk_idx, topk_weights, w13, w2)


@_moe_process_forward.register_fake
def _(key, config, group_name, x, topk_idx, topk_weights, w13, w2, main_grad13=None, main_grad2=None):
    _check_inputs(LayerConfig.from_list(config), [x], [topk_idx], [topk_weights], [w13], [w2], local=True)
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    return torch.empty_like(x)


def _run_process_backward(key, cfg, name, d_out, x, topk_idx, topk_weights, w13, w2, d_w13, d_w2,
                          accumulate=False) -> tuple[Tensor, Tensor]:
    """This rank's backward into the weight-gradient buffers (fp32, or bf16 in either precision; added to them with
    accumulate); returns d_x and d_topk_weights."""
    state = _state(key, cfg)
    if state.latest_forward.get((name, x.device.index)) != _process_forward_key(x, topk_idx, topk_weights, w13, w2):
        _run_process_forward(key, cfg, name, x, topk_idx, topk_weights, w13, w2)
    d_x = torch.empty_like(x)
    d_topk_weights = torch.empty_like(topk_weights)
    _backend.process_backward(state, name, d_out, d_x, d_topk_weights, d_w13, d_w2, accumulate)
    if _host_may_wait():
        _backend.process_synchronize_and_check(state, name, x.device)
    return d_x, d_topk_weights


@torch.library.custom_op("megamoe::moe_process_backward", mutates_args=())
def _moe_process_backward(key: int, config: list[int], group_name: str, d_out: Tensor, x: Tensor, topk_idx: Tensor,
                          topk_weights: Tensor, w13: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, [x], [topk_idx], [topk_weights], [w13], [w2], [d_out], local=True)
    d_w13 = torch.empty_like(w13)
    d_w2 = torch.empty_like(w2)
    d_x, d_topk_weights = _run_process_backward(key, cfg, group_name, d_out, x, topk_idx, topk_weights, w13, w2,
                                                d_w13, d_w2)
    return d_x, d_topk_weights, d_w13, d_w2


@torch.library.custom_op("megamoe::moe_process_backward_into_main_grads", mutates_args=("main_grad13", "main_grad2"))
def _moe_process_backward_into_main_grads(key: int, config: list[int], group_name: str, d_out: Tensor, x: Tensor,
                                          topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                                          main_grad13: Tensor, main_grad2: Tensor) -> tuple[Tensor, Tensor]:
    cfg = LayerConfig.from_list(config)
    _check_inputs(cfg, [x], [topk_idx], [topk_weights], [w13], [w2], [d_out], local=True)
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    return _run_process_backward(key, cfg, group_name, d_out, x, topk_idx, topk_weights, w13, w2, main_grad13,
                                 main_grad2, accumulate=True)


@_moe_process_backward_into_main_grads.register_fake
def _(key, config, group_name, d_out, x, topk_idx, topk_weights, w13, w2, main_grad13, main_grad2):
    _check_inputs(LayerConfig.from_list(config), [x], [topk_idx], [topk_weights], [w13], [w2], [d_out], local=True)
    _check_main_grads(w13, w2, main_grad13, main_grad2)
    return torch.empty_like(x), torch.empty_like(topk_weights)


@_moe_process_backward.register_fake
def _(key, config, group_name, d_out, x, topk_idx, topk_weights, w13, w2):
    _check_inputs(LayerConfig.from_list(config), [x], [topk_idx], [topk_weights], [w13], [w2], [d_out], local=True)
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2)


def _setup_process_context(ctx, inputs, output):
    key, config, name, x, topk_idx, topk_weights, w13, w2, *main_grads = inputs
    ctx.key, ctx.config, ctx.group_name = key, config, name
    # Not saved, as in _setup_all_experts_context: every backward adds to them.
    ctx.main_grads = tuple(main_grads) if len(main_grads) == 2 and main_grads[0] is not None else None
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2)


def _process_backward(ctx, grad):
    x, topk_idx, topk_weights, w13, w2 = ctx.saved_tensors
    # Zeros rather than skipping: the backward is collective, so this rank must take part regardless.
    d_out = torch.zeros_like(x) if grad is None else grad.to(x.dtype).contiguous()
    if ctx.main_grads is not None:
        d_x, d_w = torch.ops.megamoe.moe_process_backward_into_main_grads(ctx.key, ctx.config, ctx.group_name, d_out,
                                                                          x, topk_idx, topk_weights, w13, w2,
                                                                          *ctx.main_grads)
        return _grads_of_inputs(ctx, (None, None, None, d_x, None, d_w, None, None, None, None))
    d_x, d_w, d_w13, d_w2 = torch.ops.megamoe.moe_process_backward(ctx.key, ctx.config, ctx.group_name, d_out, x,
                                                                   topk_idx, topk_weights, w13, w2)
    return _grads_of_inputs(ctx, (None, None, None, d_x, None, d_w, d_w13, d_w2, None, None))


_moe_process_forward.register_autograd(_process_backward, setup_context=_setup_process_context)


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
    """R virtual ranks on one GPU: one tensor per rank in each list (the shapes of docs/MODEL.md; rank r holds
    experts [r*E/R, (r+1)*E/R), ids are global). Differentiable in x, topk_weights, w13 and w2."""
    return torch.ops.megamoe.moe_forward(_key_for(config, key), config.as_list(), list(x), list(topk_idx),
                                         list(topk_weights), list(w13), list(w2))


def moe_ranks_fp8_weights(x: list[Tensor], topk_idx: list[Tensor], topk_weights: list[Tensor],
                          w13_fp8: list[Tensor], w13_scales: list[Tensor], w2_fp8: list[Tensor],
                          w2_scales: list[Tensor], *, config: LayerConfig, key: int | None = None) -> list[Tensor]:
    """moe_ranks of an fp8 layer on weights already quantized (an FP8 checkpoint: DeepSeek-V3's format, e4m3
    codes with one fp32 scale per 128 x 128 block): per rank, w13_fp8 [E_local, 2I, H] and w2_fp8
    [E_local, H, I] (torch.float8_e4m3fn or uint8), w13_scales [E_local, 2I / 128, H / 128] and w2_scales
    [E_local, H / 128, I / 128] (fp32); reference.quantize_128x128 makes them from bf16 weights, and
    reference.moe_ranks_fp8(..., weights_quantized=True) on reference.dequantize_128x128's values is the
    oracle. The forward only: there are no bf16 weights to differentiate, and no gradient of x or
    topk_weights is offered either (run it under torch.no_grad() or torch.inference_mode())."""
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in [*x, *topk_weights]):
        raise NotImplementedError("megamoe: moe_ranks_fp8_weights runs the forward only (no gradients); run it "
                                  "under torch.no_grad() or torch.inference_mode()")
    return torch.ops.megamoe.moe_forward_fp8_weights(_key_for(config, key), config.as_list(), list(x),
                                                     list(topk_idx), list(topk_weights), list(w13_fp8),
                                                     list(w13_scales), list(w2_fp8), list(w2_scales))


def moe_ranks_all_experts(x: list[Tensor], topk_idx: list[Tensor], topk_weights: list[Tensor], w13: Tensor,
                          w2: Tensor, *, config: LayerConfig, key: int | None = None,
                          main_grads: tuple[Tensor, Tensor] | None = None) -> list[Tensor]:
    """moe_ranks with every rank's experts in one tensor each: w13 [E, 2I, H], w2 [E, H, I] (rank r's are
    experts [r*E/R, (r+1)*E/R)); their gradients come back as one tensor each, not one per rank.

    main_grads=(g13, g2), fp32 tensors shaped like w13 and w2: the backward adds the weight gradients to them
    (in the GEMMs' epilogues: no gradient tensor, no conversion, no separate add kernel) and gives w13 and w2
    no gradient through autograd (gradient accumulation over micro-batches with fp32 main gradients, as
    Megatron-style trainers keep them in `param.main_grad`)."""
    g13, g2 = main_grads if main_grads is not None else (None, None)
    return torch.ops.megamoe.moe_forward_all_experts(_key_for(config, key), config.as_list(), list(x),
                                                     list(topk_idx), list(topk_weights), w13, w2, g13, g2)


def moe(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, *,
        config: LayerConfig, key: int | None = None, group=None) -> Tensor:
    """Without group: one rank holding every expert (config.num_ranks == 1).

    With group (a torch.distributed ProcessGroup of config.num_ranks processes, one GPU each): this process's
    rank, holding its tokens x [T, H] (T may differ between ranks) and its experts [rank*E/R, (rank+1)*E/R)
    as w13 [E/R, 2I, H] and w2 [E/R, H, I]; ids are global. Collective (see the module docstring)."""
    if group is not None:
        name = group_name(group)
        _check_group_size(config, group)
        return _moe_process(x, topk_idx, topk_weights, w13, w2, config=config, key=key, name=name)
    if config.num_ranks != 1:
        raise ValueError(f"megamoe.ops.moe is the single-rank layer; config has num_ranks={config.num_ranks}: "
                         f"use moe_ranks, or pass group= for one rank per process")
    return moe_ranks([x], [topk_idx], [topk_weights], [w13], [w2], config=config, key=key)[0]


def _moe_process(x, topk_idx, topk_weights, w13, w2, *, config: LayerConfig, key: int | None, name: str,
                 main_grads: tuple[Tensor, Tensor] | None = None) -> Tensor:
    g13, g2 = main_grads if main_grads is not None else (None, None)
    return torch.ops.megamoe.moe_process_forward(_key_for(config, key), config.as_list(), name, x, topk_idx,
                                                 topk_weights, w13, w2, g13, g2)


def synchronize_and_check(layer=None, key: int | None = None, device=None, group=None) -> None:
    """Waits for megamoe's GPU work and raises MegaMoEError for the first error the GPU recorded (bad expert
    id, capacity, timeout), clearing it.

    layer: a MegaMoE module (its own layer state, on its process group if it has one); a LayerConfig (the
    layer of that config under `key`, or the default key that moe()/moe_ranks() use without one; with group:
    this process's rank of it); or None: every layer state of this process, on `device` or on every device.
    A layer that has not run on the device yet has nothing to check."""
    if layer is None:
        _check_all(None if device is None else torch.device(device))
        return
    config = getattr(layer, "config", layer)
    if not isinstance(config, LayerConfig):
        raise TypeError(f"megamoe.synchronize_and_check takes a MegaMoE module, a LayerConfig or None, got "
                        f"{type(layer).__name__}")
    if config is not layer:  # a module: its own key, group and device
        key, group = layer._key, layer.group if group is None else group
        device = layer.w13.device if device is None else device
    state = _state(_key_for(config, key), config)
    if device is None:
        if not torch.cuda.is_available():
            return  # no GPU: nothing can have run
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if group is not None:
        _backend.process_synchronize_and_check(state, group_name(group), device)
    else:
        _backend.synchronize_and_check(state, device)


def _check_all(device) -> None:
    with _states_lock:
        states = list(_states.values())
    for state in states:
        groups = [*state.groups.items(), *((index, g) for (_, index), g in state.process_groups.items())]
        for index, g in groups:
            if device is None or device.index in (None, index):
                g.synchronize_and_check()
