"""Property tests of per-key-channel gates: `g` (and `gamma`) of shape
`[B, T, Hv, Dk]`, column c of the state decaying by `exp(g[t, h, c])`
(docs/contract.md). The scalar gates' contracts hold unchanged.

Run by the repository's `pytest` and by `python -m mlx_gated_delta selftest`, on the
default device.
"""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_rule, gated_delta_update
from mlx_gated_delta.reference import (
    gated_delta_rule_reference,
    gated_delta_rule_reference_vjp,
    gated_delta_update_reference_vjp,
    to_float64,
)
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import budget, core_cases, make_core_case
from mlx_gated_delta.tests.test_core import (
    ALGORITHMS,
    ALGORITHMS_AGREE_CONTRACTS,
    ORACLE_OUTPUT_CONTRACTS,
    SPLIT_CONTRACTS,
    SPLIT_DTYPES,
    assert_matches_oracle,
    assert_update_matches_oracle,
    oracle_terms,
    run,
    run_in_calls,
    split_terms,
    wipe_cases,
)
from mlx_gated_delta.tests.test_core_gradients import (
    SHORT_TOKENS,
    assert_gradients_match,
    case_gradients,
    cotangents,
)

# Per-key gates whose channels are all equal against the scalar gate: y,
# then the state (against the terms of the algorithm that ran both).
PER_KEY_VS_SCALAR = {
    "output": "core.per_key_vs_scalar.v2.float32.output",
    "state": "core.per_key_vs_scalar.v2.float32.state",
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases(per_key_gates=True))
def test_per_key_gates_match_the_float64_oracle(algorithm, case):
    # Every shape, dtype, mask kind, mapping, decay strength and wipe kind of
    # the scalar property, with one decay per key channel.
    assert case.g.shape == (*case.v.shape[:3], case.q.shape[3])
    y, state = run(case, algorithm)
    assert y.dtype == case.v.dtype and state.dtype == mx.float32
    assert_matches_oracle(case, y, state, algorithm)


@given(case=core_cases(dtypes=("float32",), per_key_gates=True))
def test_per_key_chunked_matches_recurrent(case):
    recurrent_y, recurrent_state = run(case, "recurrent")
    chunked_y, chunked_state = run(case, "chunked")
    output_terms, state_terms = oracle_terms(case, "chunked")
    assert_matches("y", chunked_y, recurrent_y, ALGORITHMS_AGREE_CONTRACTS[0], terms=output_terms)
    assert_matches(
        "state", chunked_state, recurrent_state, ALGORITHMS_AGREE_CONTRACTS[1], terms=state_terms
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_per_key_split_continuity(algorithm, data):
    # Recurrent: bitwise, as with scalar gates (each token is the same float32
    # arithmetic); chunked: within the chunked split contract.
    case = data.draw(core_cases(dtypes=SPLIT_DTYPES[algorithm], per_key_gates=True))
    tokens = case.q.shape[1]
    points = sorted(data.draw(st.lists(st.integers(0, tokens), min_size=1, max_size=3)))
    bounds = [0, *points, tokens]
    full_y, full_state = run(case, algorithm)
    split_y, split_state = run_in_calls(case, bounds, algorithm)
    output_terms, state_terms = split_terms(case, bounds, algorithm)
    output_contract, state_contract = SPLIT_CONTRACTS[algorithm]
    assert_matches("y", split_y, full_y, output_contract, terms=output_terms)
    assert_matches("state", split_state, full_state, state_contract, terms=state_terms)


@pytest.mark.parametrize("wipes", ("random", "chunk_edges", "runs"))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_channel_wipes_match_the_float64_oracle(algorithm, wipes, data):
    # g = -inf on single channels: that column of the state is wiped exactly,
    # the others decay on; no NaN reaches any output.
    case = data.draw(wipe_cases(wipes, per_key_gates=True))
    y, state = run(case, algorithm)
    assert not np.isnan(to_float64(y)).any() and not np.isnan(to_float64(state)).any()
    assert_matches_oracle(case, y, state, algorithm)


@pytest.mark.parametrize("wipes", ("random", "runs"))
@given(data=st.data())
def test_per_key_gamma_through_gated_delta_update(wipes, data):
    # The MLX-compatible entry point takes gamma [B, T, Hv, Dk] too; gamma == 0
    # on a channel wipes that column.
    case = data.draw(wipe_cases(wipes, per_key_gates=True))
    gamma = mx.exp(case.g.astype(mx.float32))
    arguments = (case.q, case.k, case.v, gamma, case.beta, case.state, case.options["mask"])
    assert_update_matches_oracle(*gated_delta_update(*arguments), *arguments)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases(dtypes=("float32",)))
