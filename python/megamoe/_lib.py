"""ctypes binding of the C ABI (include/megamoe/megamoe.h).

Why ctypes over a C ABI rather than a torch C++ extension: the C++ core stays free of PyTorch and of the
Python ABI, so one libmegamoe build serves every Python and torch version, the package needs no torch
headers at build time, and a torch upgrade never forces a rebuild. The price is that tensors cross as
raw device pointers, so ops.py checks every tensor before a pointer leaves Python.

The library is loaded lazily: `import megamoe` (and megamoe.reference) works without it.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
import warnings

ABI_VERSION = 5

OK = 0
INVALID_ARGUMENT = 1
CAPACITY_EXCEEDED = 2
TIMEOUT = 3
CUDA_ERROR = 4
NOT_SUPPORTED = 5
INTERNAL = 6

PRECISION_BF16 = 0
PRECISION_FP8_BLOCKWISE = 1


class MegaMoEError(RuntimeError):
    """A non-OK status from libmegamoe; `code` is the MEGAMOE_* status code."""

    def __init__(self, code: int, name: str, message: str):
        super().__init__(f"{name}: {message}" if message else name)
        self.code = code


class Config(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("num_ranks", ctypes.c_int64),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("precision", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


FORWARD_MODULAR = 0  # megamoe_options.forward_path (MEGAMOE_FORWARD_*)
FORWARD_FUSED = 1
BACKWARD_MODULAR = 0  # megamoe_options.backward_path (MEGAMOE_BACKWARD_*)
BACKWARD_FUSED = 1


class Options(ctypes.Structure):
    _fields_ = [
        ("expert_row_capacity", ctypes.c_int64),
        ("wait_timeout_seconds", ctypes.c_double),
        ("forward_path", ctypes.c_int32),  # 0: modular, 1: fused
        ("recompute_h", ctypes.c_int32),   # 0: the forward keeps h, 1: the backward recomputes it
        ("backward_path", ctypes.c_int32),  # 0: modular, 1: fused
        ("reserved", ctypes.c_int32),
    ]


class ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("num_tokens", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("topk_idx", ctypes.c_void_p),
        ("topk_idx_is_int32", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("topk_weights", ctypes.c_void_p),
        ("w13", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("weights_version", ctypes.c_uint64),  # fp8-blockwise layers: 0 = quantize the weights on every call
        # fp8-blockwise, optional: pre-quantized weights (codes and scales, all four or none; ABI version 4)
        ("w13_fp8", ctypes.c_void_p),
        ("w13_scales", ctypes.c_void_p),
        ("w2_fp8", ctypes.c_void_p),
        ("w2_scales", ctypes.c_void_p),
    ]


class BackwardArgs(ctypes.Structure):
    _fields_ = [
        ("d_out", ctypes.c_void_p),
        ("d_x", ctypes.c_void_p),
        ("d_topk_weights", ctypes.c_void_p),
        ("d_w13", ctypes.c_void_p),
        ("d_w2", ctypes.c_void_p),
        ("accumulate_weight_grads", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("d_w13_bf16", ctypes.c_void_p),  # since ABI version 5
        ("d_w2_bf16", ctypes.c_void_p),
    ]


BOOTSTRAP_ID_BYTES = 128


class BootstrapId(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * BOOTSTRAP_ID_BYTES)]


_P = ctypes.POINTER
_SIGNATURES = {
    "megamoe_abi_version": (ctypes.c_int32, []),
    "megamoe_built_with_cuda": (ctypes.c_int32, []),
    "megamoe_private_cxx_runtime": (ctypes.c_int32, []),
    "megamoe_last_error": (ctypes.c_char_p, []),
    "megamoe_status_name": (ctypes.c_char_p, [ctypes.c_int32]),
    "megamoe_default_options": (ctypes.c_int32, [_P(Options)]),
    "megamoe_validate_config": (ctypes.c_int32, [_P(Config)]),
    "megamoe_workspace_bytes": (ctypes.c_int32, [_P(Config), _P(Options), _P(ctypes.c_int64)]),
    "megamoe_vgroup_create": (ctypes.c_int32, [_P(Config), _P(Options), _P(ctypes.c_void_p)]),
    "megamoe_vgroup_destroy": (None, [ctypes.c_void_p]),
    "megamoe_vgroup_num_ranks": (ctypes.c_int32, [ctypes.c_void_p, _P(ctypes.c_int32)]),
    "megamoe_vgroup_expert_row_capacity": (ctypes.c_int32, [ctypes.c_void_p, _P(ctypes.c_int64)]),
    "megamoe_vgroup_forward": (ctypes.c_int32, [ctypes.c_void_p, _P(ForwardArgs), ctypes.c_void_p]),
    "megamoe_vgroup_backward": (ctypes.c_int32, [ctypes.c_void_p, _P(BackwardArgs), ctypes.c_void_p]),
    "megamoe_vgroup_synchronize_and_check": (ctypes.c_int32, [ctypes.c_void_p]),
    "megamoe_create_bootstrap_id": (ctypes.c_int32, [_P(BootstrapId)]),
    "megamoe_pgroup_create": (ctypes.c_int32, [_P(Config), _P(Options), ctypes.c_int32, _P(BootstrapId),
                                               _P(ctypes.c_void_p)]),
    "megamoe_pgroup_destroy": (None, [ctypes.c_void_p]),
    "megamoe_pgroup_rank": (ctypes.c_int32, [ctypes.c_void_p, _P(ctypes.c_int32)]),
    "megamoe_pgroup_num_ranks": (ctypes.c_int32, [ctypes.c_void_p, _P(ctypes.c_int32)]),
    "megamoe_pgroup_expert_row_capacity": (ctypes.c_int32, [ctypes.c_void_p, _P(ctypes.c_int64)]),
    "megamoe_pgroup_forward": (ctypes.c_int32, [ctypes.c_void_p, _P(ForwardArgs), ctypes.c_void_p]),
    "megamoe_pgroup_backward": (ctypes.c_int32, [ctypes.c_void_p, _P(BackwardArgs), ctypes.c_void_p]),
    "megamoe_pgroup_synchronize_and_check": (ctypes.c_int32, [ctypes.c_void_p]),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library_candidates() -> list[pathlib.Path]:
    """Where libmegamoe is looked for: $MEGAMOE_LIBRARY, then the copy installed inside the package."""
    found = []
    env = os.environ.get("MEGAMOE_LIBRARY")
    if env:
        found.append(pathlib.Path(env))
    found.append(pathlib.Path(__file__).resolve().parent / "lib" / "libmegamoe.so")
    return found


def lib() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        # torch first: its CUDA runtime is then the one libmegamoe binds to (same soname), not a second copy.
        import torch  # noqa: F401

        candidates = library_candidates()
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ImportError(
                "libmegamoe.so not found (looked at: " + ", ".join(str(p) for p in candidates) + "); install the "
                "package with `pip install --no-build-isolation --no-deps .` or set MEGAMOE_LIBRARY"
            )
        # RTLD_LOCAL: libmegamoe's symbols (it exports C++ ones too) must never interpose on later libraries.
        handle = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
        missing = [name for name in _SIGNATURES if not hasattr(handle, name)]
        if missing:
            raise ImportError(f"{path} lacks {', '.join(missing)}: a library of another version; reinstall")
        # Every entry point gets its exact C signature before the first call: an unset restype would be
        # read as a C int and an unset argtype would let ctypes guess (truncating pointers to 32 bits).
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = handle.megamoe_abi_version()
        if version != ABI_VERSION:
            raise ImportError(f"{path} has C ABI version {version}, this package needs {ABI_VERSION}; reinstall")
        warning = shared_runtime_warning(bool(handle.megamoe_private_cxx_runtime()), path)
        if warning is not None:
            warnings.warn(warning, RuntimeWarning, stacklevel=2)
        _lib = handle
        return handle


def shared_runtime_warning(private_runtime: bool, path: pathlib.Path) -> str | None:
    """What to say about a library that shares this process's C++ runtime (a plain CMake build): beside
    PyTorch such a library has crashed in its first error message, so results from it are not evidence."""
    if private_runtime:
        return None
    return (f"{path} shares this process's C++ runtime (built without -DMEGAMOE_PRIVATE_CXX_RUNTIME=ON); inside a "
            "PyTorch process two C++ runtimes can mix and crash. Install the package (pip install "
            "--no-build-isolation --no-deps .) or build the library with that option.")


def check(code: int) -> None:
    if code == OK:
        return
    handle = lib()
    message = handle.megamoe_last_error().decode(errors="replace")
    name = handle.megamoe_status_name(code).decode(errors="replace")
    raise MegaMoEError(code, name, message)


def built_with_cuda() -> bool:
    return bool(lib().megamoe_built_with_cuda())


def validate_config(config: Config) -> None:
    check(lib().megamoe_validate_config(ctypes.byref(config)))


def default_options() -> Options:
    options = Options()
    check(lib().megamoe_default_options(ctypes.byref(options)))
    return options


def create_bootstrap_id() -> bytes:
    """A fresh bootstrap id (rank 0 of a process group makes it; every rank passes it to ProcessRankGroup)."""
    bootstrap = BootstrapId()
    check(lib().megamoe_create_bootstrap_id(ctypes.byref(bootstrap)))
    # The struct's whole buffer, not the field: the id is binary, and a c_char array field reads as a
    # string that ends at its first zero byte.
    return bytes(bootstrap)


class _Handle:
    """Owns one library handle, destroyed exactly once: by close() (ops.release, the owning module's
    finalizer) or, failing that, when the object is garbage collected. After close() every method raises
    instead of handing the library a dangling or NULL handle."""

    _destroy_name = ""

    def _adopt(self, library: ctypes.CDLL, handle: ctypes.c_void_p, creator: str) -> None:
        if not handle.value:
            raise MegaMoEError(INTERNAL, "internal error", f"{creator} returned OK but no group")
        # The library object is kept with the handle, so that destroying never depends on module globals
        # (at interpreter shutdown they may already be gone).
        self._lib = library
        self._handle = handle.value  # a plain int: no ctypes object shared with callers

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Destroys the library group (waits for its work first). Idempotent and thread-safe."""
        lock = getattr(self, "_close_lock", None)
        if lock is None:  # __init__ failed before anything was created
            return
        with lock:
            handle, self._handle = self._handle, None
        if handle:
            getattr(self._lib, self._destroy_name)(handle)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter shutdown, ...)
            pass

    def _live(self) -> int:
        handle = self._handle
        if handle is None:
            raise MegaMoEError(INVALID_ARGUMENT, "invalid argument", f"this {type(self).__name__} was closed")
        return handle


