"""The float64 reference backward checked against central finite differences
of the float64 forward, before it judges the kernels' gradients.

The loss is <y, Wy> + <S_final, WS> for random weights, so its gradient is the
vjp with the cotangents Wy and WS.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_gated_delta import reference
from mlx_gated_delta.reference import (
    gated_delta_rule_chunked_reference_vjp,
    gated_delta_rule_per_key_chunked_reference_vjp,
    gated_delta_rule_reference,
    gated_delta_rule_reference_vjp,
    gated_delta_update_reference,
    gated_delta_update_reference_vjp,
)
from mlx_gated_delta.testing import strategies  # noqa: F401 (loads the Hypothesis profile)
from mlx_gated_delta.testing.contracts import assert_matches

FD_STEP = 1e-6
FD_PREFIX = "reference.finite_difference.v1.float64"
TENSOR_KIND = {
    "q": "activation_grad",
    "k": "activation_grad",
    "v": "activation_grad",
    "g": "gate_grad",
    "gamma": "gate_grad",
    "beta": "gate_grad",
    "state": "state_grad",
}


def fd_contract(name):
    return f"{FD_PREFIX}.{TENSOR_KIND[name]}"


def make_inputs(seed, *, batch, tokens, key_heads, ratio, key_dim, value_dim, mask_kind):
    rng = np.random.default_rng(seed)
    value_heads = key_heads * ratio
    inputs = {
        "q": rng.standard_normal((batch, tokens, key_heads, key_dim)),
        "k": rng.standard_normal((batch, tokens, key_heads, key_dim)) * 0.5,
        "v": rng.standard_normal((batch, tokens, value_heads, value_dim)),
        "g": rng.uniform(-1.0, 0.0, (batch, tokens, value_heads)),
        "beta": rng.uniform(0.0, 1.0, (batch, tokens, value_heads)),
        "state": rng.standard_normal((batch, value_heads, value_dim, key_dim)),
    }
    mask = None
    if mask_kind == "random":
        mask = rng.uniform(size=(batch, tokens)) < 0.6
    weights = {
        "y": rng.standard_normal((batch, tokens, value_heads, value_dim)),
        "state": rng.standard_normal((batch, value_heads, value_dim, key_dim)),
    }
    return inputs, mask, weights


def finite_differences(loss, inputs):
    """Central differences of loss(inputs) for every element of every input."""
    grads = {}
    for name, value in inputs.items():
        grad = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            saved = value[index]
            value[index] = saved + FD_STEP
            plus = loss(inputs)
            value[index] = saved - FD_STEP
            minus = loss(inputs)
            value[index] = saved
            grad[index] = (plus - minus) / (2 * FD_STEP)
        grads[name] = grad
    return grads


def rule_loss(weights, options, use_y=True, use_state=True):
    def loss(inputs):
        y, state = gated_delta_rule_reference(**inputs, **options)
        return (np.sum(y * weights["y"]) if use_y else 0.0) + (
            np.sum(state * weights["state"]) if use_state else 0.0
        )

    return loss


def assert_gradients_match(grads, expected):
    for name, value in expected.items():
        assert_matches(f"d{name}", grads[name], value, fd_contract(name))


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 6),
    key_heads=st.integers(1, 2),
    ratio=st.sampled_from((1, 2)),
    head_mapping=st.sampled_from(("grouped", "interleaved")),
    normalize_qk=st.booleans(),
    mask_kind=st.sampled_from(("none", "random")),
    scale=st.sampled_from((None, 0.7)),
    cotangents=st.sampled_from(("both", "y", "state")),
)
def test_reference_vjp_matches_finite_differences(
    seed,
    tokens,
    key_heads,
    ratio,
    head_mapping,
    normalize_qk,
    mask_kind,
    scale,
    cotangents,
):
    inputs, mask, weights = make_inputs(
        seed,
        batch=2,
        tokens=tokens,
        key_heads=key_heads,
        ratio=ratio,
        key_dim=3,
        value_dim=2,
        mask_kind=mask_kind,
    )
    options = dict(scale=scale, head_mapping=head_mapping, mask=mask, normalize_qk=normalize_qk)
    use_y, use_state = cotangents in ("both", "y"), cotangents in ("both", "state")
    expected = finite_differences(rule_loss(weights, options, use_y, use_state), inputs)
    grads = gated_delta_rule_reference_vjp(
        **inputs,
        y_cotangent=weights["y"] if use_y else None,
        state_cotangent=weights["state"] if use_state else None,
        **options,
    )
    assert_gradients_match(grads, expected)
    if mask is not None:
        # A masked step gives its inputs exactly zero gradient.
        skipped = ~mask
        for name in ("v", "g", "beta"):
            assert np.all(grads[name][skipped] == 0.0), name


def test_the_check_sees_a_missing_cotangent_and_a_wrong_head_mapping():
    # Probes: gradients that are wrong in one term fail the comparison.
    inputs, _, weights = make_inputs(
        1, batch=1, tokens=4, key_heads=2, ratio=2, key_dim=3, value_dim=2, mask_kind="none"
    )
    options = dict(scale=None, head_mapping="grouped", mask=None, normalize_qk=False)
    expected = finite_differences(rule_loss(weights, options), inputs)
    without_state = gated_delta_rule_reference_vjp(**inputs, y_cotangent=weights["y"], **options)
    with pytest.raises(AssertionError, match="violated"):
        assert_gradients_match(without_state, expected)
    wrong_mapping = gated_delta_rule_reference_vjp(
        **inputs,
        y_cotangent=weights["y"],
        state_cotangent=weights["state"],
        **{**options, "head_mapping": "interleaved"},
    )
    with pytest.raises(AssertionError, match="violated"):
        assert_gradients_match(wrong_mapping, expected)


def test_a_wipe_has_finite_exact_gradients():
    # gamma == 0 (g = -inf) forgets the state. Every token's output is linear
    # in each gamma, so central differences in gamma are exact up to rounding
    # even at gamma == 0, where the gradient wrt g = log(gamma) is 0.
    inputs, _, weights = make_inputs(
        3, batch=2, tokens=6, key_heads=1, ratio=2, key_dim=3, value_dim=2, mask_kind="none"
    )
    gamma = np.exp(inputs.pop("g"))
    gamma[:, 2, 0] = 0.0
    gamma[1, 4, :] = 0.0
    update_inputs = {
        "q": inputs["q"],
        "k": inputs["k"],
        "v": inputs["v"],
        "gamma": gamma,
        "beta": inputs["beta"],
        "initial_state": inputs["state"],
    }

    def update_loss(values):
        y, state = gated_delta_update_reference(**values)
        return np.sum(y * weights["y"]) + np.sum(state * weights["state"])

    expected = finite_differences(update_loss, update_inputs)
    expected["state"] = expected.pop("initial_state")
    grads = gated_delta_update_reference_vjp(
        **update_inputs, y_cotangent=weights["y"], state_cotangent=weights["state"]
    )
    assert_gradients_match(grads, expected)
    assert np.all(grads["gamma"][gamma == 0.0] != 0.0)  # the wipe still has a gradient

    # The same call through the log-space rule: g = -inf at the wipes.
    with np.errstate(divide="ignore"):
        g = np.log(gamma)
    rule_grads = gated_delta_rule_reference_vjp(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        g,
        inputs["beta"],
        inputs["state"],
        y_cotangent=weights["y"],
        state_cotangent=weights["state"],
        scale=1.0,
    )
    for name, value in rule_grads.items():
        assert np.all(np.isfinite(value)), name
    assert np.all(rule_grads["g"][gamma == 0.0] == 0.0)
    # exp(log(gamma)) rounds, so the decay's gradient is held to the same check.
    assert_gradients_match({"gamma": rule_grads["gamma"]}, {"gamma": expected["gamma"]})


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 5),
    head_mapping=st.sampled_from(("grouped", "interleaved")),
    mask_kind=st.sampled_from(("none", "random")),
)
def test_reference_vjp_matches_finite_differences_with_per_key_gates(
    seed,
    tokens,
    head_mapping,
    mask_kind,
):
    # g [B, T, Hv, Dk]: one gradient per key channel, each the sum over the
    # state's rows of its column's share.
    inputs, mask, weights = make_inputs(
        seed,
        batch=2,
        tokens=tokens,
        key_heads=1,
        ratio=2,
        key_dim=3,
        value_dim=2,
        mask_kind=mask_kind,
    )
    rng = np.random.default_rng(seed + 1)
    inputs["g"] = rng.uniform(-1.0, 0.0, inputs["g"].shape + (3,))
    options = dict(head_mapping=head_mapping, mask=mask)
    expected = finite_differences(rule_loss(weights, options), inputs)
    grads = gated_delta_rule_reference_vjp(
        **inputs, y_cotangent=weights["y"], state_cotangent=weights["state"], **options
    )
    assert grads["g"].shape == inputs["g"].shape
    assert_gradients_match(grads, expected)
    if mask is not None:
        assert np.all(grads["g"][~mask] == 0.0)


def test_the_per_key_check_sees_a_gate_gradient_summed_over_the_channels():
    # Probe: a gate gradient that lumps the channels together (what a scalar
    # backward would give) fails against the finite differences.
    inputs, mask, weights = make_inputs(
        5, batch=1, tokens=3, key_heads=1, ratio=1, key_dim=3, value_dim=2, mask_kind="none"
    )
    inputs["g"] = np.random.default_rng(6).uniform(-1.0, 0.0, inputs["g"].shape + (3,))
    expected = finite_differences(rule_loss(weights, {}), inputs)
    grads = gated_delta_rule_reference_vjp(
        **inputs, y_cotangent=weights["y"], state_cotangent=weights["state"]
    )
    lumped = np.broadcast_to(grads["g"].mean(axis=-1, keepdims=True), grads["g"].shape)
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("dg", lumped, expected["g"], fd_contract("g"))


CHUNKED_PREFIX = "reference.chunked_grad.v1.float64"


def chunked_and_recurrent(seed, tokens, chunk_size, **options):
    inputs, mask, weights = make_inputs(
        seed,
        batch=2,
        tokens=tokens,
        key_heads=2,
        ratio=2,
        key_dim=5,
        value_dim=3,
        mask_kind=options.pop("mask_kind", "none"),
    )
    options = dict(options, mask=mask, y_cotangent=weights["y"], state_cotangent=weights["state"])
    chunked = gated_delta_rule_chunked_reference_vjp(**inputs, **options, chunk_size=chunk_size)
    recurrent = gated_delta_rule_reference_vjp(**inputs, **options)
    return chunked, recurrent


def assert_chunked_matches(chunked, recurrent):
    for name, value in chunked.items():
        assert_matches(f"d{name}", value, recurrent[name], f"{CHUNKED_PREFIX}.{TENSOR_KIND[name]}")


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 40),
    chunk_size=st.sampled_from((1, 4, 7, 64)),
    head_mapping=st.sampled_from(("grouped", "interleaved")),
    normalize_qk=st.booleans(),
    mask_kind=st.sampled_from(("none", "random")),
    scale=st.sampled_from((None, 0.7)),
)
def test_chunked_backward_stages_match_the_recurrent_backward(
    seed, tokens, chunk_size, head_mapping, normalize_qk, mask_kind, scale
):
    """The float64 stages of the chunked backward (docs/numerics.md, "The
    chunked backward") give the recurrence's gradient, over chunk sizes that
    cut the tokens into many chunks, a short last one, or one."""
    chunked, recurrent = chunked_and_recurrent(
        seed,
        tokens,
        chunk_size,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        mask_kind=mask_kind,
        scale=scale,
    )
    assert set(chunked) == {"q", "k", "v", "g", "beta", "state"}
    assert_chunked_matches(chunked, recurrent)


def forwards_cumsum(original):
    """gate_cumsum_backward broken: the reverse cumulative sum taken forwards."""
    return lambda d_log: np.cumsum(d_log, axis=-1)


def without_decay_terms(original):
    """kkt_inverse_backward broken: A's terms of the decay gradient dropped."""

    def stage(*args):
        dk, dbeta, d_log = original(*args)
        return dk, dbeta, np.zeros_like(d_log)

    return stage


@pytest.mark.parametrize(
    "stage, breaking",
    (("gate_cumsum_backward", forwards_cumsum), ("kkt_inverse_backward", without_decay_terms)),
)
def test_the_chunked_check_sees_a_broken_stage(monkeypatch, stage, breaking):
    # Broken where the chunked backward looks its stages up: in its own module.
    backward = reference.chunked_backward
    monkeypatch.setattr(backward, stage, breaking(getattr(backward, stage)))
    chunked, recurrent = chunked_and_recurrent(3, 20, 8)
    with pytest.raises(AssertionError, match="dg"):
        assert_chunked_matches(chunked, recurrent)


def test_the_chunked_reference_refuses_wipes():
    inputs, _, _ = make_inputs(
        0, batch=1, tokens=4, key_heads=1, ratio=1, key_dim=2, value_dim=2, mask_kind="none"
    )
    inputs["g"][0, 1, 0] = -np.inf
    with pytest.raises(ValueError, match="no wipes"):
        gated_delta_rule_chunked_reference_vjp(**inputs)


def per_key_chunked_and_recurrent(seed, tokens, chunk_size, gates="weak", **options):
    """The per-key chunked backward's stages and the recurrent backward on one
    problem. `gates`: "weak" (g in [-1, 0]), "strong" (every other channel at
    g in [-30, -20], whose decay leaves float32 within a few tokens) or
    "wipes" (weak, with single channels wiped, g = -inf)."""
    inputs, mask, weights = make_inputs(
        seed,
        batch=2,
        tokens=tokens,
        key_heads=2,
        ratio=2,
        key_dim=5,
        value_dim=3,
        mask_kind=options.pop("mask_kind", "none"),
    )
    rng = np.random.default_rng(seed + 1)
    g = rng.uniform(-1.0, 0.0, inputs["g"].shape + (5,))
    if gates == "strong":
        g[..., ::2] = rng.uniform(-30.0, -20.0, g[..., ::2].shape)
    elif gates == "wipes":
        wiped = rng.uniform(size=g.shape) < 0.03
        g[wiped] = -np.inf
    inputs["g"] = g
    options = dict(options, mask=mask, y_cotangent=weights["y"], state_cotangent=weights["state"])
    chunked = gated_delta_rule_per_key_chunked_reference_vjp(
        **inputs, **options, chunk_size=chunk_size
    )
    recurrent = gated_delta_rule_reference_vjp(**inputs, **options)
    return chunked, recurrent


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 40),
    chunk_size=st.sampled_from((1, 4, 7, 64)),
    gates=st.sampled_from(("weak", "strong", "wipes")),
    head_mapping=st.sampled_from(("grouped", "interleaved")),
    normalize_qk=st.booleans(),
    mask_kind=st.sampled_from(("none", "random")),
    scale=st.sampled_from((None, 0.7)),
)
def test_per_key_chunked_backward_stages_match_the_recurrent_backward(
    seed, tokens, chunk_size, gates, head_mapping, normalize_qk, mask_kind, scale
):
    """The float64 stages of the per-key chunked backward give the
    recurrence's gradient, the linear decay's included; a chunk with a wipe
    runs the recurrent reverse, as on the CPU."""
    chunked, recurrent = per_key_chunked_and_recurrent(
        seed,
        tokens,
        chunk_size,
        gates,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        mask_kind=mask_kind,
        scale=scale,
    )
    assert set(chunked) == {"q", "k", "v", "g", "gamma", "beta", "state"}
    assert chunked["g"].shape == recurrent["g"].shape
    assert_chunked_matches(chunked, recurrent)


