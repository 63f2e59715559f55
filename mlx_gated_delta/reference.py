"""Float64 NumPy oracles of the gated-delta ops, independent of the C++.

`gated_delta_rule_reference` transcribes the contract (docs/contract.md)
directly: a loop over tokens, with batch rows and heads vectorised, everything
in float64. Beside it, `gated_delta_rule_chunked_reference` computes the same
thing in the chunked form, built from one function per stage with the names the
CPU and Metal kernels use (docs/stages.md); the per-stage tests compare each
kernel stage with its namesake here. The segment oracle is split into its
stages the same way. The tests compare each fast path against these functions
through the contracts of `testing.contracts`.

Arguments may be NumPy arrays of any float dtype or mlx arrays; callers that
test a low-precision path pass the inputs already rounded to that dtype, so the
oracle sees exactly the numbers the kernel sees.
"""

import mlx.core as mx
import numpy as np

# normalize_qk: x / sqrt(sum(x * x) + eps) per head (docs/contract.md).
QK_NORM_EPS = 1e-6

# Tokens per chunk of the chunked form, on every backend.
CHUNK_SIZE = 64


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
    grads["g"] = grads["decay"] * np.exp(g)
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

    Returns the dict of `gated_delta_rule_reference_vjp` with `gamma` (the
    gradient of the linear decay, finite and exact at `gamma == 0`) in place
    of `g` and `decay`.
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
    grads["gamma"] = grads.pop("decay")
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
        "decay": da,
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


# ---------------------------------------------------------------------------
# The chunked form, stage by stage (docs/stages.md, docs/numerics.md).
#
# Per-chunk arrays are laid out [B, H, C, L] (C chunks of L = CHUNK_SIZE
# tokens; the last chunk padded with no-op tokens), per-chunk tiles
# [B, H, C, L, L], per-token rows [B, H, C, L, D]. Masked and padded tokens are
# no-ops: decay 1 (g = 0) and beta 0.
# ---------------------------------------------------------------------------


def gated_delta_rule_chunked_reference(*args, **options):
    """`gated_delta_rule_reference` computed in the chunked form.

    The arguments of `chunked_stages` (those of the recurrent oracle, and
    `chunk_size`); returns `(y, state)`, equal to the recurrent oracle's up to
    float64 rounding. `chunked_stages` returns every stage's output as well.
    """
    stages = chunked_stages(*args, **options)
    return stages["y"], stages["state"]


def chunked_stages(
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
    chunk_size=CHUNK_SIZE,
):
    """The chunked pipeline; returns a dict of every stage's output by name.

    Keys: `q`, `k` (after qk_norm), `log_cumsum`, `last_wipe`,
    `beta_effective` (gate_cumsum), `k_gram`, `qk` (key-head tiles),
    `kkt_inverse`, `w`, `u` (recompute_w_u), `corrected` (v'), `output_inter`,
    `entry_states` ([B, Hv, C, Dv, Dk], the state each chunk starts from),
    `state` (chunk_carry), `y` ([B, T, Hv, Dv], chunk_output).
    """
    q, k, v, g, beta = (to_float64(x) for x in (q, k, v, g, beta))
    if g.ndim == 4:
        raise ValueError(
            "chunked_stages has scalar gates only; per-key-channel gates "
            "(g of shape [B, T, Hv, Dk]) are in gated_delta_rule_reference"
        )
    batch, tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if scale is None:
        scale = key_dim**-0.5
    if normalize_qk:
        q, k = qk_norm(q), qk_norm(k)
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    if state is None:
        state = np.zeros((batch, value_heads, value_dim, key_dim))
    out = {"q": q, "k": k}
    log_cumsum, last_wipe, beta_effective = gate_cumsum(g, beta, active, chunk_size)
    out.update(log_cumsum=log_cumsum, last_wipe=last_wipe, beta_effective=beta_effective)
    q_rows, k_rows = chunk_rows(q, chunk_size), chunk_rows(k, chunk_size)
    out["k_gram"] = k_gram(k_rows)
    out["qk"] = chunk_qk(q_rows, k_rows)
    # Every value head reads its key head's rows and tiles.
    key_head = key_head_of(value_heads, key_heads, head_mapping)
    out["kkt_inverse"] = kkt_inverse(
        out["k_gram"][:, key_head], log_cumsum, last_wipe, beta_effective
    )
    out["w"], out["u"] = recompute_w_u(
        out["kkt_inverse"],
        k_rows[:, key_head],
        chunk_rows(v, chunk_size),
        log_cumsum,
        last_wipe,
        beta_effective,
    )
    out["corrected"], out["output_inter"], out["entry_states"], out["state"] = chunk_carry(
        out["w"],
        out["u"],
        q_rows[:, key_head],
        k_rows[:, key_head],
        log_cumsum,
        last_wipe,
        to_float64(state),
        scale,
    )
    out["y"] = chunk_output(
        out["qk"][:, key_head],
        out["corrected"],
        out["output_inter"],
        log_cumsum,
        last_wipe,
        active,
        scale,
    )
    return out


