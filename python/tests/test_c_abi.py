"""The C ABI through ctypes, on any machine that has libmegamoe (CUDA build or not, GPU or not): signatures,
struct layouts, error reporting, and handle lifetime. Runs before test_ops_gpu.py (file order), so a crash in
the library's host paths is told apart from one that follows GPU work."""

import ctypes
import os
import threading

import pytest

from megamoe import _lib, ops


def _library():
    try:
        return _lib.lib()
    except ImportError as e:
        pytest.skip(str(e))


def _config(**changes):
    values = dict(hidden=256, intermediate=256, num_experts=16, top_k=4, max_tokens_per_rank=384, num_ranks=1)
    values.update(changes)
    return ops.LayerConfig(**values)


def test_every_exported_function_has_a_signature():
    library = _library()
    for name, (restype, argtypes) in _lib._SIGNATURES.items():
        fn = getattr(library, name)
        assert fn.restype is restype, name
        assert list(fn.argtypes) == list(argtypes), name
    assert library.megamoe_abi_version() == _lib.ABI_VERSION


def test_struct_sizes_match_the_header():
    # include/megamoe/megamoe.h on LP64 (x86-64, aarch64): checked against the C compiler's offsetof.
    assert ctypes.sizeof(_lib.Config) == 56 and _lib.Config.precision.offset == 48
    assert ctypes.sizeof(_lib.Options) == 32 and _lib.Options.wait_timeout_seconds.offset == 8
    assert _lib.Options.forward_path.offset == 16 and _lib.Options.backward_path.offset == 24
    assert ctypes.sizeof(_lib.ForwardArgs) == 104 and _lib.ForwardArgs.topk_weights.offset == 32
    assert _lib.ForwardArgs.weights_version.offset == 64 and _lib.ForwardArgs.w13_fp8.offset == 72
    assert _lib.ForwardArgs.w2_scales.offset == 96
    assert ctypes.sizeof(_lib.BackwardArgs) == 64 and _lib.BackwardArgs.accumulate_weight_grads.offset == 40
    assert _lib.BackwardArgs.d_w13_bf16.offset == 48 and _lib.BackwardArgs.d_w2_bf16.offset == 56
    assert ctypes.sizeof(_lib.BootstrapId) == _lib.BOOTSTRAP_ID_BYTES == 128


def test_a_library_sharing_the_cxx_runtime_is_named_in_a_warning(tmp_path):
    said = _lib.shared_runtime_warning(False, tmp_path / "libmegamoe.so")
    assert "MEGAMOE_PRIVATE_CXX_RUNTIME" in said and str(tmp_path) in said
    assert _lib.shared_runtime_warning(True, tmp_path / "libmegamoe.so") is None


def test_the_installed_library_carries_its_own_cxx_runtime():
    """The package's own copy must be built with MEGAMOE_PRIVATE_CXX_RUNTIME (pyproject.toml): beside PyTorch a
    library sharing the process's C++ runtime has crashed."""
    library = _library()
    if os.environ.get("MEGAMOE_LIBRARY"):
        pytest.skip("MEGAMOE_LIBRARY names a library of the caller's choosing, not the package's")
    assert library.megamoe_private_cxx_runtime() == 1


@pytest.mark.parametrize("changes, match", [
    (dict(hidden=100), "hidden \\(H\\) must be a multiple of 128, got 100"),
    (dict(num_ranks=0), "num_ranks \\(R\\) must be positive"),
    (dict(num_experts=6, top_k=2, num_ranks=4), "divisible by num_ranks"),
    (dict(top_k=17), "top_k \\(K\\) must be at most num_experts"),
    (dict(precision=7), "precision must be"),
])
def test_bad_configs_raise(changes, match):
    _library()
    with pytest.raises(_lib.MegaMoEError, match=match) as info:
        _config(**changes).validate()
    assert info.value.code == _lib.INVALID_ARGUMENT
    _config().validate()  # and a good one passes afterwards


def test_reserved_must_be_zero():
    _library()
    c = _config().to_c()
    c.reserved = 1
    with pytest.raises(_lib.MegaMoEError, match="reserved must be 0"):
        _lib.validate_config(c)


