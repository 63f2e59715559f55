"""The chunked backward with per-key-channel gates, stage by stage
(docs/stages.md, "Backward: the core recurrence"): the float64 counterpart
of csrc/cpu/chunked_backward_stages.h with per-key gates (PerKeyGates,
csrc/cpu/key_chunked_backward.cpp).

The stages are those of the scalar gates (`chunked_backward`) with the decay
of channel c, decay(i, j, c), in place of decay(i, j). Every decay is a
product of the linear decays gamma = exp(g) between its ends, and the stages
leave the gradient of each decay without the decay itself, per channel: the
pair terms P_ijc of decay(i, j, c), j < i, `[B, Hv, C, L, L, Dk]` (the
entry (i, j) of a decayed gram X with operands a and b, R_ic = sum_j X_ij
decay(i, j, c) b_jc, gives a_ic X_ij b_jc), the entry terms of decay(i, -1,
c) and the exit terms of decay(L-1, j, c), `[B, Hv, C, L, Dk]`.
gate_cumsum_backward sums those that pass each token into dgamma, without
dividing by gamma (csrc/cpu/chunked_backward_stages.h, decay_gradient).

A chunk of one (batch row, value head) in which the decay of some active
token and channel is not a normal float32 (a wipe) runs the recurrent
reverse from its entry state, as the CPU does (and as for scalar gates).
"""

import numpy as np

from .chunked import CHUNK_SIZE, chunk_rows, decay_from_start
from .chunked_backward import backward_rows, token_gradients
from .chunked_per_key import key_chunk_decay, per_key_chunked_stages
from .recurrent import gated_delta_rule_reference_vjp, to_float64

# The smallest normal float32: a decay below it sends the chunk to the
# recurrent reverse.
SMALLEST_NORMAL_DECAY = float(np.finfo(np.float32).tiny)


def gated_delta_rule_per_key_chunked_reference_vjp(q, k, v, g, beta, state=None, **options):
    """`gated_delta_rule_reference_vjp` with per-key gates (g `[B, T, Hv,
    Dk]`) computed by the per-key chunked backward's stages, with the
    arguments of `per_key_chunked_backward_stages`. Returns the same dict,
    `gamma` included."""
    s = per_key_chunked_backward_stages(q, k, v, g, beta, state, **options)
    per_token = {
        "q": s["carry_dq"],
        "k": s["kkt_dk"],
        "v": s["dv"],
        "g": s["dg"],
        "gamma": s["dgamma"],
        "beta": s["kkt_dbeta"],
    }
    for (b, h, c), grads in s["recurrent_grads"].items():
        for name, value in grads.items():
            per_token[name][b, h, c] = value
    normalize_qk = options.get("normalize_qk", False)
    return token_gradients(per_token, s["d_entry"], q, k, s["key_head"], s["active"], normalize_qk)