def gate_cumsum(g, beta, active, chunk_size=CHUNK_SIZE):
    """Stage gate_cumsum: g, beta `[B, T, H]` and the mask `[B, T]` ->
    `(log_cumsum, last_wipe, beta_effective)`, each `[B, H, C, L]`.

    log_cumsum is the in-chunk inclusive sum of the finite g; last_wipe the
    last in-chunk index <= i whose g is -inf (a wipe, from gamma == 0), or -1;
    beta_effective is beta, 0 on masked and padded tokens. Keeping wipes by
    position means no difference of sums is ever -inf - -inf.
    """
    active = np.broadcast_to(np.asarray(active, dtype=bool)[..., None], g.shape)
    g = chunk_rows(np.where(active, g, 0.0)[..., None], chunk_size)[..., 0]
    beta = chunk_rows(np.where(active, beta, 0.0)[..., None], chunk_size)[..., 0]
    wipe = np.isneginf(g)
    log_cumsum = np.cumsum(np.where(wipe, 0.0, g), axis=-1)
    index = np.arange(g.shape[-1])
    last_wipe = np.maximum.accumulate(np.where(wipe, index, -1), axis=-1)
    return log_cumsum, last_wipe, beta


def chunk_decay(log_cumsum, last_wipe):
    """decay(i, j) = prod_{j < s <= i} exp(g_s) as `[..., L, L]` tiles: 0
    above the diagonal and wherever a wipe lies in (j, i]."""
    i = np.arange(log_cumsum.shape[-1])
    lower = i[None, :] <= i[:, None]
    wiped = last_wipe[..., :, None] > i[None, :]
    with np.errstate(over="ignore"):
        decay = np.exp(log_cumsum[..., :, None] - log_cumsum[..., None, :])
    return np.where(lower & ~wiped, decay, 0.0)


def decay_from_start(log_cumsum, last_wipe):
    """decay(i, -1): from the chunk's entry state to token i, `[..., L]`."""
    return np.where(last_wipe < 0, np.exp(log_cumsum), 0.0)


def k_gram(k_rows):
    """Stage k_gram: the undecayed K K^T of each chunk, `[B, Hk, C, L, L]`."""
    return np.einsum("bhcid,bhcjd->bhcij", k_rows, k_rows)


def chunk_qk(q_rows, k_rows):
    """Stage chunk_qk: the undecayed Q K^T of each chunk, `[B, Hk, C, L, L]`."""
    return np.einsum("bhcid,bhcjd->bhcij", q_rows, k_rows)


def kkt_inverse(k_gram_tiles, log_cumsum, last_wipe, beta_effective):
    """Stage kkt_inverse: T = (I + A)^-1 with the strictly lower
    A_ij = beta_i decay(i, j) k_i . k_j, per value head, `[B, Hv, C, L, L]`."""
    length = log_cumsum.shape[-1]
    strictly_lower = np.tri(length, k=-1, dtype=bool)
    a = np.where(
        strictly_lower,
        beta_effective[..., :, None] * chunk_decay(log_cumsum, last_wipe) * k_gram_tiles,
        0.0,
    )
    return np.linalg.inv(np.eye(length) + a)


