"""The fused layer segment (docs/contract.md), stage by stage: the conv, the
gates and the gated norm around the recurrent oracle.
"""

import numpy as np

from .recurrent import gated_delta_rule_reference, to_float64


def gated_delta_segment_reference(
    mixed_qkvzba,
    conv_weight,
    decay_parameter,
    dt_bias,
    norm_weight,
    conv_state=None,
    state=None,
    *,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    decay_parameterization="log_rate",
    head_mapping="grouped",
    norm_eps=1e-6,
    mask=None,
    lower_bound=None,
    allow_neg_eigval=False,
    output_gate="silu",
):
    """The whole token-mixer segment in float64.

    Per unmasked token: causal depthwise conv over q|k|v with the carried conv
    state, SiLU; gates `g = rate * softplus(a + dt_bias)` (or
    `lower_bound * sigmoid(-rate * (a + dt_bias))`), per value head, or per
    value head and key channel when `dt_bias` is `[Hv, Dk]`;
    `beta = sigmoid(b)` (twice that with `allow_neg_eigval`); the recurrence
    with L2-normalized q, k and scale `Dk ** -0.5` (through
    `gated_delta_rule_reference`); `out = rms_norm(y) * norm_weight * o(z)`
    with the output gate `o` silu or sigmoid. A masked token is skipped: it
    enters neither the conv window nor the recurrent state, and its `out`
    row is 0.

    Returns `(out [B,T,Hv,Dv], conv_state [B,K-1,C], state [B,Hv,Dv,Dk])` as
    float64 arrays.
    """
    core = segment_core_inputs(
        mixed_qkvzba,
        conv_weight,
        decay_parameter,
        dt_bias,
        conv_state,
        key_heads=key_heads,
        value_heads=value_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        decay_parameterization=decay_parameterization,
        head_mapping=head_mapping,
        mask=mask,
        lower_bound=lower_bound,
        allow_neg_eigval=allow_neg_eigval,
    )
    y, state = gated_delta_rule_reference(*core.arrays, state, **core.options)
    active = core.options["mask"]
    new_window = collect_conv_state(core.x, core.window, active, core.layout)
    out = gated_norm(y, core.x, norm_weight, active, core.layout, norm_eps, output_gate)
    return out, new_window, state


class SegmentCore:
    """What the segment's recurrence sees: q, k, v, g, beta (`arrays`, float64,
    the layout of `gated_delta_rule_reference`), its keyword `options` (the
    mask as a bool array), and the packed input, conv window and layout they
    came from."""

    def __init__(self, arrays, options, x, window, layout):
        self.arrays, self.options = arrays, options
        self.x, self.window, self.layout = x, window, layout


def segment_core_inputs(
    mixed_qkvzba,
    conv_weight,
    decay_parameter,
    dt_bias,
    conv_state=None,
    *,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    decay_parameterization="log_rate",
    head_mapping="grouped",
    mask=None,
    lower_bound=None,
    allow_neg_eigval=False,
):
    """The segment's stages before the recurrence (prepare_conv and
    prepare_gates) in float64: a `SegmentCore`."""
    x = to_float64(mixed_qkvzba)
    batch, tokens, width = x.shape
    per_key_gates = to_float64(dt_bias).ndim == 2
    layout = SegmentLayout(key_heads, value_heads, key_dim, value_dim, per_key_gates)
    if width != layout.mixed_qkvzba_width:
        raise ValueError(f"packed width {width} does not match the head layout")
    weight = to_float64(conv_weight).reshape(layout.channels, -1)  # [C, K] or [C, K, 1]
    window = (
        np.zeros((batch, weight.shape[1] - 1, layout.channels))
        if conv_state is None
        else to_float64(conv_state)
    )
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)

    qkv = prepare_conv(x, weight, window, active, layout)
    g, beta = prepare_gates(
        x,
        decay_parameter,
        dt_bias,
        layout,
        decay_parameterization,
        lower_bound=lower_bound,
        allow_neg_eigval=allow_neg_eigval,
    )
    q = qkv[..., : layout.qk_width].reshape(batch, tokens, key_heads, key_dim)
    k = qkv[..., layout.qk_width : 2 * layout.qk_width].reshape(batch, tokens, key_heads, key_dim)
    v = qkv[..., 2 * layout.qk_width :].reshape(batch, tokens, value_heads, value_dim)
    options = dict(scale=key_dim**-0.5, head_mapping=head_mapping, mask=active, normalize_qk=True)
    return SegmentCore((q, k, v, g, beta), options, x, window, layout)


