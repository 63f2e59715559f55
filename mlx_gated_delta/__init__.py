"""Gated DeltaNet linear attention for MLX: fast CPU and Metal kernels."""

import mlx.core as _mx  # noqa: F401  (loads MLX's libraries before our extension)

from .ops import gated_delta_rule, gated_delta_update

# The fused layer segment and the mlx-lm integration.
from .segment import gated_delta_segment
from .patch import patch_mlx_lm

__version__ = "0.1.0"

__all__ = ["gated_delta_rule", "gated_delta_update"]
__all__ += ["gated_delta_segment", "patch_mlx_lm"]
