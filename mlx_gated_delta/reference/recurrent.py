"""The recurrent oracles: the contract (docs/contract.md) transcribed as a loop
over tokens, with batch rows and heads vectorised, everything in float64; their
reverse-mode gradients; and the helpers every oracle shares (`to_float64`,
`qk_norm`, `key_head_of`).
"""

import mlx.core as mx
import numpy as np

# normalize_qk: x / sqrt(sum(x * x) + eps) per head (docs/contract.md).
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
    """The core recurrence (docs/contract.md) with the log-space decay `g`.

    Returns `(y, state)` as float64 arrays: y `[B, T, Hv, Dv]`, state
    `[B, Hv, Dv, Dk]`.
    """
    q, k, v, g, beta = (to_float64(x) for x in (q, k, v, g, beta))
    key_dim = q.shape[-1]
    if normalize_qk:
        q = qk_norm(q)
        k = qk_norm(k)
    if scale is None:
        scale = key_dim**-0.5
    return _delta_rule_recurrence(q, k, v, np.exp(g), beta, state, scale, head_mapping, mask)


def state_magnitudes(
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
    """The largest |entry| per batch row and head of the entry state and of
    the state after each token: `[B, T + 1, Hv]` float64 (a masked token
    repeats the state before it). The arguments are the oracle's; `scale`
    scales y only and is accepted so that a case's options pass as they are.
    The chunked form's float32 error scales with these (docs/numerics.md)."""
    q, k, v, g, beta = (to_float64(x) for x in (q, k, v, g, beta))
    if normalize_qk:
        k = qk_norm(k)
    magnitudes = []
    _delta_rule_recurrence(
        q, k, v, np.exp(g), beta, state, 1.0, head_mapping, mask, on_state=magnitudes.append
    )
    return np.stack(magnitudes, axis=1)


def gated_delta_update_reference(q, k, v, gamma, beta, initial_state=None, mask=None):
    """`mx.fast.gated_delta_update`'s meaning (docs/contract.md).

    `gamma` is the linear decay and is applied as it is, never through
    `log`, so `gamma == 0` wipes the state exactly. No scale (1), grouped
    mapping, no normalisation.
    """
    q, k, v, gamma, beta = (to_float64(x) for x in (q, k, v, gamma, beta))
    return _delta_rule_recurrence(q, k, v, gamma, beta, initial_state, 1.0, "grouped", mask)


def key_head_of(value_heads, key_heads, head_mapping):
    """Index array: the key head each value head reads (docs/contract.md)."""
    value_head = np.arange(value_heads)
    if head_mapping == "grouped":
        return value_head // (value_heads // key_heads)
    if head_mapping == "interleaved":
        return value_head % key_heads
    raise ValueError(f"head_mapping must be 'grouped' or 'interleaved', got {head_mapping!r}")


def _delta_rule_recurrence(q, k, v, decay, beta, state, scale, head_mapping, mask, on_state=None):
    """`decay` is the linear decay, `[B, T, Hv]` or, per key channel,
    `[B, T, Hv, Dk]` (column `c` of the state decays by `decay[..., c]`).
    `on_state`, if given, receives the largest |entry| per batch row and head
    (`[B, Hv]`) of the entry state and of the state after each token."""
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
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    if on_state is not None:
        on_state(np.abs(S).max(axis=(2, 3), initial=0.0))

    y = np.zeros((batch, tokens, value_heads, value_dim))
    for t in range(tokens):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
        decayed = _column_decay(decay[:, t]) * S
        delta = beta[:, t, :, None] * (v_t - np.einsum("bhvk,bhk->bhv", decayed, k_t))
        updated = decayed + delta[..., :, None] * k_t[..., None, :]
        # A masked token is skipped: its state is the previous one, its y is 0.
        step = active[:, t, None, None, None]
        S = np.where(step, updated, S)
        y[:, t] = np.where(
            step[..., 0],
            scale * np.einsum("bhvk,bhk->bhv", updated, q_t),
            0.0,
        )
        if on_state is not None:
            on_state(np.abs(S).max(axis=(2, 3), initial=0.0))
    return y, S


def _column_decay(decay_t):
    """One token's linear decay `[B, Hv]` or `[B, Hv, Dk]` shaped to scale
    states `[B, Hv, Dv, Dk]`: per head, or per key channel (a column)."""
    if decay_t.ndim == 3:
        return decay_t[:, :, None, :]
    return decay_t[:, :, None, None]


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
    heads that read each key head), `v`, `g`, `beta`, `state`, and `gamma`, the
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
        q, k = qk_norm(q), qk_norm(k)
    grads = _delta_rule_recurrence_vjp(
        q,
        k,
        v,
        np.exp(g),
        beta,
        state,
        y_cotangent,
        state_cotangent,
        scale,
        head_mapping,
        mask,
    )
    if normalize_qk:
        grads["q"] = qk_norm_backward(raw_q, grads["q"])
        grads["k"] = qk_norm_backward(raw_k, grads["k"])
    # d/dg exp(g) = exp(g): exactly 0 at a wipe, never 0 * inf.
    grads["g"] = grads["gamma"] * np.exp(g)
    return grads


