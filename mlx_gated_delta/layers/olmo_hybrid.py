"""OLMo-Hybrid's layer: mlx-lm's projections (through
`common.apply_projection`) into the fused segment (its three short
convolutions as one). A long call without a cache (training) runs in token
blocks, recomputed in the backward (`token_blocks`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .common import GatedRMSNormWeight, apply_projection, project_row
from .segment_cache import segment_in_cache
from .token_blocks import blocked_without_cache


class OlmoHybridGatedDeltaNet(nn.Module):
    """mlx-lm's `olmo_hybrid.GatedDeltaNet`, with the same parameters
    (`q_proj`, `k_proj`, `v_proj`, `a_proj`, `b_proj`, `g_proj`, `o_proj`,
    `q_conv1d`, `k_conv1d`, `v_conv1d`, `A_log`, `dt_bias`, `o_norm`) and
    cache (`ArraysCache`: `[q conv state, k conv state, v conv state, state]`).

    The projections go through `common.project_row` (our CPU kernel for
    plain dense ones, writing them into one packed row, the modules' own calls
    otherwise). Their outputs, packed `[q | k | v | g | b | a]`, run through the fused segment
    (`segment_cache.segment_in_cache`): the three convolutions as one over
    their concatenated channels, the gates, the recurrence (normalize_qk,
    scale `Dk ** -0.5`) with `beta = 2 sigmoid(b)` in `[0, 2]` where the
    model allows negative eigenvalues (`linear_allow_neg_eigval`), and the
    gated norm, forward and backward. The segment skips the tokens the mask
    leaves out, so that a left-padded prompt in a batch gives the tokens it
    gives alone (mlx-lm's layer lets the padding into the convolutions and
    does not).
    """

    def __init__(self, config: Any):
        super().__init__()
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.allow_neg_eigval = config.linear_allow_neg_eigval
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, hidden, bias=False)
        for name, dims in (
            ("q_conv1d", self.key_dim),
            ("k_conv1d", self.key_dim),
            ("v_conv1d", self.value_dim),
        ):
            self[name] = nn.Conv1d(
                dims, dims, self.conv_kernel_size, bias=False, groups=dims, padding=0
            )
        self.A_log = mx.zeros(self.num_v_heads)
        self.dt_bias = mx.zeros(self.num_v_heads)
        self.o_norm = GatedRMSNormWeight(self.head_v_dim, eps=config.layer_norm_epsilon)

    @blocked_without_cache
    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        B, S, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.b_proj, self.a_proj)
        mixed = project_row([(p, x) for p in projections])
        out = segment_in_cache(
            cache,
            (self.q_conv1d, self.k_conv1d, self.v_conv1d),
            mixed,
            self.A_log,
            self.dt_bias,
            self.o_norm,
            heads=dict(
                key_heads=self.num_k_heads,
                value_heads=self.num_v_heads,
                key_dim=self.head_k_dim,
                value_dim=self.head_v_dim,
            ),
            mask=mask,
            allow_neg_eigval=self.allow_neg_eigval,
        )
        return apply_projection(self.o_proj, out.reshape(B, S, -1))


def config_from_layer(layer: nn.Module) -> SimpleNamespace:
    """The fields `OlmoHybridGatedDeltaNet` reads, from a built mlx-lm layer."""
    return SimpleNamespace(
        # o_proj's output dim: quantization packs only the input dim.
        hidden_size=layer.o_proj.weight.shape[0],
        linear_num_value_heads=layer.num_v_heads,
        linear_num_key_heads=layer.num_k_heads,
        linear_key_head_dim=layer.head_k_dim,
        linear_value_head_dim=layer.head_v_dim,
        linear_conv_kernel_dim=layer.conv_kernel_size,
        linear_allow_neg_eigval=layer.allow_neg_eigval,
        layer_norm_epsilon=layer.o_norm.eps,
    )