class SegmentLayout:
    """Where the parts of one packed token row `[q | k | v | z | b | a]` lie;
    `a` has one value per value head, or per value head and key channel
    (`per_key_gates`)."""

    def __init__(self, key_heads, value_heads, key_dim, value_dim, per_key_gates=False):
        self.value_heads, self.value_dim, self.key_dim = value_heads, value_dim, key_dim
        self.per_key_gates = per_key_gates
        self.qk_width = key_heads * key_dim
        self.v_width = value_heads * value_dim
        self.channels = 2 * self.qk_width + self.v_width  # what the conv sees
        self.z_offset = self.channels
        self.b_offset = self.z_offset + self.v_width
        self.a_offset = self.b_offset + value_heads
        self.gate_width = value_heads * key_dim if per_key_gates else value_heads
        self.mixed_qkvzba_width = self.a_offset + self.gate_width


def prepare_conv(x, weight, window, active, layout):
    """Stage prepare_conv: causal depthwise conv over q|k|v of each unmasked
    token (the carried conv state first, the newest input on the last tap, as
    in mlx's Conv1d), then SiLU; `[B, T, C]`, 0 on masked tokens, which enter
    no window."""
    batch, tokens = active.shape
    history = _conv_history(x, window, active, layout)
    taps = weight.shape[1]
    qkv = np.zeros((batch, tokens, layout.channels))
    for b in range(batch):
        for n, t in enumerate(np.flatnonzero(active[b])):
            rows = history[b][n : n + taps]  # [K, C]: this token's window
            conv = np.einsum("kc,ck->c", rows, weight)
            qkv[b, t] = conv * _sigmoid(conv)
    return qkv


def collect_conv_state(x, window, active, layout):
    """Stage collect_conv_state: the last K-1 pre-conv rows of each batch row
    (masked tokens skipped), reaching back into the carried state, `[B, K-1, C]`."""
    rows = window.shape[1]
    history = _conv_history(x, window, active, layout)
    return np.stack([h[len(h) - rows :] for h in history])


def prepare_gates(
    x,
    decay_parameter,
    dt_bias,
    layout,
    decay_parameterization="log_rate",
    *,
    lower_bound=None,
    allow_neg_eigval=False,
):
    """Stage prepare_gates: `(g, beta)`. With u = a + dt_bias, g = rate
    softplus(u), or lower_bound sigmoid(-rate u) with a lower bound, `[B, T,
    Hv]` (or `[B, T, Hv, Dk]` per key channel, the rate read per head); beta =
    sigmoid(b) `[B, T, Hv]`, twice that with allow_neg_eigval."""
    decay_parameter = to_float64(decay_parameter)
    if decay_parameterization == "log_rate":
        rate = -np.exp(decay_parameter)
    elif decay_parameterization == "negative_rate":
        rate = decay_parameter
    else:
        raise ValueError(
            "decay_parameterization must be 'log_rate' or 'negative_rate', got "
            f"{decay_parameterization!r}"
        )
    b = x[..., layout.b_offset : layout.a_offset]
    a = x[..., layout.a_offset : layout.mixed_qkvzba_width]
    if layout.per_key_gates:
        a = a.reshape(*a.shape[:-1], layout.value_heads, layout.key_dim)
        rate = rate[:, None]
    u = a + to_float64(dt_bias)
    if lower_bound is None:
        g = rate * np.logaddexp(0.0, u)  # softplus
    else:
        g = lower_bound * _sigmoid(-rate * u)
    return g, (2.0 if allow_neg_eigval else 1.0) * _sigmoid(b)


def gated_norm(y, x, norm_weight, active, layout, norm_eps=1e-6, output_gate="silu"):
    """Stage gated_norm: rms_norm(y) norm_weight o(z) per (token, value
    head), with the output gate o silu or sigmoid, 0 on masked tokens;
    `[B, T, Hv, Dv]`."""
    batch, tokens = active.shape
    z = x[..., layout.z_offset : layout.b_offset].reshape(
        batch, tokens, layout.value_heads, layout.value_dim
    )
    y = to_float64(y)
    rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + norm_eps)
    if output_gate not in ("silu", "sigmoid"):
        raise ValueError(f"output_gate must be 'silu' or 'sigmoid', got {output_gate!r}")
    gate = _sigmoid(z) if output_gate == "sigmoid" else z * _sigmoid(z)
    out = y / rms * to_float64(norm_weight) * gate
    return np.where(active[..., None, None], out, 0.0)


def _conv_history(x, window, active, layout):
    """Per batch row, the pre-conv rows the conv sees, oldest first: the
    carried conv state, then every unmasked token's q|k|v."""
    return [
        np.concatenate([window[b], x[b, active[b], : layout.channels]]) for b in range(x.shape[0])
    ]


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))
