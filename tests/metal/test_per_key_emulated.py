"""Per-key-channel gates (g [B, T, Hv, Dk]) on the Metal kernels, run by the
emulator over the plans macOS encodes, against the float64 oracle under the
core op's contracts, on the recurrent kernels (SIMD and generic), and what
`auto` picks: the algorithm it picks for scalar gates of the same shape. The
chunked stages' per-key form is tested in test_per_key_chunked_emulated.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_gated_delta.reference import gated_delta_rule_reference, to_float64
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import core_cases, make_core_case
from mlx_gated_delta.tests import test_core

import metal_emulated

OUTPUT_CONTRACTS = test_core.ORACLE_OUTPUT_CONTRACTS
STATE_CONTRACTS = test_core.ORACLE_STATE_CONTRACTS

# (the kernel the case must reach, make_core_case arguments); T past one chunk
# too, where `auto` would run the chunked stages.
CASES = [
    (
        "recurrent_simd",
        dict(batch=1, tokens=7, key_heads=1, value_heads=2, key_dim=32, value_dim=16),
    ),
    (
        "recurrent_simd",
        dict(
            batch=2,
            tokens=70,
            key_heads=2,
            value_heads=4,
            key_dim=64,
            value_dim=8,
            dtype="float16",
            mask_kind="random",
            normalize_qk=True,
            head_mapping="interleaved",
            decay="mixed",
            wipes="random",
        ),
    ),
    (
        "recurrent_simd",
        dict(
            batch=1,
            tokens=9,
            key_heads=1,
            value_heads=2,
            key_dim=96,
            value_dim=8,
            dtype="bfloat16",
            mask_kind="left_padding",
            wipes="runs",
        ),
    ),
    (
        "recurrent_simd",
        dict(
            batch=1,
            tokens=66,
            key_heads=1,
            value_heads=2,
            key_dim=128,
            value_dim=8,
            decay="severe",
            state_scale="huge",
            wipes="chunk_edges",
        ),
    ),
    (
        "recurrent_generic",
        dict(
            batch=2,
            tokens=6,
            key_heads=1,
            value_heads=2,
            key_dim=80,
            value_dim=16,
            normalize_qk=True,
            mask_kind="random",
            wipes="random",
        ),
    ),
    (
        "recurrent_generic",
        dict(
            batch=1,
            tokens=65,
            key_heads=2,
            value_heads=4,
            key_dim=16,
            value_dim=8,
            dtype="bfloat16",
            head_mapping="interleaved",
            with_state=False,
            decay="strong",
        ),
    ),
]


def dtype_of(case):
    return str(case.v.dtype).rsplit(".", 1)[-1]


@pytest.mark.parametrize(
    "kernel, recipe", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)]
)
def test_per_key_gates_on_the_recurrent_kernels_match_the_oracle(kernel, recipe):
    case = make_core_case(len(recipe) * 11 + recipe["tokens"], per_key_gates=True, **recipe)
    y, state, info = metal_emulated.run(*case.args(), algorithm="recurrent", **case.options)
    assert info["algorithm"] == "recurrent"
    assert any(kernel in name for name in info["kernels"]), info["kernels"]
    assert not np.isnan(y).any() and not np.isnan(state).any()
    test_core.assert_matches_oracle(case, y, state, "recurrent")


@settings(max_examples=8, deadline=None)
@given(case=core_cases(tokens=st.integers(1, 80), per_key_gates=True, several_chunks=False))
def test_auto_with_per_key_gates_matches_the_oracle_on_drawn_cases(case):
    y, state, info = metal_emulated.run(*case.args(), **case.options)
    test_core.assert_matches_oracle(case, y, state, info["algorithm"])


@pytest.mark.parametrize("tokens", (1, 64, 65, 130, 2048))
@pytest.mark.parametrize("key_dim", (16, 128, 256, 257))
def test_auto_picks_for_per_key_gates_what_it_picks_for_scalar_gates(tokens, key_dim):
    # The same crossover (resolve_metal_algorithm): the chunked stages from
    # T = 65 up to their widest key dim, the recurrent kernels otherwise.
    shape = dict(batch=1, tokens=tokens, key_heads=2, value_heads=4, key_dim=key_dim, value_dim=8)
    per_key = metal_emulated.plan(**shape, per_key_gates=True)["algorithm"]
    assert per_key == metal_emulated.plan(**shape)["algorithm"]
    chunked = tokens > metal_emulated.CHUNK_SIZE and key_dim <= 256
    assert per_key == ("chunked" if chunked else "recurrent")


def test_auto_keeps_trees_on_the_recurrent_kernels_with_per_key_gates():
    shape = dict(batch=1, tokens=130, key_heads=1, value_heads=2, key_dim=32, value_dim=8)
    assert metal_emulated.plan(**shape, per_key_gates=True, tree=True)["algorithm"] == "recurrent"


def test_the_check_sees_a_kernel_that_reads_one_decay_per_head():
    # Probe: the emulated per-key result differs, beyond the contract, from
    # the oracle of the same call whose gate is channel 0's for every column:
    # a kernel reading g once per head (mlx-lm#1792's bug) would fail here.
    case = make_core_case(
        3,
        batch=1,
        tokens=20,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        per_key_gates=True,
    )
    y, _, _ = metal_emulated.run(*case.args(), **case.options)
    g = to_float64(case.g)
    wrong, _ = gated_delta_rule_reference(
        case.q,
        case.k,
        case.v,
        np.repeat(g[..., :1], g.shape[-1], axis=-1),
        case.beta,
        case.state,
        **case.options,
    )
    output_terms, _ = test_core.oracle_terms(case, "recurrent")
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("y", y, wrong, OUTPUT_CONTRACTS["recurrent", "float32"], terms=output_terms)


def test_scalar_gates_still_take_the_chunked_stages():
    case = make_core_case(
        1, batch=1, tokens=70, key_heads=1, value_heads=1, key_dim=32, value_dim=8
    )
    _, _, info = metal_emulated.run(*case.args(), algorithm="auto", **case.options)
    assert info["algorithm"] == "chunked"


def test_per_key_gates_of_the_wrong_width_are_refused():
    case = make_core_case(
        1,
        batch=1,
        tokens=4,
        key_heads=1,
        value_heads=1,
        key_dim=32,
        value_dim=8,
        per_key_gates=True,
    )
    with pytest.raises(ValueError, match="g must be"):
        metal_emulated.run(case.q, case.k, case.v, case.g[..., :5], case.beta, case.state)
