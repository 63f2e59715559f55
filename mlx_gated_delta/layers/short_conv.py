"""The module of mlx-lm's Kimi-Linear and Kimi-K3 short convolutions, whose
parameters the patched layers keep; the fused segment runs the convolution
(`segment_cache`)."""

from __future__ import annotations

import mlx.nn as nn


class KimiShortConv(nn.Module):
    """The parameters of mlx-lm's `kimi_linear.ShortConv1d` (child `conv`, a
    depthwise conv, and `kernel_size`). The layers hand its `conv` (or that
    of mlx-lm's own module, which `patch_mlx_lm` keeps) to the fused
    segment."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(
            channels, channels, kernel_size, bias=False, groups=channels, padding=0
        )
