"""megamoe as a Hugging Face transformers experts implementation.

    import megamoe.integrations.transformers    # registers "megamoe" (once per process, before loading)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="megamoe")

transformers 5.x runs the experts of its MoE models (Qwen3-MoE, DeepSeek-V3, ...) through
`transformers.integrations.moe.ExpertsInterface`: the experts module holds gate_up_proj [E, 2I, H] (the
gate rows first) and down_proj [E, H, I], which is megamoe's own w13 / w2 layout, and hands the registered
function (module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]). `experts_forward` runs
that call on megamoe's one-rank GPU layer, differentiable in the hidden states, the routing weights and
both weights. What it does with what transformers passes:

- Routing weights of any floating dtype (Qwen3-MoE's router returns them in the model's dtype, bf16):
  used in fp32; their gradient goes back in the dtype they came in.
- Hidden states in another dtype than bf16 are cast to bf16 and the output back. Expert weights that are
  not bf16 are cast to bf16 on every call (a copy each time; a warning says so once).
- Expert ids >= the module's num_experts are the sentinels transformers' expert parallelism writes into
  the slots of experts that live on other ranks: they become masked slots (id -1): no contribution to the
  output and a zero routing-weight gradient.
- Token capacity: the library sizes its buffers for max_tokens_per_rank tokens. Each experts module gets a
  layer state sized for its first batch (rounded up to a multiple of CAPACITY_ALIGNMENT). A later, larger
  batch replaces it with one sized for that batch, at least GROWTH times the old capacity, and warns; the
  replacement waits once for the GPU to finish with the old state and cannot happen while a CUDA graph is
  being captured. `set_max_tokens(model, n)` sizes every experts module up front and turns a larger batch
  into an error instead.
- Refused with a message naming the module and the reason: biases, transposed weights, interleaved gate /
  up rows, experts without a gate, a custom gating function (`_apply_gate`), an activation other than
  SiLU, a norm after each expert. megamoe's own rules apply too (H and I multiples of 128, CUDA tensors).

Under transformers' expert parallelism (its all-to-all moves the tokens between ranks), each rank's experts
module holds its local experts and megamoe runs them as a one-rank layer. The calls add no host
synchronisation of their own; megamoe's debug checks do (off with megamoe.set_debug_checks(False)).
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch import nn

from .. import ops

__all__ = ["NAME", "CAPACITY_ALIGNMENT", "GROWTH", "register", "experts_forward", "set_max_tokens", "release",
           "experts_modules", "unsupported_reason"]

NAME = "megamoe"
# Multiples of 256 tokens: a batch size that wobbles by a few tokens never recreates the layer.
CAPACITY_ALIGNMENT = 256
# A layer that has to grow grows by at least this factor, so a batch that creeps upwards recreates it a
# logarithmic number of times, not once per step.
GROWTH = 1.25
# The library's limit on tokens per rank and call (validate() of the C++ config).
MAX_TOKENS = 1 << 20

_STATE_ATTR = "_megamoe_capacity"
_lock = threading.Lock()
_warned_casts: set[type] = set()


def register(name: str = NAME) -> None:
    """Registers experts_forward under `name` in transformers' ExpertsInterface (idempotent); importing this
    module does it for NAME."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        import importlib.metadata

        try:
            found = "transformers " + importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            found = "no transformers"
        raise ImportError(f"megamoe.integrations.transformers needs transformers 5.x (its ExpertsInterface); "
                          f"found {found}") from e
    ExpertsInterface.register(name, experts_forward)


# ---- what megamoe can run ----

def _default_apply_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate as default
    except ImportError:  # a transformers without a pluggable gate: every experts class gates the default way
        return None
    return default


def _is_silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    if act is None:
        name = getattr(getattr(module, "config", None), "hidden_act", None)
        return isinstance(name, str) and name.lower() in ("silu", "swish")
    if isinstance(act, nn.SiLU) or act is torch.nn.functional.silu:
        return True
    # transformers' own SiLU module (ACT2FN["silu"]) is not an nn.SiLU subclass.
    return type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers")