def test_equal_channels_give_the_scalar_gate_result(algorithm, case):
    # A g whose Dk channels all equal the scalar g is the same recurrence:
    # the float64 oracles agree exactly, and the kernels agree within two
    # float32 errors, not bitwise (contracts.py says why: the two paths
    # round their products differently).
    per_key_g = mx.repeat(case.g[..., None], case.q.shape[3], axis=-1)
    scalar_y, scalar_state = run(case, algorithm)
    per_key_y, per_key_state = gated_delta_rule(
        case.q,
        case.k,
        case.v,
        per_key_g,
        case.beta,
        case.state,
        algorithm=algorithm,
        **case.options,
    )
    output_terms, state_terms = oracle_terms(case, algorithm)
    assert_matches("y", per_key_y, scalar_y, PER_KEY_VS_SCALAR["output"], terms=output_terms)
    assert_matches(
        "state", per_key_state, scalar_state, PER_KEY_VS_SCALAR["state"], terms=state_terms
    )
    oracle_y, oracle_state = gated_delta_rule_reference(
        case.q, case.k, case.v, per_key_g, case.beta, case.state, **case.options
    )
    expected_y, expected_state = case.reference()
    assert np.array_equal(oracle_y, expected_y) and np.array_equal(oracle_state, expected_state)