def gated_delta_update_reference_vjp(
    q,
    k,
    v,
    gamma,
    beta,
    initial_state=None,
    mask=None,
    *,
    y_cotangent=None,
    state_cotangent=None,
):
    """Reverse-mode gradient of `gated_delta_update_reference`, in float64.

    Returns the dict of `gated_delta_rule_reference_vjp` without `g`: `gamma`
    (the gradient of the linear decay) is finite and exact at `gamma == 0`.
    """
    q, k, v, gamma, beta = (to_float64(x) for x in (q, k, v, gamma, beta))
    grads = _delta_rule_recurrence_vjp(
        q,
        k,
        v,
        gamma,
        beta,
        initial_state,
        y_cotangent,
        state_cotangent,
        1.0,
        "grouped",
        mask,
    )
    return grads


def _delta_rule_recurrence_vjp(
    q,
    k,
    v,
    decay,
    beta,
    state,
    y_cotangent,
    state_cotangent,
    scale,
    head_mapping,
    mask,
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
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
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
        decayed = _column_decay(decay[:, t]) * states[t]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhvk,bhk->bhv", decayed, k_h[:, t]))
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
    da = np.zeros(decay.shape)
    dbeta = np.zeros((batch, tokens, value_heads))
    for t in reversed(range(tokens)):
        step = active[:, t]
        q_t, k_t, v_t = q_h[:, t], k_h[:, t], v[:, t]
        a_t, beta_t = _column_decay(decay[:, t]), beta[:, t, :, None]
        previous, updated = states[t], states[t + 1]
        decayed = a_t * previous
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
            # Per key channel: the sum over the state's rows only.
            "a": np.einsum(
                "bhvk,bhvk->bhk" if decay.ndim == 4 else "bhvk,bhvk->bh",
                dSd,
                previous,
            ),
            "beta": np.einsum("bhv,bhv->bh", dd, v_t - predicted),
        }
        for name, out in (("q", dq), ("k", dk), ("v", dv), ("a", da), ("beta", dbeta)):
            value = grads_t[name]
            where = step.reshape(step.shape + (1,) * (value.ndim - 1))
            out[:, t] = np.where(where, value, 0.0)
        dS = np.where(step[:, None, None, None], a_t * dSd, dS)

    # Key-head gradients: the sum over the value heads that read each key head.
    dq_key = np.zeros((batch, tokens, key_heads, key_dim))
    dk_key = np.zeros((batch, tokens, key_heads, key_dim))
    np.add.at(dq_key, (slice(None), slice(None), key_head), dq)
    np.add.at(dk_key, (slice(None), slice(None), key_head), dk)
    return {
        "q": dq_key,
        "k": dk_key,
        "v": dv,
        "gamma": da,
        "beta": dbeta,
        "state": dS,
    }


def qk_norm_backward(x, cotangent):
    """Gradient through x / n, n = sqrt(sum(x * x) + eps), per head:
    (c - x_hat (x_hat . c)) / n."""
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)
    x_hat = x / norm
    return (cotangent - x_hat * np.sum(x_hat * cotangent, axis=-1, keepdims=True)) / norm


def qk_norm(x):
    """Stage qk_norm: each row of the last axis over sqrt(|x|^2 + eps)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)


def to_float64(x):
    """A float64 NumPy copy of an mlx or NumPy array of any float dtype."""
    # NumPy cannot read an mlx bfloat16 buffer; widening to float32 is exact.
    if isinstance(x, mx.array) and x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.asarray(x, dtype=np.float64)
