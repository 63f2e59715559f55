"""Gated DeltaNet linear attention for MLX: fast CPU and Metal kernels."""

from importlib.metadata import version as _version

import mlx.core as _mx  # noqa: F401  (loads MLX's libraries before our extension)

from . import nn
from .ops import gated_delta_rule, gated_delta_update
from .patch import patch_mlx_lm
from .segment import gated_delta_segment

# Written once, in pyproject.toml.
__version__ = _version("mlx-gated-delta")

__all__ = [
    "gated_delta_rule",
    "gated_delta_update",
    "gated_delta_segment",
    "nn",
    "patch_mlx_lm",
]