class VirtualRankGroup(_Handle):
    """Owns a megamoe_vgroup: R virtual ranks on the current CUDA device, with their symmetric workspace."""

    _destroy_name = "megamoe_vgroup_destroy"

    def __init__(self, config: Config, options: Options | None = None):
        self._handle = None
        self._close_lock = threading.Lock()
        library = lib()
        handle = ctypes.c_void_p()
        check(library.megamoe_vgroup_create(ctypes.byref(config), ctypes.byref(options) if options is not None
                                            else None, ctypes.byref(handle)))
        self._adopt(library, handle, "megamoe_vgroup_create")
        self.config = config

    @property
    def num_ranks(self) -> int:
        n = ctypes.c_int32()
        check(self._lib.megamoe_vgroup_num_ranks(self._live(), ctypes.byref(n)))
        return n.value

    @property
    def expert_row_capacity(self) -> int:
        rows = ctypes.c_int64()
        check(self._lib.megamoe_vgroup_expert_row_capacity(self._live(), ctypes.byref(rows)))
        return rows.value

    def _check_ranks(self, args) -> None:
        if len(args) != self.config.num_ranks:
            raise ValueError(f"megamoe: {len(args)} rank arguments for a group of {self.config.num_ranks} ranks")

    def forward(self, args: list[ForwardArgs], stream: int) -> None:
        self._check_ranks(args)
        array = (ForwardArgs * len(args))(*args)
        check(self._lib.megamoe_vgroup_forward(self._live(), array, stream or None))

    def backward(self, args: list[BackwardArgs], stream: int) -> None:
        self._check_ranks(args)
        array = (BackwardArgs * len(args))(*args)
        check(self._lib.megamoe_vgroup_backward(self._live(), array, stream or None))

    def synchronize_and_check(self) -> None:
        check(self._lib.megamoe_vgroup_synchronize_and_check(self._live()))


