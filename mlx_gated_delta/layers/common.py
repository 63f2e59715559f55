"""What several layer kinds share: the projections (every layer), the gated
norm's weight (Qwen, OLMo-Hybrid) and the core op's recurrence through
mlx-lm's cache layout (OLMo-Hybrid and the Kimi Delta Attention layers)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import _ext
from ..ops import gated_delta_rule
from .cache_protocol import layer_cache


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


def recur_in_cache(
    cache, conv_states, conv_checkpoints, q, k, v, g, beta, *, scale, mask, positions
):
    """The recurrence of a layer with mlx-lm's cache layout (its conv
    states, then the state in the last slot): q and k L2-normalized, the
    state read as float32 (a cache filled by another implementation may
    hold another dtype), and the states after `positions` computed in the
    same pass. Then stores the call's `conv_states` (and their
    `conv_checkpoints`) and the new state (`LayerCache.store`). Returns y.
    Without a cache the state starts at zero and is dropped."""
    cache = layer_cache(cache)
    state = cache[-1]
    if state is not None and state.dtype != mx.float32:
        state = state.astype(mx.float32)
    out, state, *checkpoint_states = gated_delta_rule(
        q, k, v, g, beta, state, scale=scale, mask=mask, normalize_qk=True, checkpoints=positions
    )
    cache.store(
        [*conv_states, state],
        q.shape[1],
        positions,
        [*conv_checkpoints, *checkpoint_states],
    )
    return out
