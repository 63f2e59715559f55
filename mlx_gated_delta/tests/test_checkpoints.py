"""Property tests of state checkpoints and tree verification
(docs/contract.md, "Checkpoints", "Tree verification"): the states
`gated_delta_rule(..., checkpoints=...)` and
`gated_delta_segment(..., checkpoints=...)` return equal the final states of
calls over the same prefixes, masks included, and y and the state are those
of the call without checkpoints; a tree of tokens (`parents=...`) gives every
token the output and state of the sequential call along its path.

Run by the repository's `pytest` and by `python -m mlx_gated_delta selftest`, on the
default device.
"""

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.segment_cases import segment_cases, segment_terms
from mlx_gated_delta.testing.strategies import core_cases
from mlx_gated_delta.tests.test_core import (
    ALGORITHMS,
    SPLIT_CONTRACTS,
    SPLIT_DTYPES,
    assert_bitwise_equal,
)

SEGMENT_SPLIT_STATE = "segment.chunked_split.v3.float32.state"


def checkpoint_positions(tokens):
    """A strictly increasing, non-empty draw from 1..tokens."""
    return st.lists(st.integers(1, tokens), min_size=1, max_size=6, unique=True).map(sorted)


def prefix(x, stop):
    return None if x is None else x[:, :stop]


def assert_state_matches(algorithm, name, actual, expected, split_contract, terms=None):
    # The recurrent form copies the state it carries: exactly the prefix
    # call's. The chunked form cuts a chunk's update at the checkpoint: the
    # same math as a call split there, held to the split contract.
    if algorithm == "recurrent":
        assert_bitwise_equal(name, actual, expected)
    else:
        assert_matches(name, actual, expected, split_contract, terms=terms)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases(dtypes=("float32",), tokens=st.integers(1, 140)), data=st.data())
def test_checkpoint_states_equal_prefix_final_states(algorithm, case, data):
    check_checkpoints_against_prefixes(algorithm, case, data)


# Per-key-channel gates: the recurrent form copies its state as with one gate
# per head, the chunked form cuts each channel's decays at the checkpoint.
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(
    case=core_cases(dtypes=("float32",), tokens=st.integers(1, 140), per_key_gates=True),
    data=st.data(),
)
def test_per_key_checkpoint_states_equal_prefix_final_states(algorithm, case, data):
    check_checkpoints_against_prefixes(algorithm, case, data)


def check_checkpoints_against_prefixes(algorithm, case, data):
    tokens = case.q.shape[1]
    positions = data.draw(checkpoint_positions(tokens), label="checkpoints")
    y, state, checkpoint_states = gated_delta_rule(
        *case.args(), algorithm=algorithm, checkpoints=positions, **case.options
    )
    plain_y, plain_state = gated_delta_rule(*case.args(), algorithm=algorithm, **case.options)
    mx.eval(y, state, checkpoint_states, plain_y, plain_state)
    assert_bitwise_equal("y", y, plain_y)
    assert_bitwise_equal("state", state, plain_state)
    assert checkpoint_states.shape == (len(positions), *state.shape)
    # The prefix call's chunks are the whole call's, its last one cut short:
    # the whole call's terms bound both (`CoreCase.terms`).
    _, state_terms = case.terms("chunked")
    for n, position in enumerate(positions):
        args = [prefix(x, position) for x in case.args()[:5]]
        options = {**case.options, "mask": prefix(case.options["mask"], position)}
        _, prefix_state = gated_delta_rule(*args, case.state, algorithm=algorithm, **options)
        assert_state_matches(
            algorithm,
            f"checkpoint {position}",
            checkpoint_states[n],
            prefix_state,
            SPLIT_CONTRACTS["chunked"][1],
            terms=state_terms[:, position],
        )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(
    case=segment_cases(dtypes=SPLIT_DTYPES["chunked"], tokens=st.integers(1, 140)), data=st.data()
)
def test_segment_checkpoints_equal_prefix_calls(algorithm, case, data):
    tokens = case.mixed.shape[1]
    positions = data.draw(checkpoint_positions(tokens), label="checkpoints")
    out, conv_state, state, conv_checkpoints, checkpoints = gated_delta_segment(
        *case.args(), algorithm=algorithm, checkpoints=positions, **case.options
    )
    plain = gated_delta_segment(*case.args(), algorithm=algorithm, **case.options)
    mx.eval(out, conv_state, state, conv_checkpoints, checkpoints, *plain)
    for name, actual, expected in zip(
        ("out", "conv_state", "state"), (out, conv_state, state), plain
    ):
        assert_bitwise_equal(name, actual, expected)
    for n, position in enumerate(positions):
        options = {**case.options, "mask": prefix(case.options["mask"], position)}
        _, prefix_conv_state, prefix_state = gated_delta_segment(
            prefix(case.mixed, position), *case.args()[1:], algorithm=algorithm, **options
        )
        # The conv state is a copy of input rows: exact on every path.
        assert_bitwise_equal(f"conv checkpoint {position}", conv_checkpoints[n], prefix_conv_state)
        # The prefix call's chunks are the whole call's up to the checkpoint.
        terms = (
            None
            if algorithm == "recurrent"
            else segment_terms(
                prefix(case.mixed, position), *case.args()[1:], algorithm="chunked", **options
            )[1]
        )
        assert_state_matches(
            algorithm,
            f"checkpoint {position}",
            checkpoints[n],
            prefix_state,
            SEGMENT_SPLIT_STATE,
            terms,
        )


@st.composite
def trees(draw, tokens):
    """One parent per token: -1 (the call's initial state) or an earlier token."""
    return [draw(st.integers(-1, t - 1)) for t in range(tokens)]


def path_to(parents, token):
    """The tokens from a root to `token`, in order."""
    path = []
    while token >= 0:
        path.append(token)
        token = parents[token]
    return path[::-1]


@given(case=core_cases(tokens=st.integers(1, 24), several_chunks=False), data=st.data())
def test_a_tree_equals_its_paths(case, data):
    check_tree_against_paths(case, data)


# Per-key-channel gates step each token recurrently as well.
@given(
    case=core_cases(tokens=st.integers(1, 24), per_key_gates=True, several_chunks=False),
    data=st.data(),
)
def test_a_per_key_tree_equals_its_paths(case, data):
    check_tree_against_paths(case, data)


def check_tree_against_paths(case, data):
    tokens = case.q.shape[1]
    parents = data.draw(trees(tokens), label="parents")
    positions = list(range(1, tokens + 1))
    y, state, node_states = gated_delta_rule(
        *case.args(), parents=parents, checkpoints=positions, **case.options
    )
    mx.eval(y, state, node_states)
    # The returned state is the last token's.
    assert_bitwise_equal("state", state, node_states[-1])
    for token in range(tokens):
        path = mx.array(path_to(parents, token))
        args = [x[:, path] for x in case.args()[:5]]
        mask = case.options["mask"]
        options = {**case.options, "mask": None if mask is None else mask[:, path]}
        path_y, path_state = gated_delta_rule(*args, case.state, algorithm="recurrent", **options)
        # The same steps from the same states: exactly the sequential call.
        assert_bitwise_equal(f"y of token {token}", y[:, token], path_y[:, -1])
        assert_bitwise_equal(f"state of token {token}", node_states[token], path_state)