def recompute_w_u(inverse, k_rows, v_rows, log_cumsum, last_wipe, beta_effective):
    """Stage recompute_w_u: `(W, U)` with U = T diag(beta) V and
    W = T diag(beta decay(i, -1)) K, rows `[B, Hv, C, L, D]`."""
    u = inverse @ (beta_effective[..., None] * v_rows)
    w_scale = beta_effective * decay_from_start(log_cumsum, last_wipe)
    w = inverse @ (w_scale[..., None] * k_rows)
    return w, u


def chunk_carry(w, u, q_rows, k_rows, log_cumsum, last_wipe, state, scale):
    """Stage chunk_carry: walks the chunks in order from `state` and returns
    `(corrected, output_inter, entry_states, final_state)`.

    With S the state a chunk starts from: corrected v' = U - W S^T, the
    inter-chunk output scale decay(i, -1) S q_i, and the next state
    decay(L-1, -1) S + sum_j decay(L-1, j) v'_j k_j^T.
    """
    chunks = w.shape[2]
    from_start = decay_from_start(log_cumsum, last_wipe)
    to_end = chunk_decay(log_cumsum, last_wipe)[..., -1, :]
    corrected = np.empty_like(u)
    output_inter = np.empty_like(u)
    entry_states = np.empty(state.shape[:2] + (chunks,) + state.shape[2:])
    S = state.copy()
    for c in range(chunks):
        entry_states[:, :, c] = S
        corrected[:, :, c] = u[:, :, c] - np.einsum("bhik,bhvk->bhiv", w[:, :, c], S)
        output_inter[:, :, c] = (
            scale * from_start[:, :, c, :, None] * np.einsum("bhvk,bhik->bhiv", S, q_rows[:, :, c])
        )
        S = from_start[:, :, c, -1, None, None] * S + np.einsum(
            "bhj,bhjv,bhjk->bhvk", to_end[:, :, c], corrected[:, :, c], k_rows[:, :, c]
        )
    return corrected, output_inter, entry_states, S


def chunk_output(qk_tiles, corrected, output_inter, log_cumsum, last_wipe, active, scale):
    """Stage chunk_output: y_i = inter_i + scale sum_{j <= i} decay(i, j)
    (q_i . k_j) v'_j, 0 on masked tokens; returns `[B, T, Hv, Dv]`."""
    weights = chunk_decay(log_cumsum, last_wipe) * qk_tiles
    rows = output_inter + scale * weights @ corrected  # [B, Hv, C, L, Dv]
    batch, heads, chunks, length, dim = rows.shape
    tokens = active.shape[1]
    y = rows.reshape(batch, heads, chunks * length, dim)[:, :, :tokens].transpose(0, 2, 1, 3)
    return np.where(np.asarray(active, dtype=bool)[..., None, None], y, 0.0)


# ---------------------------------------------------------------------------
# The chunked backward, stage by stage (docs/numerics.md, "The chunked
# backward"): the float64 counterpart of csrc/cpu/chunked_backward.cpp. Each
# `*_backward` stage adds the decay terms of its products to d_log, the
# gradient of the in-chunk cumulative log decay, [B, Hv, C, L].
# ---------------------------------------------------------------------------


