"""What several layer kinds share: the gated norm's weight (Qwen, OLMo-Hybrid)
and the core op's recurrence through mlx-lm's cache layout (OLMo-Hybrid and
the Kimi Delta Attention layers)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..ops import gated_delta_rule
from .cache_protocol import layer_cache


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