def per_key_chunked_backward_stages(
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
    """Every stage's output of the per-key chunked backward, `[B, Hv, C, L,
    ...]`, by the names of the CPU's trace and of `chunked_backward_stages`
    (dg per channel, and dgamma); also dv, `d_entry`, the key head of each
    value head, the active tokens, and `recurrent_grads`: the per-token
    gradients of the chunks that ran the recurrent reverse, by (b, h, c),
    which replace the stages' rows there."""
    g64 = to_float64(g)
    if g64.ndim != 4:
        raise ValueError("the per-key chunked backward takes g of shape [B, T, Hv, Dk]")
    options = dict(scale=scale, head_mapping=head_mapping, mask=mask, normalize_qk=normalize_qk)
    f = per_key_chunked_stages(q, k, v, g, beta, state, chunk_size=chunk_size, **options)
    rows = backward_rows(f, v, y_cotangent, state_cotangent, chunk_size, **options)
    q_rows, k_rows, v_rows = rows["q_rows"], rows["k_rows"], rows["v_rows"]
    d_out, d_state, active = rows["d_out"], rows["d_state"], rows["active"]
    g_rows = chunk_rows(np.where(active[..., None, None], g64, 0.0), chunk_size)
    log_cumsum, last_wipe = f["log_cumsum"], f["last_wipe"]
    decay = key_chunk_decay(log_cumsum, last_wipe)  # [B, Hv, C, L, L, Dk]
    from_start = decay_from_start(log_cumsum, last_wipe)  # [B, Hv, C, L, Dk]
    beta_effective = f["beta_effective"]

    # The chunks that run the recurrent reverse, and what it gives them.
    with np.errstate(over="ignore"):
        normal = np.exp(g_rows) >= SMALLEST_NORMAL_DECAY
    active_rows = chunk_rows(active[..., None, None].astype(float), chunk_size)[:, 0, ..., 0] > 0
    recurrent = np.any(active_rows[:, None, :, :, None] & ~normal, axis=(-2, -1))
    recurrent_grads = {}

    def recurrent_reverse(b, h, c, entry, d_exit):
        """The recurrent form's reverse of chunk c of (b, h) from its entry
        state; returns dS entering it and keeps the chunk's gradients."""

        def rows(x):  # this chunk's rows as one problem [1, L, 1(, D)]
            return x[b, h, c][None, :, None]

        grads = gated_delta_rule_reference_vjp(
            rows(q_rows),
            rows(k_rows),
            rows(v_rows),
            rows(g_rows),
            beta_effective[b, h, c][None, :, None],
            entry[None, None],
            y_cotangent=rows(d_out),
            state_cotangent=d_exit[None, None],
            scale=1.0,  # d_out is scale dy already
            mask=active_rows[b, c][None],
        )
        recurrent_grads[b, h, c] = {
            name: value[0, :, 0] for name, value in grads.items() if name != "state"
        }
        return grads["state"][0, 0]

    out = {"key_head": rows["key_head"], "active": active, "recurrent_grads": recurrent_grads}
    d_corrected, dq, dk, pairs = key_chunk_output_backward(
        d_out, f["corrected"], f["qk"], decay, q_rows, k_rows
    )
    out.update(output_d_corrected=d_corrected, output_dq=dq, output_dk=dk)
    d_entry, dw, carry = key_chunk_carry_backward(
        d_out,
        d_state,
        d_corrected,
        f["w"],
        f["corrected"],
        f["entry_states"],
        q_rows,
        k_rows,
        from_start,
        decay[..., -1, :, :],
        recurrent,
        recurrent_reverse,
    )
    d_corrected = d_corrected + carry["d_corrected"]
    dq, dk = dq + carry["dq"], dk + carry["dk"]
    out.update(carry_d_corrected=d_corrected, carry_dw=dw, carry_dq=dq, carry_dk=dk)
    out["d_entry"] = d_entry
    dt, dv, dbeta, dk_w_u, entry_w_u = key_recompute_w_u_backward(
        d_corrected, dw, f["kkt_inverse"], v_rows, k_rows, beta_effective, from_start
    )
    out.update(w_u_dt=dt, w_u_dk=dk + dk_w_u, w_u_dbeta=dbeta, dv=dv)
    dk_kkt, dbeta_kkt, pairs_kkt = key_kkt_inverse_backward(
        dt, f["kkt_inverse"], k_rows, decay, beta_effective, f["k_gram"]
    )
    out.update(kkt_dk=out["w_u_dk"] + dk_kkt, kkt_dbeta=dbeta + dbeta_kkt)
    out["dg"], out["dgamma"] = key_gate_cumsum_backward(
        pairs + pairs_kkt, carry["entry"] + entry_w_u, carry["exit"], g_rows
    )
    return out


def decayed_rows(x, decay, b_rows):
    """R_ic = sum_j X_ij decay(i, j, c) b_jc: X `[..., L, L]` decayed per
    channel, times b `[..., L, Dk]`."""
    return np.einsum("...ij,...ijc,...jc->...ic", x, decay, b_rows)


def decayed_columns(x, decay, a_rows):
    """C_jc = sum_i X_ij decay(i, j, c) a_ic: X^T decayed per channel, times a."""
    return np.einsum("...ij,...ijc,...ic->...jc", x, decay, a_rows)


def pair_terms(x, a_rows, b_rows):
    """The pair terms of a decayed gram with entries X_ij a_ic b_jc decay(i, j,
    c): X_ij a_ic b_jc for j < i, `[..., L, L, Dk]`."""
    return np.tril(x, k=-1)[..., None] * a_rows[..., :, None, :] * b_rows[..., None, :, :]


def key_chunk_output_backward(d_out, corrected, qk_tiles, decay, q_rows, k_rows):
    """Stage chunk_output_backward with per-key gates: O = M V', M the decayed
    Q K^T (key_decayed_grams). Returns (dV', dq, dk, the pair terms)."""
    d_corrected = np.swapaxes(qk_tiles, -1, -2) @ d_out
    dm = np.tril(d_out @ np.swapaxes(corrected, -1, -2))
    dq = decayed_rows(dm, decay, k_rows)
    dk = decayed_columns(dm, decay, q_rows)
    return d_corrected, dq, dk, pair_terms(dm, q_rows, k_rows)


def key_chunk_carry_backward(
    d_out,
    d_state,
    d_corrected,
    w,
    corrected,
    entry_states,
    q_rows,
    k_rows,
    from_start,
    to_end,
    recurrent,
    recurrent_reverse,
):
    """Stage chunk_carry_backward with per-key gates: the chunks last to
    first, carrying dS through the entry state's share of the output
    (S (decay(i, -1, :) q_i)), the exit state S diag(decay(L-1, -1, :)) +
    V'^T (decay(L-1, j, :) K) and V' = U - W S^T. A chunk marked in
    `recurrent` ([B, Hv, C]) takes dS entering it from
    `recurrent_reverse(b, h, c, entry, d_exit)`. Returns (dS of the initial
    state, dW, and a dict of the additions to dV', dq and dk, and of the
    entry and exit terms)."""
    chunks = w.shape[2]
    out = {
        "d_corrected": np.zeros_like(d_corrected),
        "dq": np.zeros(q_rows.shape),
        "dk": np.zeros(k_rows.shape),
        "entry": np.zeros(from_start.shape),
        "exit": np.zeros(from_start.shape),
    }
    dw = np.zeros_like(w)
    dS = d_state
    for c in reversed(range(chunks)):
        S, dO = entry_states[:, :, c], d_out[:, :, c]
        gamma, e, q_c, k_c = from_start[:, :, c], to_end[:, :, c], q_rows[:, :, c], k_rows[:, :, c]
        out_state, back = dO @ S, corrected[:, :, c] @ dS
        dq = gamma * out_state
        entry = out_state * q_c
        entry[..., -1, :] += np.einsum("bhvk,bhvk->bhk", dS, S)
        dV = d_corrected[:, :, c] + (e * k_c) @ np.swapaxes(dS, -1, -2)
        dk_end = e * back
        chunk_decay = gamma[..., -1, :]
        dw[:, :, c] = -dV @ S
        d_entry = (
            chunk_decay[..., None, :] * dS
            + np.swapaxes(dO, -1, -2) @ (gamma * q_c)
            - np.swapaxes(dV, -1, -2) @ w[:, :, c]
        )
        for b, h in zip(*np.nonzero(recurrent[:, :, c])):
            d_entry[b, h] = recurrent_reverse(b, h, c, S[b, h], dS[b, h])
        dS = d_entry
        out["d_corrected"][:, :, c] = dV - d_corrected[:, :, c]
        out["dq"][:, :, c], out["dk"][:, :, c] = dq, dk_end
        out["entry"][:, :, c], out["exit"][:, :, c] = entry, back * k_c
    return dS, dw, out


def key_recompute_w_u_backward(d_u, dw, inverse, v_rows, k_rows, beta_effective, from_start):
    """Stage recompute_w_u_backward with per-key gates: U = T diag(beta) V,
    W = T Kb, Kb_ic = beta_i decay(i, -1, c) k_ic. Returns (dT, dv, dbeta,
    dk, the entry terms)."""
    beta = beta_effective[..., None]
    dt = np.tril(
        d_u @ np.swapaxes(beta * v_rows, -1, -2)
        + dw @ np.swapaxes(beta * from_start * k_rows, -1, -2)
    )
    d_scaled_v = np.swapaxes(inverse, -1, -2) @ d_u
    d_scaled_k = np.swapaxes(inverse, -1, -2) @ dw
    dbeta = np.sum(d_scaled_v * v_rows, axis=-1) + np.sum(d_scaled_k * from_start * k_rows, axis=-1)
    dk = beta * from_start * d_scaled_k
    return dt, beta * d_scaled_v, dbeta, dk, beta * d_scaled_k * k_rows


def key_kkt_inverse_backward(dt, inverse, k_rows, decay, beta_effective, k_gram):
    """Stage kkt_inverse_backward with per-key gates: A_ij = beta_i
    k_gram_ij, k_gram the decayed K K^T (key_decayed_grams); dA = -T^T dT
    T^T on the strictly lower triangle. Returns (dk, dbeta, the pair
    terms)."""
    inverse_t = np.swapaxes(inverse, -1, -2)
    da = np.tril(-inverse_t @ dt @ inverse_t, k=-1)
    dbeta = np.sum(da * k_gram, axis=-1)
    d_gram = beta_effective[..., None] * da
    rows = decayed_rows(d_gram, decay, k_rows)
    columns = decayed_columns(d_gram, decay, k_rows)
    return rows + columns, dbeta, pair_terms(d_gram, k_rows, k_rows)


def key_gate_cumsum_backward(pairs, entry_terms, exit_terms, g_rows):
    """Stage gate_cumsum_backward with per-key gates: per channel, dgamma_t =
    sum_{i >= t > j} P_ij decay(i, t) decay(t-1, j) over the pair terms (j =
    -1: the entry terms; the exit terms are those of i = L-1), and dg = gamma
    dgamma. As the kernels scan it: H_i0 = P_{i,-1}, H_{i,t+1} = gamma_t
    H_it + P_it, dgamma_t = sum_{i >= t} decay(i, t) H_it, the decays as
    running products of gamma (masked tokens decay by 1). Returns (dg,
    dgamma)."""
    gamma = np.exp(g_rows)
    pairs = pairs.copy()
    pairs[..., -1, :-1, :] += exit_terms[..., :-1, :]  # decay(L-1, L-1) = 1
    carried = entry_terms.copy()
    dgamma = np.zeros(entry_terms.shape)
    for t in range(gamma.shape[-2]):
        to_later = np.cumprod(gamma[..., t + 1 :, :], axis=-2)  # decay(i, t), i > t
        dgamma[..., t, :] = carried[..., t, :] + np.sum(to_later * carried[..., t + 1 :, :], -2)
        # Rows i <= t are not read again: the later tokens' sums start at them.
        carried = gamma[..., t : t + 1, :] * carried + pairs[..., :, t, :]
    return gamma * dgamma, dgamma
