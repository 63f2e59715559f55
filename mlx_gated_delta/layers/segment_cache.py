"""The fused segment for the layers whose cache keeps mlx-lm's layout of
one conv state per short convolution, then the state (OLMo-Hybrid,
Kimi-Linear, Bailing-MoE-V3: q, k and v convs; Kimi-K3: one over q|k|v).

Separate depthwise convolutions of one kernel size are one depthwise
convolution over their concatenated channels, with their weights and conv
states concatenated the same way: the segment runs that one, and the new
conv states (and their checkpoints) are split back into the cache's slots.
"""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from ..segment import gated_delta_segment
from .cache_protocol import layer_cache


def segment_in_cache(cache, convs, mixed, decay_parameter, dt_bias, norm, *, heads, **options):
    """`gated_delta_segment` on the packed row `mixed` `[B, T, F]` through a
    cache of mlx-lm's layout: `convs` are the layer's depthwise `nn.Conv1d`
    modules over consecutive channels of q|k|v (one kernel size), whose conv
    states are the cache's first slots; the state is its last. `norm` is the
    output norm (its `weight` and `eps`), `heads` the segment's head layout
    (key_heads, value_heads, key_dim, value_dim), `options` the segment's
    other keywords (mask, gate options). Stores the new states, and the
    states after the cache's checkpoints (`LayerCache.store`); returns out
    `[B, T, Hv, Dv]`."""
    cache = layer_cache(cache)
    tokens = mixed.shape[1]
    widths = [conv.weight.shape[0] for conv in convs]
    weight = mx.concatenate([conv.weight for conv in convs], axis=0)
    conv_state = joined_conv_state(cache, widths, weight.shape[1] - 1, mixed)
    state = cache[len(convs)]
    # A cache filled by another implementation may hold other dtypes.
    if state is not None and state.dtype != mx.float32:
        state = state.astype(mx.float32)
    positions = cache.checkpoints_for(tokens)
    out, conv_state, state, *kept = gated_delta_segment(
        mixed,
        weight,
        decay_parameter,
        dt_bias,
        norm.weight,
        conv_state,
        state,
        **heads,
        norm_eps=norm.eps,
        checkpoints=positions,
        **options,
    )
    conv_checkpoints = split_channels(kept[0], widths) if kept else [None] * len(convs)
    cache.store(
        [*split_channels(conv_state, widths), state],
        tokens,
        positions,
        [*conv_checkpoints, *kept[1:]],
    )
    return out


def joined_conv_state(cache, widths, rows, mixed):
    """The conv states of the cache's first `len(widths)` slots concatenated
    over the channels, in `mixed`'s dtype; None when the cache has none (the
    segment starts from zeros). A slot without a state reads as zeros."""
    states = [cache[slot] for slot in range(len(widths))]
    if all(state is None for state in states):
        return None
    batch = mixed.shape[0]
    return mx.concatenate(
        [
            mx.zeros((batch, rows, width), mixed.dtype)
            if state is None
            else state.astype(mixed.dtype)
            for state, width in zip(states, widths)
        ],
        axis=-1,
    )


def split_channels(array, widths):
    """`array`'s last axis split into consecutive parts of `widths`."""
    return mx.split(array, list(accumulate(widths))[:-1], axis=-1)
