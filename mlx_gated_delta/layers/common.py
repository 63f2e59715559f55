"""What several layer kinds share: the projections (every layer) and the
gated norm's weight (Qwen, OLMo-Hybrid)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import _ext


def dense_projection(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` (nn.Linear's product, weight `[out, in]`): on the CPU
    through our blocked kernel (MLX's CPU matmul is 10-100x slower on the
    machines measured), elsewhere MLX's matmul."""
    if (
        mx.default_device() == mx.cpu
        and x.dtype == weight.dtype
        and x.dtype in (mx.float32, mx.float16, mx.bfloat16)
    ):
        return _ext.dense_projection(x, weight, None)
    return x @ weight.T


def apply_projection(module: nn.Module, x: mx.array) -> mx.array:
    """One of a layer's projections: a plain bias-free Linear through
    `dense_projection`, anything else (quantized, LoRA-wrapped, with bias)
    by calling the module itself, so every wrapper mlx-lm's tools put there
    is followed and its own forward (and gradient) is the one that runs."""
    if is_dense_projection(module):
        return dense_projection(x, module.weight)
    return module(x)


def is_dense_projection(module: nn.Module) -> bool:
    """Whether `module` is a plain bias-free Linear, whose product is
    `dense_projection(x, module.weight)` and nothing else."""
    return type(module) is nn.Linear and "bias" not in module


class GatedRMSNormWeight(nn.Module):
    """The weight of the gated RMSNorm (mlx-lm's `norm`); the math is in the
    segment: `rms_norm(y, eps) * weight * silu(z)`."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)