def gated_delta_rule_chunked_reference_vjp(
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
    chunk_size=CHUNK_SIZE,
):
    """`gated_delta_rule_reference_vjp` computed by the chunked backward's
    stages (scalar gates, no wipes: the CPU hands a chunk with a wipe to the
    recurrent reverse). Returns the same dict (without `decay`)."""
    g64 = to_float64(g)
    if g64.ndim == 4 or np.isneginf(g64).any():
        raise ValueError("the chunked backward reference has scalar gates and no wipes")
    options = dict(scale=scale, head_mapping=head_mapping, mask=mask, normalize_qk=normalize_qk)
    f = chunked_stages(q, k, v, g, beta, state, chunk_size=chunk_size, **options)
    batch, tokens, key_heads, key_dim = f["q"].shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if scale is None:
        scale = key_dim**-0.5
    key_head = key_head_of(value_heads, key_heads, head_mapping)
    q_rows = chunk_rows(f["q"], chunk_size)[:, key_head]
    k_rows = chunk_rows(f["k"], chunk_size)[:, key_head]
    v_rows = chunk_rows(to_float64(v), chunk_size)
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    dy = np.zeros(v.shape) if y_cotangent is None else to_float64(y_cotangent)
    d_out = scale * chunk_rows(np.where(active[..., None, None], dy, 0.0), chunk_size)
    d_state = (
        np.zeros((batch, value_heads, value_dim, key_dim))
        if state_cotangent is None
        else to_float64(state_cotangent)
    )
    decay = chunk_decay(f["log_cumsum"], f["last_wipe"])
    from_start = decay_from_start(f["log_cumsum"], f["last_wipe"])

    d_corrected, dq, dk, d_log = chunk_output_backward(
        d_out, f["corrected"], f["qk"][:, key_head], decay, q_rows, k_rows
    )
    d_entry, dw, carry = chunk_carry_backward(
        d_out,
        d_state,
        d_corrected,
        f["w"],
        f["corrected"],
        f["output_inter"] / scale,
        f["entry_states"],
        q_rows,
        k_rows,
        decay,
        from_start,
    )
    d_corrected = d_corrected + carry["d_corrected"]
    dq, dk, d_log = dq + carry["dq"], dk + carry["dk"], d_log + carry["d_log"]
    dt, dv, dbeta, dk_w_u, d_log_w_u = recompute_w_u_backward(
        d_corrected, dw, f["kkt_inverse"], v_rows, k_rows, f["beta_effective"], from_start
    )
    dk_kkt, dbeta_kkt, d_log_kkt = kkt_inverse_backward(
        dt, f["kkt_inverse"], k_rows, decay, f["beta_effective"]
    )
    dg = gate_cumsum_backward(d_log + d_log_w_u + d_log_kkt)

    def token_rows(x):  # [B, Hv, C, L(, D)] -> [B, T, Hv(, D)], 0 where masked
        x = np.moveaxis(x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :tokens], 1, 2)
        where = active.reshape(active.shape + (1,) * (x.ndim - 2))
        return np.where(where, x, 0.0)

    grads = {
        "v": token_rows(dv),
        "g": token_rows(dg),
        "beta": token_rows(dbeta + dbeta_kkt),
        "state": d_entry,
    }
    for name, value, raw in (("q", dq, q), ("k", dk + dk_w_u + dk_kkt, k)):
        per_head = token_rows(value)
        summed = np.zeros((batch, tokens, key_heads, key_dim))
        np.add.at(summed, (slice(None), slice(None), key_head), per_head)
        grads[name] = qk_norm_backward(to_float64(raw), summed) if normalize_qk else summed
    return grads


def _strict_decay_terms(d_matrix, matrix):
    """The decay terms of a decayed [..., L, L] matrix X: c_ij = dX_ij X_ij
    (j < i) adds to d_log_i and subtracts from d_log_j."""
    c = np.tril(d_matrix * matrix, k=-1)
    return c.sum(axis=-1) - c.sum(axis=-2)


def chunk_output_backward(d_out, corrected, qk_tiles, decay, q_rows, k_rows):
    """Stage chunk_output_backward: the intra-chunk part of the output,
    O = M V' with M = decay o Q K^T. Returns (dV', dq, dk, d_log)."""
    m = decay * qk_tiles
    d_corrected = np.swapaxes(m, -1, -2) @ d_out
    dm = d_out @ np.swapaxes(corrected, -1, -2)
    d_log = _strict_decay_terms(dm, m)
    dm = dm * decay
    return d_corrected, dm @ k_rows, np.swapaxes(dm, -1, -2) @ q_rows, d_log


