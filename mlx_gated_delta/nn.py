"""Drop-in gated-delta layers for mlx-lm's six gated-delta families:
Qwen3-Next and Qwen3.5 (`GatedDeltaNet`, `Qwen35GatedDeltaNet`, on the fused
segment), OLMo-Hybrid, Kimi-Linear, Kimi-K3 and Bailing-MoE-V3
(`OlmoHybridGatedDeltaNet`, `KimiDeltaAttention`, `KimiK3DeltaAttention`,
`BailingKDA`, at the end, described there: the core op between mlx-lm's own
projections and convolutions).

The Qwen layers keep mlx-lm's parameter names, shapes and row orders, so mlx-lm
checkpoints (and `model.load_weights`, `nn.quantize`, mlx-lm's `shard`) see the
same module tree as mlx-lm's own layer. The forward pass is one projection
into the packed `[q | k | v | z | b | a]` layout, one `gated_delta_segment`
(conv, gates, norms and the recurrence), and the output projection.

The packed input is made from the outputs of mlx-lm's own projection modules
each call: each module projects the input (plain, quantized or LoRA-wrapped,
as `mlx_lm.tuner.utils.linear_to_lora_layers` leaves it) and their outputs are
concatenated and, for Qwen3-Next, reordered into the packed layout. Nothing is
derived from the weights and kept, so no weight can go stale: after an
optimizer step, `load_weights`, quantizing, or an `mx.compile`d training step
that updates the parameter arrays in place, the next call reads the current
weights.

On the CPU the plain dense projections run through our blocked kernel instead
of MLX's CPU matmul, which is 10-100x slower on the machines measured; other
projections are the modules' own calls. On a Mac's GPU the segment runs our
Metal kernels.

Training: `mx.grad` and `mlx.nn.value_and_grad` through these layers give
every parameter its gradient (the segment's, the core op's and the
projection kernel's vjps), with no fallback to mlx-lm's per-token loop.

Serving: with a `TrimmableArraysCache` (mlx_gated_delta.cache, what a
patched model's `make_cache` gives), every layer also hands the cache its
slots after the call's last positions (`kept_positions`, `store_in_cache`),
so that speculative decoding can trim it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import _ext
from .ops import gated_delta_rule
from .segment import gated_delta_segment


class GatedRMSNormWeight(nn.Module):
    """The weight of the gated RMSNorm (mlx-lm's `norm`); the math is in the
    segment: `rms_norm(y, eps) * weight * silu(z)`."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)


def dense_projection(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` (nn.Linear's product, weight `[out, in]`): on the CPU
    through our blocked kernel (MLX's CPU matmul is 10-100x slower on the
    machines measured), elsewhere MLX's matmul."""
    if (
        mx.default_device() == mx.cpu
        and x.dtype == weight.dtype
        and x.dtype
        in (
            mx.float32,
            mx.float16,
            mx.bfloat16,
        )
    ):
        return _ext.linear_projection(x, weight, None)
    return x @ weight.T


def _project(module: nn.Module, x: mx.array) -> mx.array:
    """One input projection: a plain bias-free Linear through
    `dense_projection`, anything else (quantized, LoRA-wrapped, with bias)
    by calling the module itself, so every wrapper mlx-lm's tools put there
    is followed."""
    if type(module) is nn.Linear and "bias" not in module:
        return dense_projection(x, module.weight)
    return module(x)


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
        """The projections whose outputs make the packed layout, in order."""
        raise NotImplementedError

    def _packed_columns(self) -> mx.array | None:
        """The columns of the concatenated projection outputs in packed
        order, or None where they are in packed order already."""
        raise NotImplementedError

    def packed_projection(self, x: mx.array) -> mx.array:
        """The segment's packed input `[q | k | v | z | b | a]` for `x`,
        from the current projection modules."""
        parts = [_project(m, x) for m in self._projection_modules()]
        mixed = mx.concatenate(parts, axis=-1)
        columns = self._packed_columns()
        return mixed if columns is None else mx.take(mixed, columns, axis=-1)

    def __call__(
        self,
        inputs: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        B, S, _ = inputs.shape
        sharding_group = getattr(self, "sharding_group", None)
        if sharding_group is not None:
            inputs = nn.layers.distributed.sum_gradients(sharding_group)(inputs)

        mixed = self.packed_projection(inputs)
        conv_state = state = None
        if cache is not None:
            conv_state, state = cache[0], cache[1]
            # A cache filled by another implementation may hold other dtypes.
            if conv_state is not None and conv_state.dtype != mixed.dtype:
                conv_state = conv_state.astype(mixed.dtype)
            if state is not None and state.dtype != mx.float32:
                state = state.astype(mx.float32)

        # A trimmable cache keeps the states after the call's last tokens:
        # the segment returns them as checkpoints.
        checkpoints = kept_positions(cache, S)

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
        if cache is not None:
            store_in_cache(cache, [conv_state, state], S, checkpoints, kept)

        out = out.reshape(B, S, -1)
        if type(self.out_proj) is nn.Linear and "bias" not in self.out_proj:
            out = dense_projection(out, self.out_proj.weight)
        else:  # quantized (or otherwise replaced) output projection
            out = self.out_proj(out)
        if sharding_group is not None:
            out = mx.distributed.all_sum(out, group=sharding_group)
        return out


class GatedDeltaNet(_GatedDeltaNetBase):
    """mlx-lm's `Qwen3NextGatedDeltaNet`, with the same parameters
    (`in_proj_qkvz`, `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`,
    `out_proj`) and cache (`ArraysCache`: `[conv_state, state]`).

    `in_proj_qkvz` and `in_proj_ba` are packed per key-head group, as in the
    checkpoints: `[q | k | v_group | z_group]` and `[b_group | a_group]` for
    each key head; the packed projection reorders their output columns.
    """

    def __init__(self, config: Any):
        super().__init__(config)
        self.in_proj_qkvz = nn.Linear(
            self.hidden_size, self.key_dim * 2 + self.value_dim * 2, bias=False
        )
        self.in_proj_ba = nn.Linear(self.hidden_size, self.num_v_heads * 2, bias=False)

    def _projection_modules(self):
        return [self.in_proj_qkvz, self.in_proj_ba]

    def _packed_columns(self):
        nk, dk = self.num_k_heads, self.head_k_dim
        group_v = self.num_v_heads // nk * self.head_v_dim  # v (or z) per group
        group_heads = self.num_v_heads // nk  # b (or a) per group
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
        qkvz_width = 2 * self.key_dim + 2 * self.value_dim
        return mx.array(np.concatenate([qkvz_rows, ba_rows + qkvz_width]))


class Qwen35GatedDeltaNet(_GatedDeltaNetBase):
    """mlx-lm's `qwen3_5.GatedDeltaNet`, with the same parameters
    (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
    `dt_bias`, `A_log`, `norm`, `out_proj`), cache and `sharding_group`
    (mlx-lm's `shard` splits heads across ranks and works on this layer).
    The projections are already in packed order: their outputs are concatenated.
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

    def _packed_columns(self):
        return None


class OlmoHybridGatedDeltaNet(nn.Module):
    """mlx-lm's `olmo_hybrid.GatedDeltaNet`, with the same parameters
    (`q_proj`, `k_proj`, `v_proj`, `a_proj`, `b_proj`, `g_proj`, `o_proj`,
    `q_conv1d`, `k_conv1d`, `v_conv1d`, `A_log`, `dt_bias`, `o_norm`) and
    cache (`ArraysCache`: `[q conv state, k conv state, v conv state, state]`).

    The projections, the three convolutions and the gated norm are the MLX
    ops of mlx-lm's layer, with one difference: the convolutions run through
    `short_conv`, which zeroes the tokens the mask leaves out and ends each
    row's conv state at its own length, so that a left-padded prompt in a
    batch gives the tokens it gives alone (mlx-lm's layer lets the padding
    into the convolutions and does not). The recurrence is the core op
    `gated_delta_rule` (normalize_qk, scale `Dk ** -0.5`), with
    `beta = 2 sigmoid(b)` in `[0, 2]` where the model allows negative
    eigenvalues (`linear_allow_neg_eigval`). (The fused segment has one
    convolution over packed q|k|v and beta in `[0, 1]`: not this layout.)
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

    def _conv(self, x, conv, cache, slot, mask, positions):
        """Causal depthwise conv and SiLU (`short_conv`: masked inputs zeroed,
        each row's conv state ending at its own length), from the conv state
        in the cache's slot."""
        state = cache[slot] if cache is not None else None
        if state is not None:
            state = state.astype(x.dtype)
        lengths = cache.lengths if cache is not None else None
        return short_conv(conv, self.conv_kernel_size, x, state, mask, lengths, positions)

    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        B, S, _ = x.shape
        positions = kept_positions(cache, S)
        q, q_state, q_kept = self._conv(self.q_proj(x), self.q_conv1d, cache, 0, mask, positions)
        k, k_state, k_kept = self._conv(self.k_proj(x), self.k_conv1d, cache, 1, mask, positions)
        v, v_state, v_kept = self._conv(self.v_proj(x), self.v_conv1d, cache, 2, mask, positions)
        q = q.reshape(B, S, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, S, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, S, self.num_v_heads, self.head_v_dim)

        # The gates in float32: g = -exp(A_log) softplus(a + dt_bias) is the
        # log of mlx-lm's linear decay; beta in [0, 1], or [0, 2].
        a = self.a_proj(x).astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias)
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32))
        if self.allow_neg_eigval:
            beta = 2.0 * beta
        out = recur_in_cache(
            cache,
            [q_state, k_state, v_state],
            [q_kept, k_kept, v_kept],
            q,
            k,
            v,
            g,
            beta,
            scale=self.head_k_dim**-0.5,
            mask=mask,
            positions=positions,
        )

        # o_norm: rms_norm(out) weight, times silu(gate), in float32.
        gate = self.g_proj(x).reshape(B, S, self.num_v_heads, self.head_v_dim)
        normed = mx.fast.rms_norm(out, self.o_norm.weight, self.o_norm.eps)
        out = (nn.silu(gate.astype(mx.float32)) * normed.astype(mx.float32)).astype(out.dtype)
        return self.o_proj(out.reshape(B, S, -1))


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
        nn.silu(conv(padded)),
        conv_window(padded, keep, x.shape[1], lengths),
        conv_windows(padded, keep, positions, lengths),
    )


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


def kept_positions(cache, tokens):
    """The positions of a call of `tokens` tokens after which the layer's
    cache keeps the states, if it is a trimmable cache
    (mlx_gated_delta.cache.TrimmableArraysCache), else None."""
    if cache is not None and hasattr(cache, "checkpoints_for"):
        return cache.checkpoints_for(tokens)
    return None


def store_in_cache(cache, slots, tokens, positions=None, slot_checkpoints=()):
    """Stores a call's new value of every cache slot (mlx-lm's layout: the
    conv states, then the state) and advances the cache by the call's
    `tokens`. A trimmable cache also keeps the slots after each of
    `positions` (`kept_positions`): `slot_checkpoints` holds each slot's
    values there, in the order of `positions`."""
    if hasattr(cache, "checkpoints_for"):
        kept = None
        if positions:
            kept = [[values[n] for values in slot_checkpoints] for n in range(len(positions))]
        cache.update(slots, tokens, kept)
    else:
        for slot, value in enumerate(slots):
            cache[slot] = value
    cache.advance(tokens)


def recur_in_cache(
    cache, conv_states, conv_checkpoints, q, k, v, g, beta, *, scale, mask, positions
):
    """The recurrence of a layer with mlx-lm's cache layout (its conv
    states, then the state in the last slot): q and k L2-normalized, the
    state read as float32 (a cache filled by another implementation may
    hold another dtype), and the states after `positions` computed in the
    same pass. Then stores the call's `conv_states` (and their
    `conv_checkpoints`) and the new state (`store_in_cache`). Returns y.
    Without a cache the state starts at zero and is dropped."""
    state = cache[-1] if cache is not None else None
    if state is not None and state.dtype != mx.float32:
        state = state.astype(mx.float32)
    out, state, *checkpoint_states = gated_delta_rule(
        q, k, v, g, beta, state, scale=scale, mask=mask, normalize_qk=True, checkpoints=positions
    )
    if cache is not None:
        store_in_cache(
            cache,
            [*conv_states, state],
            q.shape[1],
            positions,
            [*conv_checkpoints, *checkpoint_states],
        )
    return out


def kda_log_decay(f, A_log, dt_bias, lower_bound=None):
    """The per-key-channel log decays `g` `[B, T, H, Dk]` (float32) of Kimi
    Delta Attention, from the gate logits `f` `[B, T, H, Dk]`, `A_log` (H
    values, any shape) and `dt_bias` (`H * Dk` values, read per head and key
    channel):

    - `lower_bound=None` (Kimi-Linear, Kimi-K3 without it):
      `g = -exp(A_log[h]) softplus(f + dt_bias[h, c])`, in `(-inf, 0]`.
    - a `lower_bound` (Bailing-MoE-V3, Kimi-K3 with `gate_lower_bound`):
      `g = lower_bound sigmoid(exp(A_log[h]) (f + dt_bias[h, c]))`, in
      `[lower_bound, 0]`: each token keeps at least `exp(lower_bound)` of
      every state column.

    The log of mlx-lm's linear decays (`compute_g`, `compute_lower_bound_g`)
    for the core op's per-key gates; the activations are read as float32.
    """
    H, D = f.shape[-2], f.shape[-1]
    rate = mx.exp(A_log.reshape(H, 1).astype(mx.float32))
    logits = f.astype(mx.float32) + dt_bias.reshape(H, D).astype(mx.float32)
    if lower_bound is None:
        return -rate * nn.softplus(logits)
    return lower_bound * mx.sigmoid(rate * logits)


class KimiDeltaAttention(nn.Module):
    """mlx-lm's `kimi_linear.KimiDeltaAttention` (Kimi Delta Attention), with
    the same parameters (`q_proj`, `k_proj`, `v_proj`, `q_conv`, `k_conv`,
    `v_conv`, `f_a_proj`, `f_b_proj`, `b_proj`, `g_a_proj`, `g_b_proj`,
    `A_log` `[1, 1, H, 1]`, `dt_bias` `[H * Dk]`, `o_norm`, `o_proj`) and
    cache (`[q, k, v conv states, state]`).

    Its gates are per key channel: `g[t, h, c] = -exp(A_log[h])
    softplus(f[t, h, c] + dt_bias[h, c])`, with `dt_bias` read per head and
    channel (the `[H, Dk]` reading mlx-lm#1792's GPU kernel got wrong), into
    the core op's per-key gates. Projections, convolutions and the output
    norm are mlx-lm's MLX ops.
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

    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        positions = kept_positions(cache, T)
        if cache is not None:
            q_state, k_state, v_state, _ = cache
            lengths = cache.lengths
        else:
            q_state = k_state = v_state = lengths = None
        K = self.conv_kernel
        q, q_state, q_kept = short_conv(
            self.q_conv.conv, K, self.q_proj(x), q_state, mask, lengths, positions
        )
        k, k_state, k_kept = short_conv(
            self.k_conv.conv, K, self.k_proj(x), k_state, mask, lengths, positions
        )
        v, v_state, v_kept = short_conv(
            self.v_conv.conv, K, self.v_proj(x), v_state, mask, lengths, positions
        )

        # Per-key gates in float32: [B, T, H, Dk].
        f = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)
        g = kda_log_decay(f, self.A_log, self.dt_bias)
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32))
        q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))
        out = recur_in_cache(
            cache,
            [q_state, k_state, v_state],
            [q_kept, k_kept, v_kept],
            q,
            k,
            v,
            g,
            beta,
            scale=self.scale,
            mask=mask,
            positions=positions,
        )

        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, H, D)
        out = (self.o_norm(out) * mx.sigmoid(gate)).reshape(B, T, -1)
        return self.o_proj(out)


class KimiK3DeltaAttention(nn.Module):
    """mlx-lm's `kimi_k3.KimiK3DeltaAttention`, with the same parameters
    (`qkv_proj`, `qkv_conv` (child `conv`), `f_a_proj`, `f_b_proj`, `b_proj`,
    `g_a_proj` and `g_b_proj`, or `g_proj` with `use_full_rank_gate`, `A_log`
    `[H]`, `dt_bias` `[H * Dk]`, `o_norm`, `o_proj`) and cache (`ArraysCache`:
    `[conv state, state]`, the conv state over the packed `q | k | v`).

    Kimi-Linear's layer with one projection and one convolution for q, k and
    v, and per-key-channel gates `kda_log_decay(f, A_log, dt_bias,
    gate_lower_bound)`: lower-bounded where the model's `linear_attn_config`
    sets `gate_lower_bound`, Kimi-Linear's otherwise. The recurrence is the
    core op; the rest are mlx-lm's MLX ops. (mlx-lm's compiled one-token
    step on Metal computes the same thing.)
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

    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        positions = kept_positions(cache, T)
        if cache is not None:
            conv_state, lengths = cache[0], cache.lengths
        else:
            conv_state = lengths = None
        qkv, conv_state, conv_kept = short_conv(
            self.qkv_conv.conv,
            self.conv_kernel,
            self.qkv_proj(x),
            conv_state,
            mask,
            lengths,
            positions,
        )
        q, k, v = mx.split(qkv.reshape(B, T, 3, H, D), 3, axis=2)

        f = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)
        g = kda_log_decay(f, self.A_log, self.dt_bias, self.lower_bound)
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32))
        q, k, v = (t.squeeze(2) for t in (q, k, v))
        out = recur_in_cache(
            cache,
            [conv_state],
            [conv_kept],
            q,
            k,
            v,
            g,
            beta,
            scale=self.scale,
            mask=mask,
            positions=positions,
        )

        if self.use_full_rank_gate:
            gate = self.g_proj(x)
        else:
            gate = self.g_b_proj(self.g_a_proj(x))
        out = self.o_norm(out) * mx.sigmoid(gate.reshape(B, T, H, D))
        return self.o_proj(out.reshape(B, T, -1))


class BailingKDA(nn.Module):
    """mlx-lm's `bailing_moe_v3.BailingKDA` (Bailing-MoE-V3's Kimi Delta
    Attention), with the same parameters (`q_proj`, `k_proj`, `v_proj`,
    `q_conv1d`, `k_conv1d`, `v_conv1d`, `f_proj`, `b_proj`, `g_proj`,
    `A_log` `[H]`, `dt_bias` `[H * Dk]`, `o_norm`, `o_proj`) and cache
    (`ArraysCache`: `[q, k, v conv states, state]`).

    Its gates are full rank (`f_proj`, no low-rank pair) and lower-bounded:
    `kda_log_decay(f, A_log, dt_bias, kda_lower_bound)`, per key channel,
    into the core op. Convolutions, projections and the output norm are
    mlx-lm's MLX ops. mlx-lm implements only `no_kda_lora` and
    `kda_safe_gate` (the lower-bounded gate); other settings are refused
    as there.
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

    def _conv(self, x, conv, cache, slot, mask, positions):
        """One short convolution, from the conv state in the cache's slot
        (`short_conv`'s output, new conv state and checkpoints)."""
        state = cache[slot] if cache is not None else None
        lengths = cache.lengths if cache is not None else None
        return short_conv(conv, self.conv_kernel_size, x, state, mask, lengths, positions)

    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None = None,
        cache: Any | None = None,
    ) -> mx.array:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        positions = kept_positions(cache, T)
        q, q_state, q_kept = self._conv(self.q_proj(x), self.q_conv1d, cache, 0, mask, positions)
        k, k_state, k_kept = self._conv(self.k_proj(x), self.k_conv1d, cache, 1, mask, positions)
        v, v_state, v_kept = self._conv(self.v_proj(x), self.v_conv1d, cache, 2, mask, positions)
        q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))

        f = self.f_proj(x).reshape(B, T, H, D)
        g = kda_log_decay(f, self.A_log, self.dt_bias, self.lower_bound)
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32))
        out = recur_in_cache(
            cache,
            [q_state, k_state, v_state],
            [q_kept, k_kept, v_kept],
            q,
            k,
            v,
            g,
            beta,
            scale=self.head_dim**-0.5,
            mask=mask,
            positions=positions,
        )

        gate = self.g_proj(x).reshape(B, T, H, D)
        out = self.o_norm(out)
        out = out * mx.sigmoid(gate.astype(mx.float32)).astype(out.dtype)
        return self.o_proj(out.reshape(B, T, -1))
