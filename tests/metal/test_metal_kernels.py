"""The Metal kernels, run by the emulator over the same dispatch plans macOS
encodes, against the float64 oracle under the core op's numerical contracts.

Every kernel path is reached on small shapes: the recurrent SIMD kernel
(Dk in 32, 64, 96, 128) and the generic one (Dk 16, 80), and every stage of the
chunked pipeline with and without the Dk == 128 shared k_gram; both head
mappings, masks, normalize_qk, the three activation dtypes, and token counts
on both sides of chunk boundaries.
"""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import core_cases, make_core_case
from mlx_gated_delta.tests import test_core

import metal_emulated

# The reviewed (id, fingerprint) pairs of the core op's contracts: the Metal
# kernels compute the same op, so they are held to the same contracts.
OUTPUT_CONTRACTS = test_core.ORACLE_OUTPUT_CONTRACTS
STATE_CONTRACTS = test_core.ORACLE_STATE_CONTRACTS
SPLIT_CONTRACTS = test_core.SPLIT_CONTRACTS
CHUNKED_VS_RECURRENT = test_core.ALGORITHMS_AGREE_CONTRACTS

# (algorithm, the kernel the case must reach, make_core_case arguments).
ORACLE_CASES = [
    (
        "recurrent",
        "recurrent_simd",
        dict(batch=1, tokens=7, key_heads=1, value_heads=2, key_dim=32, value_dim=16),
    ),
    (
        "recurrent",
        "recurrent_simd",
        dict(
            batch=2,
            tokens=9,
            key_heads=2,
            value_heads=4,
            key_dim=64,
            value_dim=32,
            dtype="float16",
            mask_kind="random",
            normalize_qk=True,
            head_mapping="interleaved",
        ),
    ),
    (
        "recurrent",
        "recurrent_simd",
        dict(
            batch=2,
            tokens=5,
            key_heads=1,
            value_heads=2,
            key_dim=96,
            value_dim=16,
            dtype="bfloat16",
            mask_kind="left_padding",
        ),
    ),
    (
        "recurrent",
        "recurrent_simd",
        dict(
            batch=1,
            tokens=3,
            key_heads=1,
            value_heads=2,
            key_dim=128,
            value_dim=8,
            decay="strong",
            scale=0.5,
        ),
    ),
    (
        "recurrent",
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
        ),
    ),
    (
        "recurrent",
        "recurrent_generic",
        dict(
            batch=1,
            tokens=4,
            key_heads=2,
            value_heads=4,
            key_dim=16,
            value_dim=80,
            dtype="bfloat16",
            head_mapping="interleaved",
            with_state=False,
        ),
    ),
    (
        "chunked",
        "chunk_carry",
        dict(
            batch=1,
            tokens=65,
            key_heads=2,
            value_heads=4,
            key_dim=32,
            value_dim=16,
            mask_kind="random",
        ),
    ),
    (
        "chunked",
        "qk_norm",
        dict(
            batch=2,
            tokens=130,
            key_heads=1,
            value_heads=2,
            key_dim=64,
            value_dim=16,
            dtype="bfloat16",
            normalize_qk=True,
            head_mapping="interleaved",
        ),
    ),
    (
        "chunked",
        "chunk_output",
        dict(
            batch=1,
            tokens=64,
            key_heads=1,
            value_heads=1,
            key_dim=96,
            value_dim=32,
            dtype="float16",
            mask_kind="left_padding",
        ),
    ),
    (
        "chunked",
        "chunk_output",
        dict(batch=1, tokens=1, key_heads=1, value_heads=2, key_dim=80, value_dim=16),
    ),
    (
        "chunked",
        "k_gram",
        dict(
            batch=1,
            tokens=129,
            key_heads=1,
            value_heads=2,
            key_dim=128,
            value_dim=16,
            normalize_qk=True,
            head_mapping="interleaved",
        ),
    ),
    (
        "chunked",
        "k_gram",
        dict(
            batch=1,
            tokens=70,
            key_heads=1,
            value_heads=2,
            key_dim=128,
            value_dim=8,
            dtype="bfloat16",
            mask_kind="random",
        ),
    ),
    (
        "chunked",
        "kkt_inverse_float32",
        dict(batch=1, tokens=70, key_heads=2, value_heads=2, key_dim=128, value_dim=8),
    ),
    (
        "chunked",
        "chunk_qk",
        dict(
            batch=1,
            tokens=127,
            key_heads=1,
            value_heads=1,
            key_dim=16,
            value_dim=80,
            decay="strong",
        ),
    ),
    (
        "chunked",
        "recompute_w_u",
        dict(
            batch=1,
            tokens=63,
            key_heads=1,
            value_heads=4,
            key_dim=32,
            value_dim=16,
            decay="none",
            scale=0.5,
            normalize_qk=True,
        ),
    ),
]


