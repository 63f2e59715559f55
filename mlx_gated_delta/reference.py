"""Float64 NumPy oracle of the gated-delta ops (API.md), independent of the C++.

Every function here transcribes the contract directly: a loop over tokens, with
batch rows and heads vectorised, everything in float64. The tests compare each
fast path against these functions through the contracts of `testing.contracts`.

Arguments may be NumPy arrays of any float dtype or mlx arrays; callers that
test a low-precision path pass the inputs already rounded to that dtype, so the
oracle sees exactly the numbers the kernel sees.
"""

import mlx.core as mx
import numpy as np

# normalize_qk: x / sqrt(sum(x * x) + eps) per head (API.md section 1).
QK_NORM_EPS = 1e-6


def gated_delta_rule_reference(
    q,
    k,
    v,
    g,
    beta,
    state=None,
    *,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
):
    """The core recurrence of API.md section 1 with the log-space decay `g`.

    Returns `(y, state)` as float64 arrays: y `[B, T, Hv, Dv]`, state
    `[B, Hv, Dv, Dk]`.
    """
    q, k, v, g, beta = (to_float64(x) for x in (q, k, v, g, beta))
    key_dim = q.shape[-1]
    if normalize_qk:
        q = _l2_normalize(q)
        k = _l2_normalize(k)
    if scale is None:
        scale = key_dim**-0.5
    return _delta_rule_recurrence(
        q, k, v, np.exp(g), beta, state, scale, head_mapping, mask
    )


def gated_delta_update_reference(
    q, k, v, gamma, beta, initial_state=None, mask=None
):
    """`mx.fast.gated_delta_update`'s meaning (API.md section 2).

    `gamma` is the linear decay and is applied as it is, never through
    `log`, so `gamma == 0` wipes the state exactly. No scale (1), grouped
    mapping, no normalisation.
    """
    q, k, v, gamma, beta = (to_float64(x) for x in (q, k, v, gamma, beta))
    return _delta_rule_recurrence(
        q, k, v, gamma, beta, initial_state, 1.0, "grouped", mask
    )


def key_head_of(value_heads, key_heads, head_mapping):
    """Index array: the key head each value head reads (API.md, head mappings)."""
    value_head = np.arange(value_heads)
    if head_mapping == "grouped":
        return value_head // (value_heads // key_heads)
    if head_mapping == "interleaved":
        return value_head % key_heads
    raise ValueError(
        f"head_mapping must be 'grouped' or 'interleaved', got {head_mapping!r}"
    )


def _delta_rule_recurrence(
    q, k, v, decay, beta, state, scale, head_mapping, mask
):
    batch, tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]

    # Give every value head its key head's q and k: [B, T, Hv, Dk].
    key_head = key_head_of(value_heads, key_heads, head_mapping)
    q = q[:, :, key_head]
    k = k[:, :, key_head]

    if state is None:
        S = np.zeros((batch, value_heads, value_dim, key_dim))
    else:
        S = to_float64(state).copy()
    active = (
        np.ones((batch, tokens), dtype=bool)
        if mask is None
        else np.asarray(mask, dtype=bool)
    )

    y = np.zeros((batch, tokens, value_heads, value_dim))
    for t in range(tokens):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
        decayed = decay[:, t, :, None, None] * S
        delta = beta[:, t, :, None] * (
            v_t - np.einsum("bhvk,bhk->bhv", decayed, k_t)
        )
        updated = decayed + delta[..., :, None] * k_t[..., None, :]
        # A masked token is skipped: its state is the previous one, its y is 0.
        step = active[:, t, None, None, None]
        S = np.where(step, updated, S)
        y[:, t] = np.where(
            step[..., 0],
            scale * np.einsum("bhvk,bhk->bhv", updated, q_t),
            0.0,
        )
    return y, S


def gated_delta_rule_reference_vjp(
    q,
    k,
    v,
    g,
    beta,
    state=None,
    *,
    y_cotangent=None,
    state_cotangent=None,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
):
    """Reverse-mode gradient of `gated_delta_rule_reference`, in float64.

    Given the cotangents of `y` `[B, T, Hv, Dv]` and of the final state
    `[B, Hv, Dv, Dk]` (either may be None: zero), returns a dict of the
    gradients of the inputs: `q`, `k` `[B, T, Hk, Dk]` (summed over the value
    heads that read each key head), `v`, `g`, `beta`, `state`, and `decay`, the
    gradient with respect to the linear decay `exp(g)` (what
    `gated_delta_update`'s `gamma` receives). At a wipe (`g = -inf`) the
    gradient of `g` is exactly 0 and that of the decay is finite.
    """
    q, k, v, g, beta = (to_float64(x) for x in (q, k, v, g, beta))
    key_dim = q.shape[-1]
    if scale is None:
        scale = key_dim**-0.5
    raw_q, raw_k = q, k
    if normalize_qk:
        q, k = _l2_normalize(q), _l2_normalize(k)
    grads = _delta_rule_recurrence_vjp(
        q, k, v, np.exp(g), beta, state, y_cotangent, state_cotangent, scale,
        head_mapping, mask,
    )
    if normalize_qk:
        grads["q"] = _l2_normalize_vjp(raw_q, grads["q"])
        grads["k"] = _l2_normalize_vjp(raw_k, grads["k"])
    # d/dg exp(g) = exp(g): exactly 0 at a wipe, never 0 * inf.
    grads["g"] = grads["decay"] * np.exp(g)
    return grads


