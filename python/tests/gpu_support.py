"""Why a GPU test cannot run here (an empty string when it can): shared by the tests that need the GPU
build of the library on a CUDA device."""

import torch


def why_no_gpu() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from megamoe import _lib
        if not _lib.built_with_cuda():
            return "libmegamoe was built without CUDA"
    except ImportError as e:
        return str(e)
    return ""
