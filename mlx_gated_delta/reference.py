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


def _l2_normalize(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)


def to_float64(x):
    """A float64 NumPy copy of an mlx or NumPy array of any float dtype."""
    # NumPy cannot read an mlx bfloat16 buffer; widening to float32 is exact.
    if isinstance(x, mx.array) and x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.asarray(x, dtype=np.float64)