def unsupported_reason(module: nn.Module) -> str | None:
    """Why megamoe cannot run this experts module (None when it can)."""
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            return f"it has no 3-D {name} weight (megamoe runs gate_up_proj [E, 2I, H] and down_proj [E, H, I])"
    if not getattr(module, "has_gate", True):
        return "its experts have no gate (megamoe runs gated SwiGLU experts)"
    if getattr(module, "has_bias", False):
        return "its experts have biases"
    if getattr(module, "is_transposed", False):
        return "it stores its weights transposed (gate_up_proj [E, H, 2I])"
    if not getattr(module, "is_concatenated", True):
        return "it interleaves the gate and up rows (megamoe needs all gate rows, then all up rows)"
    if getattr(module, "has_post_expert_norm", False):
        return "it applies a norm after each expert"
    default_gate = _default_apply_gate()
    gate = getattr(type(module), "_apply_gate", None)
    if default_gate is not None and gate is not None and gate is not default_gate:
        return "it overrides the gating function (_apply_gate), megamoe computes silu(gate) * up"
    if not _is_silu(module):
        act = getattr(module, "act_fn", None)
        what = type(act).__name__ if act is not None else getattr(getattr(module, "config", None), "hidden_act", "?")
        return f"its activation is {what}, megamoe computes silu(gate) * up"
    return None


def _check_supported(module: nn.Module) -> None:
    reason = unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"experts_implementation='{NAME}' cannot run {type(module).__name__}: {reason}; use another "
                         f"experts_implementation (e.g. 'grouped_mm') for this model")


# ---- token capacity: one layer state per experts module and shape ----

class _Capacity:
    """The megamoe layers of one experts module: (H, I, E, K) -> (key, LayerConfig). Copies of the module
    (deepcopy, pickling) get a fresh one: a key names GPU state that belongs to one module."""

    def __init__(self, module: nn.Module | None, fixed: int | None = None):
        self.owner = weakref.ref(module) if module is not None else (lambda: None)
        self.fixed = fixed
        self.layers: dict[tuple[int, int, int, int], tuple[int, ops.LayerConfig]] = {}
        # Every key this module ever used, released with the module; a key retired by growth can come back
        # to life when the backward of an older forward still runs on it.
        self.keys: list[int] = []
        if module is not None:
            weakref.finalize(module, _release_keys, self.keys)

    def __getstate__(self):
        return {"fixed": self.fixed}

    def __setstate__(self, state):
        self.__init__(None, state.get("fixed"))


def _release_keys(keys: list[int]) -> None:
    for key in keys:
        ops.release(key)


def _capacity(module: nn.Module) -> _Capacity:
    cap = module.__dict__.get(_STATE_ATTR)
    if cap is None or cap.owner() is not module:
        cap = _Capacity(module, None if cap is None else cap.fixed)
        module.__dict__[_STATE_ATTR] = cap
    return cap


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _layer(module: nn.Module, hidden: int, inter: int, experts: int, top_k: int, tokens: int
           ) -> tuple[int, ops.LayerConfig]:
    # The common case, lock-free and plain attribute reads, so that torch.compile traces through it: this
    # module already has a layer of this shape that holds the batch.
    cap = getattr(module, _STATE_ATTR, None)
    if cap is not None and cap.owner() is module:
        entry = cap.layers.get((hidden, inter, experts, top_k))
        if entry is not None and tokens <= entry[1].max_tokens_per_rank:
            return entry
    return _new_layer(module, hidden, inter, experts, top_k, tokens)