def chunk_carry_backward(
    d_out,
    d_state,
    d_corrected,
    w,
    corrected,
    inter,
    entry_states,
    q_rows,
    k_rows,
    decay,
    from_start,
):
    """Stage chunk_carry_backward: the chunks last to first, carrying dS, the
    cotangent of the state, through the entry state's share of the output
    (inter = decay(i, -1) S q_i), the exit state and V' = U - W S^T.
    `d_corrected` is chunk_output_backward's dV'. Returns (dS of the initial
    state, dW, and a dict of the additions to dV', dq, dk and d_log)."""
    to_end = decay[..., -1, :]
    chunks = w.shape[2]
    out = {
        "d_corrected": np.zeros_like(d_corrected),
        "dq": np.zeros(q_rows.shape),
        "dk": np.zeros(k_rows.shape),
        "d_log": np.zeros(from_start.shape),
    }
    dw = np.zeros_like(w)
    dS = d_state
    for c in reversed(range(chunks)):
        S, dO = entry_states[:, :, c], d_out[:, :, c]
        gamma, e, k_c = from_start[:, :, c], to_end[:, :, c], k_rows[:, :, c]
        d_log = np.einsum("bhiv,bhiv->bhi", dO, inter[:, :, c])
        dq = gamma[..., None] * (dO @ S)
        dV = d_corrected[:, :, c] + e[..., None] * (k_c @ np.swapaxes(dS, -1, -2))
        dk_end = e[..., None] * (corrected[:, :, c] @ dS)
        end_terms = np.einsum("bhik,bhik->bhi", dk_end, k_c)
        d_log[..., -1] += gamma[..., -1] * np.einsum("bhvk,bhvk->bh", dS, S) + end_terms.sum(-1)
        d_log -= end_terms
        dw[:, :, c] = -dV @ S
        dS = (
            gamma[..., -1, None, None] * dS
            + np.swapaxes(dO, -1, -2) @ (gamma[..., None] * q_rows[:, :, c])
            - np.swapaxes(dV, -1, -2) @ w[:, :, c]
        )
        out["d_corrected"][:, :, c] = dV - d_corrected[:, :, c]
        out["dq"][:, :, c], out["dk"][:, :, c], out["d_log"][:, :, c] = dq, dk_end, d_log
    return dS, dw, out


def recompute_w_u_backward(d_u, dw, inverse, v_rows, k_rows, beta_effective, from_start):
    """Stage recompute_w_u_backward: U = T diag(beta) V, W = T diag(beta
    decay(i, -1)) K. Returns (dT, dv, dbeta, dk, d_log)."""
    w_scale = beta_effective * from_start
    dt = np.tril(
        d_u @ np.swapaxes(beta_effective[..., None] * v_rows, -1, -2)
        + dw @ np.swapaxes(w_scale[..., None] * k_rows, -1, -2)
    )
    d_scaled_v = np.swapaxes(inverse, -1, -2) @ d_u
    d_scaled_k = np.swapaxes(inverse, -1, -2) @ dw
    k_term = np.einsum("bhcik,bhcik->bhci", d_scaled_k, k_rows)
    dbeta = np.einsum("bhciv,bhciv->bhci", d_scaled_v, v_rows) + from_start * k_term
    return (
        dt,
        beta_effective[..., None] * d_scaled_v,
        dbeta,
        w_scale[..., None] * d_scaled_k,
        w_scale * k_term,
    )


def kkt_inverse_backward(dt, inverse, k_rows, decay, beta_effective):
    """Stage kkt_inverse_backward: T = (I + A)^-1, A_ij = beta_i decay(i, j)
    k_i . k_j (j < i): dA = -T^T dT T^T on the strictly lower triangle.
    Returns (dk, dbeta, d_log)."""
    inverse_t = np.swapaxes(inverse, -1, -2)
    da = np.tril(-inverse_t @ dt @ inverse_t, k=-1)
    gram = k_rows @ np.swapaxes(k_rows, -1, -2)
    a = beta_effective[..., None] * decay * gram
    d_log = _strict_decay_terms(da, a)
    dbeta = np.sum(da * decay * gram, axis=-1)
    dak = beta_effective[..., None] * decay * da
    return dak @ k_rows + np.swapaxes(dak, -1, -2) @ k_rows, dbeta, d_log


def gate_cumsum_backward(d_log):
    """Stage gate_cumsum_backward: G_i is the in-chunk cumulative sum of g,
    so dg_t = sum_{i >= t} dG_i."""
    return np.flip(np.cumsum(np.flip(d_log, -1), axis=-1), -1)


