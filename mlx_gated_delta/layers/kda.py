"""The Kimi Delta Attention layers (Kimi-Linear's, Kimi-K3's and
Bailing-MoE-V3's). Every projection goes through `common.apply_projection`
(our CPU kernel for a plain dense one, the module's own call otherwise), and
those that make the segment's input through `common.project_row`, which
writes plain dense ones straight into one packed row.

The projections' outputs, packed `[q | k | v | output gate | b | f]`, run
through the fused segment (`kda_segment`) on every device: the short
convolutions as one, the per-key-channel gates (`dt_bias` read `[H, Dk]`,
the lower bound where the model has one), the recurrence and
`o_norm(y) * sigmoid(gate)`, forward and backward, with masked tokens
skipped. Their gates are `kda_log_decay`'s, formed inside the segment.
A long call without a cache (training) runs in token blocks, recomputed in
the backward (`token_blocks`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .common import apply_projection, project_row
from .segment_cache import segment_in_cache
from .short_conv import KimiShortConv
from .token_blocks import blocked_without_cache


def kda_log_decay(f, A_log, dt_bias, lower_bound=None):
    """The per-key-channel log decays `g` `[B, T, H, Dk]` (float32) of Kimi
    Delta Attention, from the decay logits `f` `[B, T, H, Dk]`, `A_log` (H
    values, any shape) and `dt_bias` (`H * Dk` values, read per head and key
    channel):

    - `lower_bound=None` (Kimi-Linear, Kimi-K3 without it):
      `g = -exp(A_log[h]) softplus(f + dt_bias[h, c])`, in `(-inf, 0]`.
    - a `lower_bound` (Bailing-MoE-V3, Kimi-K3 with `gate_lower_bound`):
      `g = lower_bound sigmoid(exp(A_log[h]) (f + dt_bias[h, c]))`, in
      `[lower_bound, 0]`: each token keeps at least `exp(lower_bound)` of
      every state column.

    The log of mlx-lm's linear decays (`compute_g`, `compute_lower_bound_g`):
    the gates the fused segment forms from the same inputs, as MLX ops, for
    a caller of the core op; the activations are read as float32.
    """
    H, D = f.shape[-2], f.shape[-1]
    rate = mx.exp(A_log.reshape(H, 1).astype(mx.float32))
    logits = f.astype(mx.float32) + dt_bias.reshape(H, D).astype(mx.float32)
    if lower_bound is None:
        return -rate * nn.softplus(logits)
    return lower_bound * mx.sigmoid(rate * logits)


def kda_segment(layer, x, mask, cache, qkv, convs, output_gate, f, lower_bound=None):
    """A Kimi Delta Attention layer's output through the fused segment. The
    projections are `(module, input)` pairs for `common.project_row`: `qkv` a
    list of them (q|k|v in order, before their convolutions `convs`),
    `output_gate` and the decay logits `f` one each (each projecting to `[B,
    T, H*Dk]`); then the layer's `b_proj`, `A_log`, `dt_bias`, `o_norm` and
    `o_proj`."""
    B, T, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    mixed = project_row([*qkv, output_gate, (layer.b_proj, x), f])
    out = segment_in_cache(
        cache,
        convs,
        mixed,
        layer.A_log.reshape(H),
        layer.dt_bias.reshape(H, D),
        layer.o_norm,
        heads=dict(key_heads=H, value_heads=H, key_dim=D, value_dim=D),
        mask=mask,
        lower_bound=lower_bound,
        output_gate="sigmoid",
    )
    return apply_projection(layer.o_proj, out.reshape(B, T, -1))


class KimiDeltaAttention(nn.Module):
    """mlx-lm's `kimi_linear.KimiDeltaAttention` (Kimi Delta Attention), with
    the same parameters (`q_proj`, `k_proj`, `v_proj`, `q_conv`, `k_conv`,
    `v_conv`, `f_a_proj`, `f_b_proj`, `b_proj`, `g_a_proj`, `g_b_proj`,
    `A_log` `[1, 1, H, 1]`, `dt_bias` `[H * Dk]`, `o_norm`, `o_proj`) and
    cache (`[q, k, v conv states, state]`).

    Its gates are per key channel: `g[t, h, c] = -exp(A_log[h])
    softplus(f[t, h, c] + dt_bias[h, c])`, with `dt_bias` read per head and
    channel (the `[H, Dk]` reading mlx-lm#1792's GPU kernel got wrong), in
    the fused segment (`kda_segment`).
    """

    def __init__(self, config: Any):
        super().__init__()
        linear = config.linear_attn_config
        self.num_heads = linear["num_heads"]
        self.head_dim = linear["head_dim"]
        self.conv_kernel = linear.get("short_conv_kernel_size", 4)
        self.projection_dim = self.num_heads * self.head_dim
        self.scale = float(self.head_dim) ** -0.5
        hidden, dims = config.hidden_size, self.projection_dim
        self.q_proj = nn.Linear(hidden, dims, bias=False)
        self.k_proj = nn.Linear(hidden, dims, bias=False)
        self.v_proj = nn.Linear(hidden, dims, bias=False)
        self.q_conv = KimiShortConv(dims, self.conv_kernel)
        self.k_conv = KimiShortConv(dims, self.conv_kernel)
        self.v_conv = KimiShortConv(dims, self.conv_kernel)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, dims, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, dims, bias=False)
        self.A_log = mx.zeros((1, 1, self.num_heads, 1))
        self.dt_bias = mx.zeros((dims,))
        self.o_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(dims, hidden, bias=False)

    @blocked_without_cache
    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        return kda_segment(
            self,
            x,
            mask,
            cache,
            [(p, x) for p in (self.q_proj, self.k_proj, self.v_proj)],
            (self.q_conv.conv, self.k_conv.conv, self.v_conv.conv),
            (self.g_b_proj, apply_projection(self.g_a_proj, x)),
            (self.f_b_proj, apply_projection(self.f_a_proj, x)),
        )


class KimiK3DeltaAttention(nn.Module):
    """mlx-lm's `kimi_k3.KimiK3DeltaAttention`, with the same parameters
    (`qkv_proj`, `qkv_conv` (child `conv`), `f_a_proj`, `f_b_proj`, `b_proj`,
    `g_a_proj` and `g_b_proj`, or `g_proj` with `use_full_rank_gate`, `A_log`
    `[H]`, `dt_bias` `[H * Dk]`, `o_norm`, `o_proj`) and cache (`ArraysCache`:
    `[conv state, state]`, the conv state over the packed `q | k | v`).

    Kimi-Linear's layer with one projection and one convolution for q, k and
    v, and per-key-channel gates `kda_log_decay(f, A_log, dt_bias,
    gate_lower_bound)`: lower-bounded where the model's `linear_attn_config`
    sets `gate_lower_bound`, Kimi-Linear's otherwise, through the fused
    segment (`kda_segment`).
    """

    def __init__(self, config: Any):
        super().__init__()
        linear = config.linear_attn_config
        self.num_heads = linear["num_heads"]
        self.head_dim = linear["head_dim"]
        self.conv_kernel = linear["short_conv_kernel_size"]
        self.projection_dim = self.num_heads * self.head_dim
        self.scale = float(self.head_dim) ** -0.5
        self.lower_bound = linear.get("gate_lower_bound", None)
        self.use_full_rank_gate = linear.get("use_full_rank_gate", False)
        hidden, dims = config.hidden_size, self.projection_dim
        self.qkv_proj = nn.Linear(hidden, 3 * dims, bias=False)
        self.qkv_conv = KimiShortConv(3 * dims, self.conv_kernel)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, dims, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, dims, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, dims, bias=False)
        self.A_log = mx.zeros((self.num_heads,))
        self.dt_bias = mx.zeros((dims,))
        self.o_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(dims, hidden, bias=False)

    @blocked_without_cache
    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        return kda_segment(
            self,
            x,
            mask,
            cache,
            [(self.qkv_proj, x)],
            (self.qkv_conv.conv,),
            self._output_gate(x),
            (self.f_b_proj, apply_projection(self.f_a_proj, x)),
            self.lower_bound,
        )

    def _output_gate(self, x):
        """The output gate's logits `[B, T, H*Dk]` as a `(module, input)`
        pair: full rank or low rank."""
        if self.use_full_rank_gate:
            return (self.g_proj, x)
        return (self.g_b_proj, apply_projection(self.g_a_proj, x))


class BailingKDA(nn.Module):
    """mlx-lm's `bailing_moe_v3.BailingKDA` (Bailing-MoE-V3's Kimi Delta
    Attention), with the same parameters (`q_proj`, `k_proj`, `v_proj`,
    `q_conv1d`, `k_conv1d`, `v_conv1d`, `f_proj`, `b_proj`, `g_proj`,
    `A_log` `[H]`, `dt_bias` `[H * Dk]`, `o_norm`, `o_proj`) and cache
    (`ArraysCache`: `[q, k, v conv states, state]`).

    Its gates are full rank (`f_proj`, no low-rank pair) and lower-bounded:
    `kda_log_decay(f, A_log, dt_bias, kda_lower_bound)`, per key channel,
    the segment's `lower_bound` (`kda_segment`).
    mlx-lm implements only `no_kda_lora` and `kda_safe_gate` (the
    lower-bounded decay); other settings are refused as there.
    """

    def __init__(self, config: Any):
        super().__init__()
        if not getattr(config, "no_kda_lora", True):
            raise ValueError("BailingKDA requires no_kda_lora=true, as mlx-lm's layer")
        if not getattr(config, "kda_safe_gate", True):
            raise ValueError("BailingKDA requires kda_safe_gate=true, as mlx-lm's layer")
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.projection_size = self.num_heads * self.head_dim
        self.conv_kernel_size = config.short_conv_kernel_size
        self.lower_bound = config.kda_lower_bound
        self.rms_norm_eps = config.rms_norm_eps
        hidden, dims = config.hidden_size, self.projection_size
        self.q_proj = nn.Linear(hidden, dims, bias=False)
        self.k_proj = nn.Linear(hidden, dims, bias=False)
        self.v_proj = nn.Linear(hidden, dims, bias=False)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            self[name] = nn.Conv1d(
                dims, dims, self.conv_kernel_size, bias=False, groups=dims, padding=0
            )
        self.A_log = mx.zeros((self.num_heads,))
        self.f_proj = nn.Linear(hidden, dims, bias=False)
        self.dt_bias = mx.zeros((dims,))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_proj = nn.Linear(hidden, dims, bias=False)
        self.o_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(dims, hidden, bias=False)

    @blocked_without_cache
    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        return kda_segment(
            self,
            x,
            mask,
            cache,
            [(p, x) for p in (self.q_proj, self.k_proj, self.v_proj)],
            (self.q_conv1d, self.k_conv1d, self.v_conv1d),
            (self.g_proj, x),
            (self.f_proj, x),
            self.lower_bound,
        )


# The fields each layer's constructor reads, from a built mlx-lm layer of its
# family (it keeps no config).


def kimi_linear_config(layer: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=layer.o_proj.weight.shape[0],
        linear_attn_config=dict(
            num_heads=layer.num_heads,
            head_dim=layer.head_dim,
            short_conv_kernel_size=layer.conv_kernel,
        ),
        rms_norm_eps=layer.o_norm.eps,
    )


def kimi_k3_config(layer: nn.Module) -> SimpleNamespace:
    # Kimi-Linear's fields, the decay's lower bound and the output gate's rank.
    config = kimi_linear_config(layer)
    config.linear_attn_config.update(
        gate_lower_bound=layer.lower_bound, use_full_rank_gate=layer.use_full_rank_gate
    )
    return config


def bailing_config(layer: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=layer.o_proj.weight.shape[0],
        num_attention_heads=layer.num_heads,
        head_dim=layer.head_dim,
        short_conv_kernel_size=layer.conv_kernel_size,
        kda_lower_bound=layer.lower_bound,
        rms_norm_eps=layer.o_norm.eps,
    )