def test_errors_are_per_thread():
    library = _library()
    seen = {}

    def fail(i):
        try:
            _config(hidden=128 * (i + 1) + 1).validate()
        except _lib.MegaMoEError as e:
            seen[i] = str(e)

    threads = [threading.Thread(target=fail, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(8))
    for i, message in seen.items():
        assert f"got {128 * (i + 1) + 1}" in message
    assert library.megamoe_validate_config(ctypes.byref(_config().to_c())) == _lib.OK
    assert library.megamoe_last_error() == b""


def test_null_arguments_are_reported_not_crashed_on():
    library = _library()
    assert library.megamoe_validate_config(None) == _lib.INVALID_ARGUMENT
    assert b"config must not be NULL" in library.megamoe_last_error()
    assert library.megamoe_vgroup_synchronize_and_check(None) == _lib.INVALID_ARGUMENT
    assert library.megamoe_vgroup_forward(None, None, None) == _lib.INVALID_ARGUMENT
    assert library.megamoe_default_options(None) == _lib.INVALID_ARGUMENT
    library.megamoe_vgroup_destroy(None)
    for code in range(-1, 9):
        assert library.megamoe_status_name(code)


def test_default_options():
    _library()
    options = _lib.default_options()
    assert options.expert_row_capacity == 0 and options.wait_timeout_seconds > 0
    assert options.forward_path == 0 and options.recompute_h == 0 and options.backward_path == 0


def test_group_lifetime():
    _library()
    try:
        group = _lib.VirtualRankGroup(_config(num_ranks=2).to_c())
    except _lib.MegaMoEError as e:  # no GPU, or a build without CUDA: the failure is clean
        assert e.code == _lib.NOT_SUPPORTED, e
        return
    assert group.num_ranks == 2 and group.expert_row_capacity > 0
    group.synchronize_and_check()
    group.close()
    group.close()  # idempotent
    assert group.closed
    with pytest.raises(_lib.MegaMoEError, match="closed"):
        group.synchronize_and_check()
    with pytest.raises(_lib.MegaMoEError, match="closed"):
        group.forward([_lib.ForwardArgs(), _lib.ForwardArgs()], 0)
    with pytest.raises(ValueError, match="rank arguments"):
        group.forward([_lib.ForwardArgs()], 0)


def test_process_group_null_arguments_are_reported_not_crashed_on():
    library = _library()
    bootstrap = _lib.BootstrapId()
    handle = ctypes.c_void_p()
    config = _config().to_c()
    assert library.megamoe_pgroup_create(None, None, 0, ctypes.byref(bootstrap), ctypes.byref(handle)) == \
        _lib.INVALID_ARGUMENT
    assert library.megamoe_pgroup_create(ctypes.byref(config), None, 0, None, ctypes.byref(handle)) == \
        _lib.INVALID_ARGUMENT
    assert b"id must not be NULL" in library.megamoe_last_error()
    assert handle.value is None
    assert library.megamoe_create_bootstrap_id(None) == _lib.INVALID_ARGUMENT
    assert library.megamoe_pgroup_forward(None, None, None) == _lib.INVALID_ARGUMENT
    assert library.megamoe_pgroup_backward(None, None, None) == _lib.INVALID_ARGUMENT
    assert library.megamoe_pgroup_synchronize_and_check(None) == _lib.INVALID_ARGUMENT
    rank = ctypes.c_int32(-1)
    assert library.megamoe_pgroup_rank(None, ctypes.byref(rank)) == _lib.INVALID_ARGUMENT
    library.megamoe_pgroup_destroy(None)


def test_bootstrap_id_is_bytes_or_a_clean_error():
    _library()
    try:
        first, second = _lib.create_bootstrap_id(), _lib.create_bootstrap_id()
    except _lib.MegaMoEError as e:  # a build without CUDA or without NCCL
        assert e.code == _lib.NOT_SUPPORTED, e
        return
    assert isinstance(first, bytes) and len(first) == _lib.BOOTSTRAP_ID_BYTES
    assert first != second


def test_process_group_argument_errors():
    _library()
    bootstrap = bytes(_lib.BOOTSTRAP_ID_BYTES)
    with pytest.raises(ValueError, match="a bootstrap id is 128 bytes"):
        _lib.ProcessRankGroup(_config(num_ranks=2).to_c(), 0, b"short")
    with pytest.raises(_lib.MegaMoEError, match="rank must be in \\[0, num_ranks=2\\), got 2") as info:
        _lib.ProcessRankGroup(_config(num_ranks=2).to_c(), 2, bootstrap)
    assert info.value.code == _lib.INVALID_ARGUMENT
    with pytest.raises(_lib.MegaMoEError, match="hidden \\(H\\) must be a multiple of 128"):
        _lib.ProcessRankGroup(_config(hidden=100).to_c(), 0, bootstrap)


def test_process_group_without_gpu_is_a_clean_error():
    """A group of one rank bootstraps in this process where there is a GPU (NCCL needs no peers then)."""
    _library()
    try:
        bootstrap = _lib.create_bootstrap_id()
        group = _lib.ProcessRankGroup(_config().to_c(), 0, bootstrap)
    except _lib.MegaMoEError as e:
        assert e.code == _lib.NOT_SUPPORTED, e
        return
    assert group.rank == 0 and group.num_ranks == 1 and group.expert_row_capacity > 0
    group.synchronize_and_check()
    group.close()
    group.close()
    with pytest.raises(_lib.MegaMoEError, match="ProcessRankGroup was closed"):
        group.forward(_lib.ForwardArgs(), 0)
