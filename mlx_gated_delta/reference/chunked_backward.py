"""The chunked backward, stage by stage (docs/numerics.md, "The chunked
backward"): the float64 counterpart of csrc/cpu/chunked_backward_stages.h
with scalar gates. Each
`*_backward` stage adds the decay terms of its products to d_log, the
gradient of the in-chunk cumulative log decay, [B, Hv, C, L].
"""

import numpy as np

from .chunked import CHUNK_SIZE, chunk_decay, chunk_rows, chunked_stages, decay_from_start
from .recurrent import key_head_of, qk_norm_backward, to_float64


def gated_delta_rule_chunked_reference_vjp(q, k, v, g, beta, state=None, **options):
    """`gated_delta_rule_reference_vjp` computed by the chunked backward's
    stages (scalar gates, no wipes: the CPU hands a chunk with a wipe to the
    recurrent reverse), with the arguments of `chunked_backward_stages`.
    Returns the same dict (without `gamma`)."""
    s = chunked_backward_stages(q, k, v, g, beta, state, **options)
    per_token = {
        "q": s["carry_dq"],
        "k": s["kkt_dk"],
        "v": s["dv"],
        "g": s["dg"],
        "beta": s["kkt_dbeta"],
    }
    normalize_qk = options.get("normalize_qk", False)
    return token_gradients(per_token, s["d_entry"], q, k, s["key_head"], s["active"], normalize_qk)


def chunked_backward_stages(
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
    """Every stage's output of the chunked backward (scalar gates, no
    wipes), `[B, Hv, C, L, ...]`, by the names of the CPU's trace
    (`_ext.trace_cpu_chunked_backward_stages`): `<stage>_<output>` with dq,
    dk and dbeta as they stand after that stage; also dv, the initial
    state's gradient `d_entry`, the key head of each value head and the
    active tokens."""
    g64 = to_float64(g)
    if g64.ndim == 4 or np.isneginf(g64).any():
        raise ValueError("the chunked backward reference has scalar gates and no wipes")
    options = dict(scale=scale, head_mapping=head_mapping, mask=mask, normalize_qk=normalize_qk)
    f = chunked_stages(q, k, v, g, beta, state, chunk_size=chunk_size, **options)
    rows = backward_rows(f, v, y_cotangent, state_cotangent, chunk_size, **options)
    q_rows, k_rows, v_rows = rows["q_rows"], rows["k_rows"], rows["v_rows"]
    d_out, d_state, scale = rows["d_out"], rows["d_state"], rows["scale"]
    decay = chunk_decay(f["log_cumsum"], f["last_wipe"])
    from_start = decay_from_start(f["log_cumsum"], f["last_wipe"])

    out = {"key_head": rows["key_head"], "active": rows["active"]}
    d_corrected, dq, dk, d_log = chunk_output_backward(
        d_out, f["corrected"], f["qk"][:, rows["key_head"]], decay, q_rows, k_rows
    )
    out.update(output_d_corrected=d_corrected, output_dq=dq, output_dk=dk)
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
    out.update(carry_d_corrected=d_corrected, carry_dw=dw, carry_dq=dq, carry_dk=dk)
    out["d_entry"] = d_entry
    dt, dv, dbeta, dk_w_u, d_log_w_u = recompute_w_u_backward(
        d_corrected, dw, f["kkt_inverse"], v_rows, k_rows, f["beta_effective"], from_start
    )
    out.update(w_u_dt=dt, w_u_dk=dk + dk_w_u, w_u_dbeta=dbeta, dv=dv)
    dk_kkt, dbeta_kkt, d_log_kkt = kkt_inverse_backward(
        dt, f["kkt_inverse"], k_rows, decay, f["beta_effective"]
    )
    out.update(kkt_dk=out["w_u_dk"] + dk_kkt, kkt_dbeta=dbeta + dbeta_kkt)
    out["dg"] = gate_cumsum_backward(d_log + d_log_w_u + d_log_kkt)
    return out


def backward_rows(
    f, v, y_cotangent, state_cotangent, chunk_size, *, scale, head_mapping, mask, normalize_qk
):
    """What both chunked backward references read beside the forward's stages
    `f`, chunk by chunk: each value head's q, k rows and v rows, dO = scale dy
    (0 where masked), dS of the final state, the readout scale, the key head
    of each value head and the active tokens."""
    batch, tokens, key_heads, key_dim = f["q"].shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if scale is None:
        scale = key_dim**-0.5
    key_head = key_head_of(value_heads, key_heads, head_mapping)
    active = np.ones((batch, tokens), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    dy = np.zeros(v.shape) if y_cotangent is None else to_float64(y_cotangent)
    d_state = (
        np.zeros((batch, value_heads, value_dim, key_dim))
        if state_cotangent is None
        else to_float64(state_cotangent)
    )
    return {
        "q_rows": chunk_rows(f["q"], chunk_size)[:, key_head],
        "k_rows": chunk_rows(f["k"], chunk_size)[:, key_head],
        "v_rows": chunk_rows(to_float64(v), chunk_size),
        "d_out": scale * chunk_rows(np.where(active[..., None, None], dy, 0.0), chunk_size),
        "d_state": d_state,
        "scale": scale,
        "key_head": key_head,
        "active": active,
    }


def token_gradients(per_token, d_entry, q, k, key_head, active, normalize_qk):
    """The gradients by input name from the chunked per-token ones
    `[B, Hv, C, L(, D)]` (0 where masked), dq and dk summed over the value
    heads that read each key head and taken through the L2 norm."""
    tokens = active.shape[1]

    def token_rows(x):  # [B, Hv, C, L(, D)] -> [B, T, Hv(, D)], 0 where masked
        x = np.moveaxis(x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :tokens], 1, 2)
        where = active.reshape(active.shape + (1,) * (x.ndim - 2))
        return np.where(where, x, 0.0)

    grads = {name: token_rows(value) for name, value in per_token.items() if name not in ("q", "k")}
    grads["state"] = d_entry
    for name, raw in (("q", q), ("k", k)):
        summed = np.zeros(raw.shape)
        np.add.at(summed, (slice(None), slice(None), key_head), token_rows(per_token[name]))
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
        from_entry, e, k_c = from_start[:, :, c], to_end[:, :, c], k_rows[:, :, c]
        d_log = np.einsum("bhiv,bhiv->bhi", dO, inter[:, :, c])
        dq = from_entry[..., None] * (dO @ S)
        dV = d_corrected[:, :, c] + e[..., None] * (k_c @ np.swapaxes(dS, -1, -2))
        dk_end = e[..., None] * (corrected[:, :, c] @ dS)
        end_terms = np.einsum("bhik,bhik->bhi", dk_end, k_c)
        d_log[..., -1] += from_entry[..., -1] * np.einsum("bhvk,bhvk->bh", dS, S) + end_terms.sum(
            -1
        )
        d_log -= end_terms
        dw[:, :, c] = -dV @ S
        dS = (
            from_entry[..., -1, None, None] * dS
            + np.swapaxes(dO, -1, -2) @ (from_entry[..., None] * q_rows[:, :, c])
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
