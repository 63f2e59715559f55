"""The chunked form with per-key-channel gates, stage by stage
(docs/stages.md, docs/numerics.md "Per-key-channel gates in the chunked
form").

g is `[B, T, Hv, Dk]`: channel c of a value head's state decays by
`decay(i, j, c) = prod_{j < s <= i} exp(g_sc)`. The stages are those of the
scalar gates (`chunked`) with two changed: `key_gate_cumsum` keeps the
cumulative log decay and the last wipe per channel (`[B, H, C, L, Dk]`), and
`key_decayed_grams` builds the decayed grams of each value head, where the
scalar gates' k_gram and chunk_qk build undecayed ones per key head. The rest
scale K, Q and the state per channel. Each function states the stage's
result directly, whatever sub-chunking a kernel uses to compute it.
"""

import numpy as np

from .chunked import CHUNK_SIZE, chunk_rows, decay_from_start
from .recurrent import key_head_of, qk_norm, to_float64


def per_key_chunked_stages(
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
    """The per-key chunked pipeline; returns a dict of every stage's output.

    Keys: `q`, `k` (after qk_norm), `log_cumsum`, `last_wipe`,
    `beta_effective` (key_gate_cumsum, `[B, Hv, C, L, Dk]` and `[B, Hv, C,
    L]`), `k_gram`, `qk` (key_decayed_grams, value-head tiles), `kkt_inverse`,
    `w`, `u`, `corrected`, `output_inter`, `entry_states`, `state`, `y`, as
    `chunked_stages` names them.
    """
    q, k, v, g, beta = (to_float64(x) for x in (q, k, v, g, beta))
    if g.ndim != 4:
        raise ValueError("per_key_chunked_stages takes g of shape [B, T, Hv, Dk]")
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
    log_cumsum, last_wipe, beta_effective = key_gate_cumsum(g, beta, active, chunk_size)
    out.update(log_cumsum=log_cumsum, last_wipe=last_wipe, beta_effective=beta_effective)
    key_head = key_head_of(value_heads, key_heads, head_mapping)
    q_rows = chunk_rows(q, chunk_size)[:, key_head]
    k_rows = chunk_rows(k, chunk_size)[:, key_head]
    out["k_gram"], out["qk"] = key_decayed_grams(q_rows, k_rows, log_cumsum, last_wipe)
    length = log_cumsum.shape[-2]
    strictly_lower = np.tri(length, k=-1, dtype=bool)
    a = np.where(strictly_lower, beta_effective[..., :, None] * out["k_gram"], 0.0)
    out["kkt_inverse"] = np.linalg.inv(np.eye(length) + a)
    from_start = decay_from_start(log_cumsum, last_wipe)  # [B, Hv, C, L, Dk]
    inverse = out["kkt_inverse"]
    out["u"] = inverse @ (beta_effective[..., None] * chunk_rows(v, chunk_size))
    out["w"] = inverse @ (beta_effective[..., None] * from_start * k_rows)
    out["corrected"], out["output_inter"], out["entry_states"], out["state"] = key_chunk_carry(
        out["w"], out["u"], q_rows, k_rows, log_cumsum, last_wipe, state, scale
    )
    rows = out["output_inter"] + scale * out["qk"] @ out["corrected"]
    y = rows.reshape(batch, value_heads, -1, value_dim)[:, :, :tokens].transpose(0, 2, 1, 3)
    out["y"] = np.where(active[..., None, None], y, 0.0)
    return out


def key_gate_cumsum(g, beta, active, chunk_size=CHUNK_SIZE):
    """Stage gate_cumsum with per-key gates: g `[B, T, H, Dk]`, beta
    `[B, T, H]` -> `(log_cumsum, last_wipe, beta_effective)`, the first two
    `[B, H, C, L, Dk]` (per channel, as `chunked.gate_cumsum` per head), beta
    `[B, H, C, L]` (0 on masked and padded tokens)."""
    active = np.asarray(active, dtype=bool)
    g = chunk_rows(np.where(active[..., None, None], g, 0.0), chunk_size)
    beta = chunk_rows(np.where(active[..., None], beta, 0.0)[..., None], chunk_size)[..., 0]
    wipe = np.isneginf(g)
    log_cumsum = np.cumsum(np.where(wipe, 0.0, g), axis=-2)
    index = np.arange(g.shape[-2])[:, None]
    last_wipe = np.maximum.accumulate(np.where(wipe, index, -1), axis=-2)
    return log_cumsum, last_wipe, beta


def key_chunk_decay(log_cumsum, last_wipe):
    """decay(i, j, c) as `[..., L, L, Dk]`: 0 above the diagonal (j > i) and
    wherever a wipe of channel c lies in (j, i]."""
    length = log_cumsum.shape[-2]
    i = np.arange(length)
    lower = (i[None, :] <= i[:, None])[..., None]
    wiped = last_wipe[..., :, None, :] > i[None, :, None]
    with np.errstate(over="ignore", invalid="ignore"):
        decay = np.exp(log_cumsum[..., :, None, :] - log_cumsum[..., None, :, :])
    return np.where(lower & ~wiped, decay, 0.0)


def key_decayed_grams(q_rows, k_rows, log_cumsum, last_wipe):
    """Stage key_decayed_grams: `(k_gram, qk)` per value head,
    `[B, Hv, C, L, L]`, from the rows of each value head's key head
    (`[B, Hv, C, L, Dk]`):

        k_gram[i, j] = sum_c k_ic k_jc decay(i, j, c)   (j < i; 0 elsewhere)
        qk[i, j]     = sum_c q_ic k_jc decay(i, j, c)   (j <= i; 0 elsewhere)
    """
    decay = key_chunk_decay(log_cumsum, last_wipe)
    qk = np.einsum("...ic,...jc,...ijc->...ij", q_rows, k_rows, decay)
    k_gram = np.einsum("...ic,...jc,...ijc->...ij", k_rows, k_rows, decay)
    return np.tril(k_gram, k=-1), qk


def key_chunk_carry(w, u, q_rows, k_rows, log_cumsum, last_wipe, state, scale):
    """Stage chunk_carry with per-key gates: walks the chunks in order from
    `state` (`[B, Hv, Dv, Dk]`) and returns `(corrected, output_inter,
    entry_states, final_state)`: v' = U - W S^T, the inter-chunk output
    scale S (decay(i, -1, :) q_i), and the next state S diag(decay(L-1, -1,
    :)) + sum_j v'_j (decay(L-1, j, :) k_j)^T."""
    chunks = w.shape[2]
    from_start = decay_from_start(log_cumsum, last_wipe)
    to_end = key_chunk_decay(log_cumsum, last_wipe)[..., -1, :, :]  # [B, H, C, L, Dk]
    corrected = np.empty_like(u)
    output_inter = np.empty_like(u)
    S = to_float64(state).copy()
    entry_states = np.empty(S.shape[:2] + (chunks,) + S.shape[2:])
    for c in range(chunks):
        entry_states[:, :, c] = S
        corrected[:, :, c] = u[:, :, c] - np.einsum("bhik,bhvk->bhiv", w[:, :, c], S)
        decayed_q = from_start[:, :, c] * q_rows[:, :, c]
        output_inter[:, :, c] = scale * np.einsum("bhvk,bhik->bhiv", S, decayed_q)
        S = S * from_start[:, :, c, -1, None, :] + np.einsum(
            "bhjv,bhjk->bhvk", corrected[:, :, c], to_end[:, :, c] * k_rows[:, :, c]
        )
    return corrected, output_inter, entry_states, S
