"""Gated DeltaNet linear attention for MLX: fast CPU and Metal kernels."""

from importlib.metadata import version as _version

import mlx.core as _mx  # noqa: F401  (loads MLX's libraries before our extension)

from . import _ext, nn
from .ops import gated_delta_rule, gated_delta_update
from .patch import patch_mlx_lm
from .segment import gated_delta_segment

# Written once, in pyproject.toml.
__version__ = _version("mlx-gated-delta")


def thread_count() -> int:
    """How many threads the CPU kernels run on at most: ``MLX_GATED_DELTA_NUM_THREADS`` where
    set, else the CPUs of the process's affinity mask, bounded by its cgroup's CPU quota. Fixed
    when the first CPU kernel runs (docs/cpu.md)."""
    return _ext.cpu_thread_count()


__all__ = [
    "gated_delta_rule",
    "gated_delta_update",
    "gated_delta_segment",
    "nn",
    "patch_mlx_lm",
    "thread_count",
]