@torch.compiler.disable
def _new_layer(module: nn.Module, hidden: int, inter: int, experts: int, top_k: int, tokens: int
               ) -> tuple[int, ops.LayerConfig]:
    with _lock:
        cap = _capacity(module)
        shape = (hidden, inter, experts, top_k)
        entry = cap.layers.get(shape)
        if entry is not None and tokens <= entry[1].max_tokens_per_rank:
            return entry  # another thread made it
        name = type(module).__name__
        if tokens > MAX_TOKENS:
            raise ValueError(f"megamoe: {name} got {tokens} tokens in one call, more than the library's "
                             f"{MAX_TOKENS}; use smaller batches")
        if cap.fixed is not None:
            if tokens > cap.fixed:
                raise ValueError(f"megamoe: {name} got {tokens} tokens, more than the {cap.fixed} that "
                                 f"set_max_tokens gave it; raise it with set_max_tokens(model, n)")
            capacity = cap.fixed
        elif entry is None:
            capacity = min(MAX_TOKENS, _round_up(max(tokens, 1), CAPACITY_ALIGNMENT))
        else:
            grown = max(tokens, int(entry[1].max_tokens_per_rank * GROWTH))
            capacity = min(MAX_TOKENS, _round_up(grown, CAPACITY_ALIGNMENT))
        if entry is not None:
            old = entry[1].max_tokens_per_rank
            if _capturing():
                raise RuntimeError(f"megamoe: {name} got {tokens} tokens during CUDA graph capture, more than its "
                                   f"layer holds ({old}); run the largest batch once before capturing, or size "
                                   f"it with set_max_tokens(model, n)")
            warnings.warn(f"megamoe: {name} got a batch of {tokens} tokens, more than its layer holds ({old}); "
                          f"recreating it for {capacity} tokens (set_max_tokens(model, n) sizes it up front)",
                          stacklevel=4)
            ops.release(entry[0])  # waits for the old state's work; its memory goes back before the new one
        config = ops.LayerConfig(hidden=hidden, intermediate=inter, num_experts=experts, top_k=top_k,
                                 max_tokens_per_rank=capacity)
        try:
            config.validate()
        except ops.MegaMoEError as e:
            raise ValueError(f"megamoe cannot run {name} (H={hidden}, I={inter}, E={experts}, K={top_k}): {e}") from e
        key = ops.new_key()
        cap.keys.append(key)
        cap.layers[shape] = (key, config)
        return key, config


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of a transformers model (those with gate_up_proj / down_proj that the experts
    interface dispatches)."""
    return [m for m in model.modules()
            if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "has_gate")]


def set_max_tokens(model: nn.Module, tokens: int | None) -> int:
    """Sizes the megamoe layers of every experts module in model (or model itself) for `tokens` tokens per
    call (batch x sequence on this rank) and makes a larger batch an error; None goes back to automatic
    sizing. The layers are created at that size on their next call. Returns how many modules it set."""
    if tokens is not None and not (isinstance(tokens, int) and 1 <= tokens <= MAX_TOKENS):
        raise ValueError(f"megamoe: set_max_tokens needs a whole number of tokens in [1, {MAX_TOKENS}] or None, "
                         f"got {tokens!r}")
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"megamoe: {type(model).__name__} has no experts module (gate_up_proj and down_proj)")
    for module in modules:
        release(module)
        with _lock:
            _capacity(module).fixed = tokens
    return len(modules)


def release(model: nn.Module) -> None:
    """Frees the GPU state of every experts module in model; the next call creates it again."""
    for module in experts_modules(model) or [model]:
        with _lock:
            cap = module.__dict__.get(_STATE_ATTR)
            if cap is None or cap.owner() is not module:
                continue
            keys = [key for key, _ in cap.layers.values()]
            cap.layers.clear()
        for key in keys:
            ops.release(key)


# ---- the experts function ----

def _local(weight: torch.Tensor) -> torch.Tensor:
    # A DTensor parameter (transformers' expert sharding, FSDP2 outside its forward hooks): this rank's
    # shard, differentiably.
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


def _as_bf16_weight(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.bfloat16:
        return weight
    if type(module) not in _warned_casts:
        _warned_casts.add(type(module))
        warnings.warn(f"megamoe: {type(module).__name__}'s expert weights are {weight.dtype}; megamoe computes in "
                      f"bf16 and casts them on every call (load the model with dtype=torch.bfloat16 to avoid the "
                      f"copies)", stacklevel=3)
    return weight.to(torch.bfloat16)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ExpertsInterface function: `self` is the experts module; returns the weighted sum of the experts'
    outputs per token, in hidden_states' dtype and shape."""
    _check_supported(self)
    w13 = _local(self.gate_up_proj)
    w2 = _local(self.down_proj)
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    name = type(self).__name__
    if two_i % 2 or tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"megamoe: {name} has gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)}; "
                         f"megamoe needs [E, 2I, H] and [E, H, I]")
    if getattr(self, "num_experts", experts) != experts:
        raise ValueError(f"megamoe: {name}.num_experts is {self.num_experts} but its gate_up_proj holds {experts} "
                         f"experts on this rank")
    if hidden_states.shape[-1] != hidden:
        raise ValueError(f"megamoe: {name} got hidden states of width {hidden_states.shape[-1]}, its experts take "
                         f"{hidden}")
    x = hidden_states.reshape(-1, hidden)
    tokens = x.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"megamoe: {name} needs top_k_index and top_k_weights of shape [T, K] with T={tokens}, got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise TypeError(f"megamoe: {name} needs integer expert ids, got {top_k_index.dtype}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"megamoe: {name} needs floating-point routing weights, got {top_k_weights.dtype}")
    top_k = top_k_index.shape[1]

    ids = top_k_index if top_k_index.dtype in (torch.int64, torch.int32) else top_k_index.long()
    # Sentinels (>= E) mark slots routed to other ranks' experts: masked slots for megamoe. Elementwise on
    # the device, no host synchronisation.
    ids = torch.where(ids >= experts, -1, ids).contiguous()
    weights = top_k_weights.float().contiguous()
    x = x.to(torch.bfloat16).contiguous()
    w13 = _as_bf16_weight(self, w13).contiguous()
    w2 = _as_bf16_weight(self, w2).contiguous()

    key, config = _layer(self, hidden, inter, experts, top_k, tokens)
    out = ops.moe(x, ids, weights, w13, w2, config=config, key=key)
    return out.to(hidden_states.dtype).reshape(hidden_states.shape)


register()
