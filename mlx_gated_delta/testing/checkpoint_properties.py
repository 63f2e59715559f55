"""Property tests of state checkpoints (docs/contract.md, "Checkpoints"):
the states `gated_delta_rule(..., checkpoints=...)` and
`gated_delta_segment(..., checkpoints=...)` return equal the final states of
calls over the same prefixes, masks included; y and the state are those of
the call without checkpoints.

Run by the repository's suite (`tests/test_checkpoint_properties.py`) and by
`python -m mlx_gated_delta selftest`, on the default device.
"""

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.properties import (
    ALGORITHMS,
    SPLIT_CONTRACTS,
    SPLIT_DTYPES,
    assert_bitwise_equal,
)
from mlx_gated_delta.testing.segment_cases import segment_cases
from mlx_gated_delta.testing.strategies import core_cases


def checkpoint_positions(tokens):
    """A strictly increasing, non-empty draw from 1..tokens."""
    return st.lists(st.integers(1, tokens), min_size=1, max_size=6, unique=True).map(sorted)


def prefix(x, stop):
    return None if x is None else x[:, :stop]


def assert_state_matches(algorithm, name, actual, expected):
    # The recurrent form copies the state it carries: exactly the prefix
    # call's. The chunked form cuts a chunk's update at the checkpoint: the
    # same math as a call split there, held to the split contract.
    if algorithm == "recurrent":
        assert_bitwise_equal(name, actual, expected)
    else:
        assert_matches(name, actual, expected, *SPLIT_CONTRACTS["chunked"][1])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases(dtypes=("float32",), tokens=st.integers(1, 140)), data=st.data())
def test_checkpoint_states_equal_prefix_final_states(algorithm, case, data):
    tokens = case.q.shape[1]
    positions = data.draw(checkpoint_positions(tokens), label="checkpoints")
    y, state, checkpoint_states = gated_delta_rule(
        *case.args(), algorithm=algorithm, checkpoints=positions, **case.options)
    plain_y, plain_state = gated_delta_rule(*case.args(), algorithm=algorithm, **case.options)
    mx.eval(y, state, checkpoint_states, plain_y, plain_state)
    assert_bitwise_equal("y", y, plain_y)
    assert_bitwise_equal("state", state, plain_state)
    assert checkpoint_states.shape == (len(positions), *state.shape)
    for n, position in enumerate(positions):
        args = [prefix(x, position) for x in case.args()[:5]]
        options = {**case.options, "mask": prefix(case.options["mask"], position)}
        _, prefix_state = gated_delta_rule(*args, case.state, algorithm=algorithm, **options)
        assert_state_matches(algorithm, f"checkpoint {position}", checkpoint_states[n],
                             prefix_state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=segment_cases(dtypes=SPLIT_DTYPES["chunked"], tokens=st.integers(1, 140)),
       data=st.data())
def test_segment_checkpoints_equal_prefix_calls(algorithm, case, data):
    tokens = case.mixed.shape[1]
    positions = data.draw(checkpoint_positions(tokens), label="checkpoints")
    out, conv_state, state, conv_checkpoints, checkpoints = gated_delta_segment(
        *case.args(), algorithm=algorithm, checkpoints=positions, **case.options)
    plain = gated_delta_segment(*case.args(), algorithm=algorithm, **case.options)
    mx.eval(out, conv_state, state, conv_checkpoints, checkpoints, *plain)
    for name, actual, expected in zip(("out", "conv_state", "state"),
                                      (out, conv_state, state), plain):
        assert_bitwise_equal(name, actual, expected)
    for n, position in enumerate(positions):
        options = {**case.options, "mask": prefix(case.options["mask"], position)}
        _, prefix_conv_state, prefix_state = gated_delta_segment(
            prefix(case.mixed, position), *case.args()[1:], algorithm=algorithm, **options)
        # The conv state is a copy of input rows: exact on every path.
        assert_bitwise_equal(f"conv checkpoint {position}", conv_checkpoints[n],
                             prefix_conv_state)
        assert_state_matches(algorithm, f"checkpoint {position}", checkpoints[n],
                             prefix_state)