def dtype_of(case):
    return str(case.v.dtype).rsplit(".", 1)[-1]


def emulate(case, algorithm, **overrides):
    options = {**case.options, **overrides}
    return metal_emulated.run(*case.args(), algorithm=algorithm, **options)


@pytest.mark.parametrize(
    "algorithm, kernel, recipe",
    ORACLE_CASES,
    ids=[f"{a}-{k}-{i}" for i, (a, k, _) in enumerate(ORACLE_CASES)],
)
def test_every_kernel_path_matches_the_float64_oracle(algorithm, kernel, recipe):
    case = make_core_case(len(recipe) * 7 + recipe["tokens"], **recipe)
    y, state, info = emulate(case, algorithm)
    assert info["algorithm"] == algorithm
    assert any(kernel in name for name in info["kernels"]), info["kernels"]
    test_core.assert_matches_oracle(case, y, state, algorithm)


@pytest.mark.parametrize("algorithm", ("recurrent", "chunked"))
def test_a_zero_decay_wipes_the_state_exactly(algorithm):
    # gamma == 0 arrives as g = -inf: the state before it is gone, no NaN, and
    # the chunked form never subtracts two infinite cumsums.
    case = make_core_case(
        5, batch=1, tokens=100, key_heads=1, value_heads=2, key_dim=32, value_dim=16
    )
    g = np.array(case.g)
    g[0, [0, 10, 11, 64, 99], 0] = -np.inf
    g[0, 40, 1] = -np.inf
    case = dataclasses.replace(case, g=mx.array(g))
    y, state, _ = emulate(case, algorithm)
    assert np.isfinite(y).all() and np.isfinite(state).all()
    test_core.assert_matches_oracle(case, y, state, algorithm)


def test_chunked_matches_recurrent():
    case = make_core_case(
        11,
        batch=1,
        tokens=100,
        key_heads=2,
        value_heads=4,
        key_dim=32,
        value_dim=16,
        mask_kind="random",
        head_mapping="interleaved",
    )
    recurrent_y, recurrent_state, _ = emulate(case, "recurrent")
    chunked_y, chunked_state, _ = emulate(case, "chunked")
    output_terms, state_terms = test_core.oracle_terms(case, "chunked")
    output_contract, state_contract = CHUNKED_VS_RECURRENT
    assert_matches("y", chunked_y, recurrent_y, output_contract, terms=output_terms)
    assert_matches("state", chunked_state, recurrent_state, state_contract, terms=state_terms)


@pytest.mark.parametrize(
    "algorithm, points, tokens", [("recurrent", (0, 3, 3, 20), 40), ("chunked", (50, 64, 129), 140)]
)
def test_split_continuity_any_split_points(algorithm, points, tokens):
    case = make_core_case(
        13,
        batch=1,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=16,
        mask_kind="random",
    )
    whole_y, whole_state, _ = emulate(case, algorithm)
    mask = np.array(case.options["mask"])
    pieces, state = [], case.state
    bounds = (0, *points, tokens)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        part = [x[:, start:stop] for x in (case.q, case.k, case.v, case.g, case.beta)]
        y, state, _ = metal_emulated.run(
            *part, state, scale=case.options["scale"], mask=mask[:, start:stop], algorithm=algorithm
        )
        pieces.append(y)
    output_terms, state_terms = test_core.split_terms(case, bounds, algorithm)
    output_contract, state_contract = SPLIT_CONTRACTS[algorithm]
    y = np.concatenate(pieces, axis=1)
    assert_matches("y", y, whole_y, output_contract, terms=output_terms)
    assert_matches("state", state, whole_state, state_contract, terms=state_terms)


@pytest.mark.parametrize("algorithm", ("recurrent", "chunked"))
def test_zero_tokens_return_empty_output_and_the_state_unchanged(algorithm):
    case = make_core_case(
        17, batch=2, tokens=0, key_heads=1, value_heads=2, key_dim=32, value_dim=16
    )
    y, state, _ = emulate(case, algorithm)
    assert y.shape == (2, 0, 2, 16)
    assert np.array_equal(state, np.array(case.state))


def test_bfloat16_rounding_matches_mlx():
    values = np.random.default_rng(3).standard_normal(1000).astype(np.float32) * 100
    expected = np.array(mx.array(values).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(metal_emulated.round_to_bfloat16(values), expected)


# The core op's Hypothesis strategy over the emulated kernels, on a small
# budget: every emulated call runs one OS thread per GPU thread.
@pytest.mark.parametrize("algorithm", ("recurrent", "chunked"))
@settings(max_examples=6)
@given(
    case=core_cases(max_batch=1, tokens=st.sampled_from((1, 2, 63, 65, 100)), several_chunks=False)
)
def test_drawn_cases_match_the_float64_oracle(algorithm, case):
    y, state, _ = emulate(case, algorithm)
    test_core.assert_matches_oracle(case, y, state, algorithm)
