"""Gated DeltaNet linear attention for MLX: fast CPU and Metal kernels."""

import mlx.core as _mx  # noqa: F401  (loads MLX's libraries before our extension)

from . import nn
from .ops import gated_delta_rule, gated_delta_update
from .patch import patch_mlx_lm
from .segment import gated_delta_segment

__version__ = "0.1.0"

__all__ = [
    "gated_delta_rule",
    "gated_delta_update",
    "gated_delta_segment",
    "nn",
    "patch_mlx_lm",
]
