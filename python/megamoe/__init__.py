"""megamoe: an expert-parallel MoE layer for training on NVIDIA Hopper, from PyTorch.

megamoe.reference needs only PyTorch; megamoe.ops and MegaMoE load libmegamoe (ctypes) on first use.
megamoe.integrations.transformers (imported on its own) registers experts_implementation="megamoe" with
Hugging Face transformers.
"""

from . import reference
from ._lib import MegaMoEError
from .module import MegaMoE, w1_w3_from_w13, w13_from_w1_w3
from .ops import LayerConfig, moe, moe_ranks, set_debug_checks, synchronize_and_check

__version__ = "0.1.0"

__all__ = ["MegaMoE", "MegaMoEError", "LayerConfig", "moe", "moe_ranks", "reference", "set_debug_checks",
           "synchronize_and_check", "w13_from_w1_w3", "w1_w3_from_w13"]