def gated_delta_update_reference_vjp(
    q, k, v, gamma, beta, initial_state=None, mask=None, *,
    y_cotangent=None, state_cotangent=None,
):
    """Reverse-mode gradient of `gated_delta_update_reference`, in float64.

    Returns the dict of `gated_delta_rule_reference_vjp` with `gamma` (the
    gradient of the linear decay, finite and exact at `gamma == 0`) in place
    of `g` and `decay`.
    """
    q, k, v, gamma, beta = (to_float64(x) for x in (q, k, v, gamma, beta))
    grads = _delta_rule_recurrence_vjp(
        q, k, v, gamma, beta, initial_state, y_cotangent, state_cotangent, 1.0,
        "grouped", mask,
    )
    grads["gamma"] = grads.pop("decay")
    return grads


def _delta_rule_recurrence_vjp(
    q, k, v, decay, beta, state, y_cotangent, state_cotangent, scale,
    head_mapping, mask,
):
    """The recurrence backward: the forward again, keeping every state, then
    the tokens in reverse order carrying dS, the cotangent of the state.

    Per active token, forward:      Sd = a S_prev;  p = Sd k;
        d = beta (v - p);  S = Sd + d k^T;  y = scale S q.
    Backward, in reverse:           dS += scale dy q^T;  dq = scale S^T dy;
        dd = dS k;  dk = dS^T d;  dv = beta dd;  dbeta = dd.(v - p);
        dp = -beta dd;  dSd = dS + dp k^T;  dk += Sd^T dp;
        da = <dSd, S_prev>;  dS_prev = a dSd.
    A masked token passes dS through and gets zero gradients.
    """
    batch, tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    key_head = key_head_of(value_heads, key_heads, head_mapping)
    q_h = q[:, :, key_head]  # [B, T, Hv, Dk]
    k_h = k[:, :, key_head]
    active = (
        np.ones((batch, tokens), dtype=bool)
        if mask is None
        else np.asarray(mask, dtype=bool)
    )
    dy = (
        np.zeros((batch, tokens, value_heads, value_dim))
        if y_cotangent is None
        else to_float64(y_cotangent)
    )

    # states[t] is the state before token t; states[tokens] the final one.
    states = np.zeros((tokens + 1, batch, value_heads, value_dim, key_dim))
    if state is not None:
        states[0] = to_float64(state)
    for t in range(tokens):
        decayed = decay[:, t, :, None, None] * states[t]
        delta = beta[:, t, :, None] * (
            v[:, t] - np.einsum("bhvk,bhk->bhv", decayed, k_h[:, t])
        )
        updated = decayed + delta[..., :, None] * k_h[:, t, :, None, :]
        states[t + 1] = np.where(active[:, t, None, None, None], updated, states[t])

    dS = (
        np.zeros((batch, value_heads, value_dim, key_dim))
        if state_cotangent is None
        else to_float64(state_cotangent).copy()
    )
    dq = np.zeros((batch, tokens, value_heads, key_dim))
    dk = np.zeros((batch, tokens, value_heads, key_dim))
    dv = np.zeros((batch, tokens, value_heads, value_dim))
    da = np.zeros((batch, tokens, value_heads))
    dbeta = np.zeros((batch, tokens, value_heads))
    for t in reversed(range(tokens)):
        step = active[:, t]
        q_t, k_t, v_t = q_h[:, t], k_h[:, t], v[:, t]
        a_t, beta_t = decay[:, t, :, None], beta[:, t, :, None]
        previous, updated = states[t], states[t + 1]
        decayed = a_t[..., None] * previous
        predicted = np.einsum("bhvk,bhk->bhv", decayed, k_t)
        delta = beta_t * (v_t - predicted)

        dS_step = dS + scale * dy[:, t, :, :, None] * q_t[:, :, None, :]
        dd = np.einsum("bhvk,bhk->bhv", dS_step, k_t)
        dp = -beta_t * dd
        dSd = dS_step + dp[..., :, None] * k_t[:, :, None, :]
        grads_t = {
            "q": scale * np.einsum("bhvk,bhv->bhk", updated, dy[:, t]),
            "k": np.einsum("bhvk,bhv->bhk", dS_step, delta)
            + np.einsum("bhvk,bhv->bhk", decayed, dp),
            "v": beta_t * dd,
            "a": np.einsum("bhvk,bhvk->bh", dSd, previous),
            "beta": np.einsum("bhv,bhv->bh", dd, v_t - predicted),
        }
        for name, out in (("q", dq), ("k", dk), ("v", dv), ("a", da), ("beta", dbeta)):
            value = grads_t[name]
            where = step.reshape(step.shape + (1,) * (value.ndim - 1))
            out[:, t] = np.where(where, value, 0.0)
        dS = np.where(step[:, None, None, None], a_t[..., None] * dSd, dS)

    # Key-head gradients: the sum over the value heads that read each key head.
    dq_key = np.zeros((batch, tokens, key_heads, key_dim))
    dk_key = np.zeros((batch, tokens, key_heads, key_dim))
    np.add.at(dq_key, (slice(None), slice(None), key_head), dq)
    np.add.at(dk_key, (slice(None), slice(None), key_head), dk)
    return {
        "q": dq_key, "k": dk_key, "v": dv, "decay": da, "beta": dbeta, "state": dS,
    }


