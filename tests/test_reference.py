"""The float64 oracle checked on its own, before it judges the kernels.

Against a second transcription of the recurrence written the way Hugging Face's
Qwen3-Next reference states it (state kept key-major `[Dk, Dv]`, one head at a
time, q scaled before the readout), against MLX core's float32 op, and for the
exact identities of the contract (a masked token is an omitted one; a zero
linear decay forgets everything).
"""

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta.reference import (
    gated_delta_rule_reference,
    gated_delta_update_reference,
    to_float64,
)
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import core_cases, make_core_case


def key_major_transcription(case):
    """The recurrence as HF writes it: S^T of ours, one (row, head) at a time."""
    q, k, v, g, beta = (to_float64(x) for x in (case.q, case.k, case.v, case.g, case.beta))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    options = case.options
    scale = Dk**-0.5 if options["scale"] is None else options["scale"]
    mask = None if options["mask"] is None else np.asarray(options["mask"])
    state = None if case.state is None else to_float64(case.state)

    y = np.zeros((B, T, Hv, Dv))
    final = np.zeros((B, Hv, Dv, Dk))
    for b in range(B):
        for h in range(Hv):
            if options["head_mapping"] == "grouped":  # repeat_interleave of heads
                kh = h // (Hv // Hk)
            else:  # tile of heads
                kh = h % Hk
            S = np.zeros((Dk, Dv)) if state is None else state[b, h].T.copy()
            for t in range(T):
                if mask is not None and not mask[b, t]:
                    continue
                q_t, k_t = q[b, t, kh], k[b, t, kh]
                if options["normalize_qk"]:
                    q_t = q_t / np.sqrt(np.dot(q_t, q_t) + 1e-6)
                    k_t = k_t / np.sqrt(np.dot(k_t, k_t) + 1e-6)
                q_t = q_t * scale
                S = S * np.exp(g[b, t, h])
                kv_memory = (S * k_t[:, None]).sum(axis=0)
                delta = (v[b, t, h] - kv_memory) * beta[b, t, h]
                S = S + k_t[:, None] * delta[None, :]
                y[b, t, h] = (S * q_t[:, None]).sum(axis=0)
            final[b, h] = S.T
    return y, final


small_tokens = st.one_of(st.sampled_from((0, 1, 2, 5)), st.integers(0, 24))


@given(core_cases(tokens=small_tokens))
def test_oracle_matches_a_key_major_transcription(case):
    y, state = case.reference()
    expected_y, expected_state = key_major_transcription(case)
    assert_matches(
        "y",
        y,
        expected_y,
        "reference.transcription.v2.float64.output",
    )
    assert_matches(
        "state",
        state,
        expected_state,
        "reference.transcription.v2.float64.state",
    )


@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 40),
    key_heads=st.integers(1, 2),
    ratio=st.sampled_from((1, 2, 4)),
    key_dim=st.sampled_from((16, 32)),
    value_dim=st.sampled_from((16, 32)),
    with_state=st.booleans(),
    mask_kind=st.sampled_from(("none", "random", "left_padding")),
)
def test_update_oracle_matches_mlx_fast_in_float32(
    seed, tokens, key_heads, ratio, key_dim, value_dim, with_state, mask_kind
):
    case = make_core_case(
        seed,
        batch=2,
        tokens=tokens,
        key_heads=key_heads,
        value_heads=key_heads * ratio,
        key_dim=key_dim,
        value_dim=value_dim,
        with_state=with_state,
        mask_kind=mask_kind,
    )
    gamma = mx.exp(case.g)
    mask = case.options["mask"]
    y, state = gated_delta_update_reference(
        case.q, case.k, case.v, gamma, case.beta, case.state, mask
    )
    mlx_y, mlx_state = mx.fast.gated_delta_update(
        case.q, case.k, case.v, gamma, case.beta, initial_state=case.state, mask=mask
    )
    assert_matches(
        "y",
        mlx_y,
        y,
        "reference.mlx_fast.v2.float32.output",
    )
    assert_matches(
        "state",
        mlx_state,
        state,
        "reference.mlx_fast.v2.float32.state",
    )


def test_rule_oracle_is_the_update_oracle_with_log_decay_and_scale():
    case = make_core_case(
        7,
        batch=2,
        tokens=9,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=32,
        scale=1.0,
        mask_kind="random",
    )
    y, state = case.reference()
    update_y, update_state = gated_delta_update_reference(
        case.q,
        case.k,
        case.v,
        np.exp(to_float64(case.g)),
        case.beta,
        case.state,
        case.options["mask"],
    )
    np.testing.assert_array_equal(y, update_y)
    np.testing.assert_array_equal(state, update_state)


def test_masked_token_is_an_omitted_token():
    case = make_core_case(
        3, batch=1, tokens=12, key_heads=1, value_heads=2, key_dim=16, value_dim=16
    )
    mask = np.ones((1, 12), dtype=bool)
    mask[0, [0, 4, 5, 11]] = False
    kept = np.flatnonzero(mask[0])
    q, k, v, g, beta = (to_float64(x) for x in case.args()[:5])

    y, state = gated_delta_rule_reference(q, k, v, g, beta, case.state, mask=mask)
    kept_y, kept_state = gated_delta_rule_reference(
        q[:, kept], k[:, kept], v[:, kept], g[:, kept], beta[:, kept], case.state
    )
    np.testing.assert_array_equal(state, kept_state)
    np.testing.assert_array_equal(y[:, kept], kept_y)
    assert not y[:, ~mask[0]].any()


def test_zero_gamma_forgets_the_state_exactly():
    case = make_core_case(
        5, batch=1, tokens=10, key_heads=1, value_heads=2, key_dim=16, value_dim=16
    )
    gamma = np.exp(to_float64(case.g))
    gamma[:, 6] = 0.0
    q, k, v, beta = case.q, case.k, case.v, case.beta
    y_a, state_a = gated_delta_update_reference(q, k, v, gamma, beta, case.state)
    other_state = 100.0 * np.ones_like(to_float64(case.state))
    y_b, state_b = gated_delta_update_reference(q, k, v, gamma, beta, other_state)

    # From the wiping token on, nothing of the initial state remains.
    np.testing.assert_array_equal(y_a[:, 6:], y_b[:, 6:])
    np.testing.assert_array_equal(state_a, state_b)
    assert not np.array_equal(y_a[:, :6], y_b[:, :6])