def test_the_oracle_check_sees_a_kernel_that_ignores_the_channels():
    # Probe: had the kernel applied channel 0's decay to every column, the
    # oracle comparison would fail: the oracle on that wrong g is outside the
    # contract around the kernel's result.
    case = make_core_case(
        7,
        batch=1,
        tokens=100,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        decay="model",
        per_key_gates=True,
    )
    for algorithm in ALGORITHMS:
        y, _ = run(case, algorithm)
        channel_0 = mx.repeat(case.g[..., :1], case.g.shape[-1], axis=-1)
        wrong_y, _ = gated_delta_rule_reference(
            case.q, case.k, case.v, channel_0, case.beta, case.state, **case.options
        )
        output_terms, _ = oracle_terms(case, algorithm)
        with pytest.raises(AssertionError, match="violated"):
            assert_matches(
                "y", y, wrong_y, ORACLE_OUTPUT_CONTRACTS[algorithm, "float32"], terms=output_terms
            )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_strong_channel_decays_next_to_weak_ones_stay_exact(algorithm):
    # Half the channels decay by exp(-200) per token, the others barely: over
    # a chunk the cumulative log decay of a strong channel reaches -12800, so
    # a chunked form that factored each decay as exp(G_i) / exp(G_j) from the
    # chunk's start would form exp(+12800) = inf and NaN. Held to the oracle.
    case = make_core_case(
        3,
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=16,
        decay="mild",
        per_key_gates=True,
    )
    strong = np.arange(32) % 2 == 0
    g = np.where(strong, -200.0, to_float64(case.g)).astype(np.float32)
    case = dataclasses.replace(case, g=mx.array(g))
    y, state = run(case, algorithm)
    assert np.isfinite(to_float64(y)).all() and np.isfinite(to_float64(state)).all()
    assert_matches_oracle(case, y, state, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_huge_entry_state_beside_severe_channels(algorithm):
    # Found by the channel-wipe property: T = (I + A)^-1 mixes strong and
    # weak channels' decays, so the chunked form carries the 1e18 entry state
    # through terms far larger than the final state (1.4e-4 of it, where the
    # recurrent form errs by 2e-6). Both meet their contracts: the chunked
    # one's is relative to those terms (docs/numerics.md).
    case = make_core_case(
        1346239734,
        batch=1,
        tokens=127,
        key_heads=1,
        value_heads=1,
        key_dim=32,
        value_dim=16,
        decay="mixed",
        wipes="chunk_edges",
        state_scale="huge",
        per_key_gates=True,
    )
    assert_matches_oracle(case, *run(case, algorithm), algorithm)


# Gradients (CPU, like every gradient so far): against the float64 reverse
# mode of the recurrence, one gradient per key channel, under the core_grad
# contracts of the scalar gates.
GRAD_BUDGET = budget(30)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@GRAD_BUDGET
@given(
    case=core_cases(tokens=SHORT_TOKENS, per_key_gates=True, contracting=False),
    which=st.sampled_from(("both", "y", "state")),
)
def test_per_key_gradients_match_the_float64_reference(algorithm, case, which):
    wy, ws = cotangents(case)
    use_y, use_state = which in ("both", "y"), which in ("both", "state")
    grads = case_gradients(case, wy, ws, algorithm=algorithm, use_y=use_y, use_state=use_state)
    expected = gated_delta_rule_reference_vjp(
        *case.args(),
        y_cotangent=wy if use_y else None,
        state_cotangent=ws if use_state else None,
        **case.options,
    )
    assert grads["g"].shape == case.g.shape
    for name, grad in grads.items():
        assert grad.dtype == getattr(case, name).dtype, name
    assert_gradients_match("core_grad.oracle.v1", grads, expected)
    # A channel's wipe (g = -inf) gets exactly 0; masked steps get 0.
    g_grad = np.asarray(grads["g"].astype(mx.float32))
    assert np.all(g_grad[np.isneginf(to_float64(case.g))] == 0.0)
    mask = case.options["mask"]
    if mask is not None:
        assert np.all(g_grad[~np.asarray(mask)] == 0.0)


@GRAD_BUDGET
@given(data=st.data())
def test_per_key_gamma_gradient_is_finite_and_exact_at_channel_wipes(data):
    case = data.draw(wipe_cases("random", state_scales=("unit",), per_key_gates=True))
    gamma = mx.exp(case.g.astype(mx.float32))
    wy, ws = cotangents(case)
    mask = case.options["mask"]

    def loss(q, k, v, gamma, beta, state):
        y, s = gated_delta_update(q, k, v, gamma, beta, state, mask=mask, stream=mx.cpu)
        return (y * wy).astype(mx.float32).sum() + (s * ws).sum()

    names = ("q", "k", "v", "gamma", "beta", "state")
    arrays = (case.q, case.k, case.v, gamma, case.beta, case.state)
    grads = dict(zip(names, mx.grad(loss, argnums=tuple(range(6)))(*arrays)))
    expected = gated_delta_update_reference_vjp(*arrays, mask, y_cotangent=wy, state_cotangent=ws)
    assert np.isfinite(to_float64(grads["gamma"])).all()
    assert_gradients_match("core_grad.oracle.v1", grads, expected)


def test_per_key_gradients_of_the_two_algorithms_are_two_backwards():
    # An explicit algorithm runs that form's backward with per-key gates too
    # (strong channels next to weak ones, so that the chunked one takes both
    # of its diagonal-block forms): the two differ in their rounding and
    # each agrees with the reference.
    case = make_core_case(
        11,
        batch=2,
        tokens=150,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
        mask_kind="random",
        normalize_qk=True,
        head_mapping="interleaved",
        per_key_gates=True,
    )
    g = np.array(case.g)
    g[..., ::3] = -30.0
    case = dataclasses.replace(case, g=mx.array(g).astype(case.g.dtype))
    wy, ws = cotangents(case)
    expected = gated_delta_rule_reference_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, **case.options
    )
    grads = {}
    for algorithm in ("recurrent", "chunked"):
        grads[algorithm] = case_gradients(case, wy, ws, algorithm=algorithm)
        assert_gradients_match("core_grad.oracle.v1", grads[algorithm], expected)
    differing = [
        name
        for name, grad in grads["recurrent"].items()
        if not np.array_equal(np.asarray(grad), np.asarray(grads["chunked"][name]))
    ]
    assert set(differing) == set(grads["recurrent"]), differing