def _l2_normalize_vjp(x, cotangent):
    """Gradient through x / n, n = sqrt(sum(x * x) + eps), per head:
    (c - x_hat (x_hat . c)) / n."""
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)
    x_hat = x / norm
    return (cotangent - x_hat * np.sum(x_hat * cotangent, axis=-1, keepdims=True)) / norm


def _l2_normalize(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)


def to_float64(x):
    """A float64 NumPy copy of an mlx or NumPy array of any float dtype."""
    # NumPy cannot read an mlx bfloat16 buffer; widening to float32 is exact.
    if isinstance(x, mx.array) and x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------
# The fused layer segment (API.md section 3).
# ---------------------------------------------------------------------------


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
):
    """The whole token-mixer segment in float64.

    Per unmasked token: causal depthwise conv over q|k|v with the carried conv
    state, SiLU; gates `g = rate * softplus(a + dt_bias)`, `beta = sigmoid(b)`;
    the recurrence with L2-normalized q, k and scale `Dk ** -0.5` (through
    `gated_delta_rule_reference`); `out = rms_norm(y) * norm_weight * silu(z)`.
    A masked token is skipped: it enters neither the conv window nor the
    recurrent state, and its `out` row is 0.

    Returns `(out [B,T,Hv,Dv], conv_state [B,K-1,C], state [B,Hv,Dv,Dk])` as
    float64 arrays.
    """
    x = to_float64(mixed_qkvzba)
    batch, tokens, width = x.shape
    qk_width = key_heads * key_dim
    v_width = value_heads * value_dim
    channels = 2 * qk_width + v_width
    if width != channels + v_width + 2 * value_heads:
        raise ValueError(f"packed width {width} does not match the head layout")
    weight = to_float64(conv_weight).reshape(channels, -1)  # [C, K] or [C, K, 1]
    kernel = weight.shape[1]

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

    window = (
        np.zeros((batch, kernel - 1, channels))
        if conv_state is None
        else to_float64(conv_state).copy()
    )
    active = (
        np.ones((batch, tokens), dtype=bool)
        if mask is None
        else np.asarray(mask, dtype=bool)
    )
    qkv = np.zeros((batch, tokens, channels))
    for b in range(batch):
        for t in range(tokens):
            if not active[b, t]:
                continue  # skipped: the window does not move
            taps = np.concatenate([window[b], x[b, t, None, :channels]])  # [K, C]
            window[b] = taps[1:]
            # The newest input meets the last tap, as in mlx's Conv1d.
            conv = np.einsum("kc,ck->c", taps, weight)
            qkv[b, t] = conv * _sigmoid(conv)

    z = x[..., channels : channels + v_width].reshape(
        batch, tokens, value_heads, value_dim
    )
    b_gate = x[..., channels + v_width : channels + v_width + value_heads]
    a_gate = x[..., channels + v_width + value_heads :]
    g = rate * np.logaddexp(0.0, a_gate + to_float64(dt_bias))  # softplus
    beta = _sigmoid(b_gate)

    q = qkv[..., :qk_width].reshape(batch, tokens, key_heads, key_dim)
    k = qkv[..., qk_width : 2 * qk_width].reshape(batch, tokens, key_heads, key_dim)
    v = qkv[..., 2 * qk_width :].reshape(batch, tokens, value_heads, value_dim)
    y, state = gated_delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        state,
        scale=key_dim**-0.5,
        head_mapping=head_mapping,
        mask=active,
        normalize_qk=True,
    )

    rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + norm_eps)
    out = y / rms * to_float64(norm_weight) * (z * _sigmoid(z))
    out = np.where(active[..., None, None], out, 0.0)
    return out, window, state


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))
