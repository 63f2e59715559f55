"""The short convolutions of the layers that run the core op between mlx-lm's
projections (OLMo-Hybrid and the Kimi Delta Attention layers): a causal
depthwise conv and SiLU over masked inputs, with the conv states a cache
keeps, after the call and after each of its checkpoints."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class KimiShortConv(nn.Module):
    """The parameters of mlx-lm's `kimi_linear.ShortConv1d` (child `conv`, a
    depthwise conv, and `kernel_size`). The layers run it, or mlx-lm's own
    module that `patch_mlx_lm` keeps, through `short_conv`, which also gives
    the conv states a trimmable cache keeps."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(
            channels, channels, kernel_size, bias=False, groups=channels, padding=0
        )


def short_conv(conv, kernel_size, x, state, mask, lengths, positions=None):
    """The short convolution of mlx-lm's Kimi Delta Attention layers
    (Kimi-Linear, Kimi-K3, Bailing-MoE-V3): masked inputs zeroed, a causal
    depthwise conv and SiLU; returns it with the new conv state, the last
    K - 1 inputs before each row's end (`lengths`, mlx-lm's cache) or
    before the call's end, and the conv states after `positions` (or
    None)."""
    if mask is not None:
        x = mx.where(mask[..., None], x, 0)
    keep = kernel_size - 1
    if state is None:
        state = mx.zeros((x.shape[0], keep, x.shape[-1]), dtype=x.dtype)
    padded = mx.concatenate([state, x], axis=1)
    return (
        nn.silu(depthwise_conv(conv, padded)),
        conv_window(padded, keep, x.shape[1], lengths),
        conv_windows(padded, keep, positions, lengths),
    )


def depthwise_conv(conv, padded):
    """`conv(padded)` for the layers' short convolutions: on the CPU, where
    `conv` is a plain depthwise `nn.Conv1d` (no padding, stride, dilation or
    bias), as K shifted multiply-adds over the channels in float32, rounded
    once to the input's dtype; MLX's CPU conv takes about 4x as long for it
    (bf16, T = 2048, 4096 channels). Anything else is the module's own call."""
    channels = padded.shape[-1]
    weight = conv.weight
    if not (
        mx.default_device() == mx.cpu
        and type(conv) is nn.Conv1d
        and "bias" not in conv
        and (conv.stride, conv.padding, conv.dilation, conv.groups) == (1, 0, 1, channels)
        and weight.shape[0] == channels
    ):
        return conv(padded)
    taps = weight.shape[1]
    tokens = padded.shape[1] - taps + 1
    weight = weight.reshape(channels, taps).astype(mx.float32)
    out = padded[:, :tokens] * weight[:, 0]
    for tap in range(1, taps):
        out = out + padded[:, tap : tap + tokens] * weight[:, tap]
    return out.astype(padded.dtype)


def conv_window(padded, keep, end, lengths=None):
    """The conv state after the call's first `end` tokens: the `keep` inputs
    before that point in `padded` (the conv state before the call, then the
    call's inputs); with mlx-lm's `lengths`, a row that ends sooner keeps
    its own last inputs."""
    if lengths is None:
        return mx.contiguous(padded[:, end : end + keep, :])
    ends = mx.clip(lengths, 0, end)
    return mx.take_along_axis(padded, (ends[:, None] + mx.arange(keep))[..., None], axis=1)


def conv_windows(padded, keep, positions, lengths=None):
    """`conv_window` after each of `positions` (a trimmable cache's
    checkpoints), or None without positions."""
    if not positions:
        return None
    return [conv_window(padded, keep, end, lengths) for end in positions]
