"""The chunked form, stage by stage (docs/stages.md, docs/numerics.md).

Per-chunk arrays are laid out [B, H, C, L] (C chunks of L = CHUNK_SIZE
tokens; the last chunk padded with no-op tokens), per-chunk tiles
[B, H, C, L, L], per-token rows [B, H, C, L, D]. Masked and padded tokens are
no-ops: decay 1 (g = 0) and beta 0.
"""

import numpy as np

from .recurrent import key_head_of, qk_norm, to_float64

# Tokens per chunk of the chunked form, on every backend.
CHUNK_SIZE = 64


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


def chunk_rows(x, chunk_size=CHUNK_SIZE):
    """`[B, T, H, D]` -> `[B, H, C, L, D]`, the last chunk padded with zeros."""
    batch, tokens, heads, dim = x.shape
    chunks = -(-tokens // chunk_size)
    padded = np.zeros((batch, chunks * chunk_size, heads, dim))
    padded[:, :tokens] = x
    return padded.reshape(batch, chunks, chunk_size, heads, dim).transpose(0, 3, 1, 2, 4)
