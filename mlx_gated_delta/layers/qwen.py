"""The Qwen layers (Qwen3-Next's and Qwen3.5's) on the fused segment.

They keep mlx-lm's parameter names, shapes and row orders, so mlx-lm
checkpoints (and `model.load_weights`, `nn.quantize`, mlx-lm's `shard`) see
the same module tree as mlx-lm's own layer. The forward pass is one
projection into `mixed_qkvzba` (the `[q | k | v | z | b | a]` row), one
`gated_delta_segment` (conv, gates, norms and the recurrence), and the output
projection. A long call without a cache (training) runs them in token
blocks, recomputed in the backward (`token_blocks`).

`mixed_qkvzba` is made from mlx-lm's own projection modules each call: each
module projects the input (plain, quantized or LoRA-wrapped, as
`mlx_lm.tuner.utils.linear_to_lora_layers` leaves it) and their outputs are
placed side by side (`common.project_row`: plain ones written straight into
one buffer) and, for Qwen3-Next, reordered into the `mixed_qkvzba` row; a
long call through plain projections gathers their weights into that order
instead and projects once. Nothing is
derived from the weights and kept, so no weight can go stale: after an
optimizer step, `load_weights`, quantizing, or an `mx.compile`d training step
that updates the parameter arrays in place, the next call reads the current
weights.

Every projection goes through `common.apply_projection` (or `project_row`,
which follows the same rule): on the CPU a plain
dense one runs our blocked kernel instead of MLX's CPU matmul, which is
10-100x slower on the machines measured; other projections are the modules'
own calls.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..segment import gated_delta_segment
from .cache_protocol import layer_cache
from .common import (
    GatedRMSNormWeight,
    apply_projection,
    dense_projection,
    is_dense_projection,
    project_row,
)
from .token_blocks import blocked_without_cache


class _GatedDeltaNetBase(nn.Module):
    """What both layers share: head layout, conv, gates, norm, cache handling."""

    def __init__(self, config: Any):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads != 0:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple "
                f"of linear_num_key_heads ({self.num_k_heads})"
            )
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_norm_epsilon = config.rms_norm_eps
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            bias=False,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=0,
        )
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.log(mx.random.uniform(low=0, high=16, shape=(self.num_v_heads,)))
        self.norm = GatedRMSNormWeight(self.head_v_dim, eps=self.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def _projection_modules(self) -> list[nn.Module]:
        """The projections whose outputs make `mixed_qkvzba`, in order."""
        raise NotImplementedError

    def _mixed_qkvzba_columns(self) -> mx.array | None:
        """The columns of the concatenated projection outputs in
        `mixed_qkvzba`'s order, or None where they are in that order already."""
        raise NotImplementedError

    def mixed_qkvzba(self, x: mx.array) -> mx.array:
        """The segment's input `mixed_qkvzba` `[q | k | v | z | b | a]` for `x`,
        from the current projection modules."""
        rows = x.size // x.shape[-1]
        dense = all(is_dense_projection(m) for m in self._projection_modules())
        if dense and rows > x.shape[-1]:
            return self._project_through_gathered_weights(x)
        return self._project_by_modules(x)

    def _project_by_modules(self, x: mx.array) -> mx.array:
        """Each module projects x; their outputs, side by side
        (`project_row`), are reordered where the row's order differs. A
        short call (decode) takes this way: it copies its few output rows
        instead of the weights."""
        mixed = project_row([(m, x) for m in self._projection_modules()])
        columns = self._mixed_qkvzba_columns()
        if columns is None:
            return mixed
        # One gather straight into row-major order: `mx.take` along the last
        # axis gathers column-major and hands back a transposed view, which
        # the segment (it reads its input row-contiguous) then copies again.
        return mx.take_along_axis(mixed, mx.broadcast_to(columns, mixed.shape), axis=-1)

    def _project_through_gathered_weights(self, x: mx.array) -> mx.array:
        """The weights' rows gathered into `mixed_qkvzba`'s order, then one
        product. A long call takes this way: it copies the weights (width x
        hidden) instead of the projected row (rows x width), whose
        reordering would hold another copy of it in the forward and again in
        the backward (192 MiB a copy for Qwen3-Next's layer at T=8192, its
        weights 48 MiB). Qwen3.5's row needs no reordering, and
        `project_row` would write it with no copy of the weights (49 MiB less
        at T=8192), but its backward, four products for x's gradient where
        this takes one, made the training step 3-8% slower."""
        weight = mx.concatenate([m.weight for m in self._projection_modules()], axis=0)
        columns = self._mixed_qkvzba_columns()
        if columns is not None:
            weight = mx.take(weight, columns, axis=0)
        return dense_projection(x, weight)

    def __call__(
        self,
        inputs: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        sharding_group = getattr(self, "sharding_group", None)
        if sharding_group is not None:
            inputs = nn.layers.distributed.sum_gradients(sharding_group)(inputs)
        out = self._mix(inputs, mask, cache)
        if sharding_group is not None:
            out = mx.distributed.all_sum(out, group=sharding_group)
        return out

    @blocked_without_cache
    def _mix(self, inputs, mask, cache):
        """This rank's part of the layer's output: the projections, the
        segment and the output projection."""
        B, S, _ = inputs.shape
        mixed = self.mixed_qkvzba(inputs)
        cache = layer_cache(cache)
        conv_state, state = cache[0], cache[1]
        # A cache filled by another implementation may hold other dtypes.
        if conv_state is not None and conv_state.dtype != mixed.dtype:
            conv_state = conv_state.astype(mixed.dtype)
        if state is not None and state.dtype != mx.float32:
            state = state.astype(mx.float32)

        # A trimmable cache keeps the states after the call's last tokens:
        # the segment returns them as checkpoints.
        checkpoints = cache.checkpoints_for(S)

        # mlx-lm's mask (left padding, lengths) marks the tokens that are not
        # in a row's sequence; the segment skips them, so each row's conv and
        # recurrent states are those of its own tokens only.
        out, conv_state, state, *kept = gated_delta_segment(
            mixed,
            self.conv1d.weight,
            self.A_log,
            self.dt_bias,
            self.norm.weight,
            conv_state,
            state,
            key_heads=self.num_k_heads,
            value_heads=self.num_v_heads,
            key_dim=self.head_k_dim,
            value_dim=self.head_v_dim,
            norm_eps=self.norm.eps,
            mask=mask,
            checkpoints=checkpoints,
        )
        cache.store([conv_state, state], S, checkpoints, kept)

        return apply_projection(self.out_proj, out.reshape(B, S, -1))


class Qwen3NextGatedDeltaNet(_GatedDeltaNetBase):
    """mlx-lm's `qwen3_next.Qwen3NextGatedDeltaNet`, with the same parameters
    (`in_proj_qkvz`, `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`,
    `out_proj`) and cache (`ArraysCache`: `[conv_state, state]`).

    `in_proj_qkvz` and `in_proj_ba` are packed per key-head group, as in the
    checkpoints: `[q | k | v_group | z_group]` and `[b_group | a_group]` for
    each key head; `mixed_qkvzba` reorders their output columns.

    `GatedDeltaNet` is the same class, under the name it had while it was
    the only layer here.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.in_proj_qkvz = nn.Linear(
            self.hidden_size, self.key_dim * 2 + self.value_dim * 2, bias=False
        )
        self.in_proj_ba = nn.Linear(self.hidden_size, self.num_v_heads * 2, bias=False)

    def _projection_modules(self):
        return [self.in_proj_qkvz, self.in_proj_ba]

    def _mixed_qkvzba_columns(self):
        return qwen3_next_columns(
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        )


@functools.cache
def qwen3_next_columns(nk: int, nv: int, dk: int, dv: int) -> mx.array:
    """The columns of Qwen3-Next's concatenated projection outputs in
    `mixed_qkvzba`'s order, for nk key heads and nv value heads of dims dk
    and dv. A function of the layout alone, made once per layout: a layer
    call (every decode step) only reads it."""
    group_v = nv // nk * dv  # v (or z) per group
    group_heads = nv // nk  # b (or a) per group
    qkvz_group = 2 * dk + 2 * group_v
    groups = np.arange(nk)[:, None]

    def rows(group_size, start, length):
        return (groups * group_size + start + np.arange(length)).reshape(-1)

    qkvz_rows = np.concatenate(
        [
            rows(qkvz_group, 0, dk),  # q
            rows(qkvz_group, dk, dk),  # k
            rows(qkvz_group, 2 * dk, group_v),  # v
            rows(qkvz_group, 2 * dk + group_v, group_v),  # z
        ]
    )
    ba_rows = np.concatenate(
        [
            rows(2 * group_heads, 0, group_heads),  # b
            rows(2 * group_heads, group_heads, group_heads),  # a
        ]
    )
    # in_proj_ba's outputs follow in_proj_qkvz's in the concatenation.
    qkvz_width = 2 * (nk * dk) + 2 * (nv * dv)
    return mx.array(np.concatenate([qkvz_rows, ba_rows + qkvz_width]), mx.int32)


# The name Qwen3-Next's layer had while it was the only one: an alias, so
# that code importing `mlx_gated_delta.nn.GatedDeltaNet` keeps working.
GatedDeltaNet = Qwen3NextGatedDeltaNet


class Qwen35GatedDeltaNet(_GatedDeltaNetBase):
    """mlx-lm's `qwen3_5.GatedDeltaNet`, with the same parameters
    (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
    `dt_bias`, `A_log`, `norm`, `out_proj`), cache and `sharding_group`
    (mlx-lm's `shard` splits heads across ranks and works on this layer).
    The projections are already in `mixed_qkvzba`'s order: their outputs are concatenated.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.in_proj_qkv = nn.Linear(
            self.hidden_size, self.key_dim * 2 + self.value_dim, bias=False
        )
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.sharding_group = None

    def _projection_modules(self):
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def _mixed_qkvzba_columns(self):
        return None


def config_from_layer(layer: nn.Module) -> SimpleNamespace:
    """The fields both Qwen layers' constructor reads, from a built mlx-lm
    layer of either family (it keeps no config; after mlx-lm's `shard` these
    are per rank)."""
    return SimpleNamespace(
        hidden_size=layer.hidden_size,
        linear_num_value_heads=layer.num_v_heads,
        linear_num_key_heads=layer.num_k_heads,
        linear_key_head_dim=layer.head_k_dim,
        linear_value_head_dim=layer.head_v_dim,
        linear_conv_kernel_dim=layer.conv_kernel_size,
        rms_norm_eps=layer.layer_norm_epsilon,
    )
