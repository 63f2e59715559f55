"""What several layer kinds share: the projections (every layer) and the
gated norm's weight (Qwen, OLMo-Hybrid)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import _ext


def _runs_cpu_kernel(arrays: list[mx.array]) -> bool:
    """Whether our CPU projection kernel takes these operands: on the CPU,
    all of one floating dtype."""
    dtype = arrays[0].dtype
    return (
        mx.default_device() == mx.cpu
        and dtype in (mx.float32, mx.float16, mx.bfloat16)
        and all(a.dtype == dtype for a in arrays)
    )


def dense_projection(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` (nn.Linear's product, weight `[out, in]`): on the CPU
    through our blocked kernel (MLX's CPU matmul is 10-100x slower on the
    machines measured), elsewhere MLX's matmul."""
    if _runs_cpu_kernel([x, weight]):
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


def project_row(parts: list[tuple[nn.Module, mx.array]]) -> mx.array:
    """The outputs of several projections side by side:
    `concatenate([apply_projection(module, x) for module, x in parts], -1)`.
    Where every module is a plain dense one and our CPU kernel runs them, each
    is written straight into its columns of one buffer, the same bits, so the
    forward does not hold every projection's output beside the row it is
    copied into (320 MiB each for Kimi-Linear's layer at T=8192)."""
    modules = [module for module, _ in parts]
    xs = [x for _, x in parts]
    if all(is_dense_projection(m) for m in modules):
        weights = [m.weight for m in modules]
        if _runs_cpu_kernel(xs + weights):
            return _ext.dense_projection_row(xs, weights, None)
    return mx.concatenate([apply_projection(m, x) for m, x in parts], axis=-1)


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