class ProcessRankGroup(_Handle):
    """Owns a megamoe_pgroup: this process's rank of a group of config.num_ranks processes (one GPU each).

    Creating it is collective: every rank constructs one with the same config and bootstrap id (from
    create_bootstrap_id on rank 0), and each returns once all have joined and agreed on the layout, or
    raises on every rank (a differing field named, a rank that failed, or a timeout after
    wait_timeout_seconds). close() is collective as well: the workspace is freed once every rank has
    closed its group. Forward/backward take this rank's arguments only, and every rank must make the
    same sequence of calls.
    """

    _destroy_name = "megamoe_pgroup_destroy"

    def __init__(self, config: Config, rank: int, bootstrap_id: bytes, options: Options | None = None):
        self._handle = None
        self._close_lock = threading.Lock()
        if not isinstance(bootstrap_id, (bytes, bytearray)) or len(bootstrap_id) != BOOTSTRAP_ID_BYTES:
            raise ValueError(f"megamoe: a bootstrap id is {BOOTSTRAP_ID_BYTES} bytes (from create_bootstrap_id), "
                             f"got {type(bootstrap_id).__name__} of length {len(bootstrap_id)}")
        library = lib()
        bootstrap = BootstrapId.from_buffer_copy(bytes(bootstrap_id))
        handle = ctypes.c_void_p()
        check(library.megamoe_pgroup_create(ctypes.byref(config), ctypes.byref(options) if options is not None
                                            else None, int(rank), ctypes.byref(bootstrap), ctypes.byref(handle)))
        self._adopt(library, handle, "megamoe_pgroup_create")
        self.config = config

    @property
    def rank(self) -> int:
        n = ctypes.c_int32()
        check(self._lib.megamoe_pgroup_rank(self._live(), ctypes.byref(n)))
        return n.value

    @property
    def num_ranks(self) -> int:
        n = ctypes.c_int32()
        check(self._lib.megamoe_pgroup_num_ranks(self._live(), ctypes.byref(n)))
        return n.value

    @property
    def expert_row_capacity(self) -> int:
        rows = ctypes.c_int64()
        check(self._lib.megamoe_pgroup_expert_row_capacity(self._live(), ctypes.byref(rows)))
        return rows.value

    def forward(self, args: ForwardArgs, stream: int) -> None:
        check(self._lib.megamoe_pgroup_forward(self._live(), ctypes.byref(args), stream or None))

    def backward(self, args: BackwardArgs, stream: int) -> None:
        check(self._lib.megamoe_pgroup_backward(self._live(), ctypes.byref(args), stream or None))

    def synchronize_and_check(self) -> None:
        check(self._lib.megamoe_pgroup_synchronize_and_check(self._live()))