def without_key_gram_terms(original):
    """kkt_inverse_backward (per key) broken: the decayed gram's terms dropped."""

    def stage(*args):
        dk, dbeta, d_log = original(*args)
        return dk, dbeta, np.zeros_like(d_log)

    return stage


def channels_lumped(original):
    """gate_cumsum_backward (per key) broken: every channel's decay terms
    given their mean."""

    def stage(*args):
        *terms, g_rows = args
        lumped = [np.broadcast_to(x.mean(axis=-1, keepdims=True), x.shape) for x in terms]
        return original(*lumped, g_rows)

    return stage


def without_entry_terms(original):
    """chunk_carry_backward (per key) broken: the entry state's terms of the
    decays' gradient dropped."""

    def stage(*args):
        d_entry, dw, out = original(*args)
        return d_entry, dw, dict(out, entry=np.zeros_like(out["entry"]))

    return stage


@pytest.mark.parametrize(
    "stage, breaking, gates",
    (
        ("key_gate_cumsum_backward", channels_lumped, "weak"),
        ("key_kkt_inverse_backward", without_key_gram_terms, "weak"),
        ("key_chunk_carry_backward", without_entry_terms, "wipes"),
    ),
)
def test_the_per_key_chunked_check_sees_a_broken_stage(monkeypatch, stage, breaking, gates):
    backward = reference.chunked_backward_per_key
    monkeypatch.setattr(backward, stage, breaking(getattr(backward, stage)))
    chunked, recurrent = per_key_chunked_and_recurrent(5, 30, 8, gates)
    with pytest.raises(AssertionError, match="dg|dgamma"):
        assert_chunked_matches(chunked, recurrent)