def chunk_rows(x, chunk_size=CHUNK_SIZE):
    """`[B, T, H, D]` -> `[B, H, C, L, D]`, the last chunk padded with zeros."""
    batch, tokens, heads, dim = x.shape
    chunks = -(-tokens // chunk_size)
    padded = np.zeros((batch, chunks * chunk_size, heads, dim))
    padded[:, :tokens] = x
    return padded.reshape(batch, chunks, chunk_size, heads, dim).transpose(0, 3, 1, 2, 4)


# ---------------------------------------------------------------------------
# The fused layer segment (docs/contract.md), stage by stage.
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
    )
    y, state = gated_delta_rule_reference(*core.arrays, state, **core.options)
    active = core.options["mask"]
    new_window = collect_conv_state(core.x, core.window, active, core.layout)
    out = gated_norm(y, core.x, norm_weight, active, core.layout, norm_eps)
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
):
    """The segment's stages before the recurrence (prepare_conv and
    prepare_gates) in float64: a `SegmentCore`."""
    x = to_float64(mixed_qkvzba)
    batch, tokens, width = x.shape
    layout = SegmentLayout(key_heads, value_heads, key_dim, value_dim)
    if width != layout.packed_width:
        raise ValueError(f"packed width {width} does not match the head layout")
    weight = to_float64(conv_weight).reshape(layout.channels, -1)  # [C, K] or [C, K, 1]
    window = (
        np.zeros((batch, weight.shape[1] - 1, layout.channels))
        if conv_state is None
        else to_float64(conv_state)
    )
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)

    qkv = prepare_conv(x, weight, window, active, layout)
    g, beta = prepare_gates(x, decay_parameter, dt_bias, layout, decay_parameterization)
    q = qkv[..., : layout.qk_width].reshape(batch, tokens, key_heads, key_dim)
    k = qkv[..., layout.qk_width : 2 * layout.qk_width].reshape(batch, tokens, key_heads, key_dim)
    v = qkv[..., 2 * layout.qk_width :].reshape(batch, tokens, value_heads, value_dim)
    options = dict(scale=key_dim**-0.5, head_mapping=head_mapping, mask=active, normalize_qk=True)
    return SegmentCore((q, k, v, g, beta), options, x, window, layout)


class SegmentLayout:
    """Where the parts of one packed token row `[q | k | v | z | b | a]` lie."""

    def __init__(self, key_heads, value_heads, key_dim, value_dim):
        self.value_heads, self.value_dim = value_heads, value_dim
        self.qk_width = key_heads * key_dim
        self.v_width = value_heads * value_dim
        self.channels = 2 * self.qk_width + self.v_width  # what the conv sees
        self.z_offset = self.channels
        self.b_offset = self.z_offset + self.v_width
        self.a_offset = self.b_offset + value_heads
        self.packed_width = self.a_offset + value_heads


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


def prepare_gates(x, decay_parameter, dt_bias, layout, decay_parameterization="log_rate"):
    """Stage prepare_gates: `(g, beta)`, `[B, T, Hv]` each, with
    g = rate softplus(a + dt_bias) and beta = sigmoid(b)."""
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
    b_gate = x[..., layout.b_offset : layout.a_offset]
    a_gate = x[..., layout.a_offset : layout.packed_width]
    g = rate * np.logaddexp(0.0, a_gate + to_float64(dt_bias))  # softplus
    return g, _sigmoid(b_gate)


def gated_norm(y, x, norm_weight, active, layout, norm_eps=1e-6):
    """Stage gated_norm: rms_norm(y) norm_weight silu(z) per (token, value
    head), 0 on masked tokens; `[B, T, Hv, Dv]`."""
    batch, tokens = active.shape
    z = x[..., layout.z_offset : layout.b_offset].reshape(
        batch, tokens, layout.value_heads, layout.value_dim
    )
    y = to_float64(y)
    rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + norm_eps)
    out = y / rms * to_float64(norm_weight) * (z * _sigmoid(z))
    return np.where(active[..., None, None], out, 0.0)


def _conv_history(x, window, active, layout):
    """Per batch row, the pre-conv rows the conv sees, oldest first: the
    carried conv state, then every unmasked token's q|k|v."""
    return [
        np.concatenate([window[b], x[b, active[b], : layout.channels]]) for b in range(x.shape[0])
    ]


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))
