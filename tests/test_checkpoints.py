"""Checkpoints of the core op and the segment (docs/contract.md,
"Checkpoints"): the argument checks, the shapes at the edges, vmap. The
equality with prefix calls is a property (mlx_gated_delta/tests/test_checkpoints.py)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.testing.strategies import make_core_case


def core_case(tokens=10, batch=2):
    return make_core_case(
        3,
        batch=batch,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        dtype="float32",
        gate_dtype="float32",
        decay="model",
        beta_max=1.0,
        with_state=True,
        mask_kind="random",
        normalize_qk=True,
    )


@pytest.mark.parametrize(
    "checkpoints, error, words",
    [
        ([3, 3], ValueError, "strictly increasing"),
        ([5, 2], ValueError, "strictly increasing"),
        ([0, 4], ValueError, "[1, T]"),
        ([11], ValueError, "[1, T]"),
        ([-1], ValueError, "[1, T]"),
        ([1.0, 2.0], TypeError, "ints"),
        ([True], TypeError, "ints"),
        ("1,2", TypeError, "list of ints"),
        (3, TypeError, "list of ints"),
        (mx.array([1.0, 2.0]), TypeError, "integers"),
        (mx.array([[1, 2]]), ValueError, "1-D"),
        (mx.array([4, 2]), ValueError, "strictly increasing"),
    ],
)
def test_bad_checkpoints_are_refused_naming_them(checkpoints, error, words):
    case = core_case()
    with pytest.raises(error, match="checkpoints") as raised:
        gated_delta_rule(*case.args(), checkpoints=checkpoints, **case.options)
    assert words in str(raised.value)


def test_segment_refuses_bad_checkpoints_naming_them():
    case = make_segment_case(
        1, batch=1, tokens=6, key_heads=1, value_heads=1, key_dim=8, value_dim=8
    )
    with pytest.raises(ValueError, match="checkpoints must lie in"):
        gated_delta_segment(*case.args(), checkpoints=[7], **case.options)


@pytest.mark.parametrize("algorithm", ["recurrent", "chunked"])
def test_an_integer_array_works_like_a_list(algorithm):
    case = core_case(tokens=70)
    from_list = gated_delta_rule(
        *case.args(), algorithm=algorithm, checkpoints=[2, 64, 70], **case.options
    )[2]
    from_array = gated_delta_rule(
        *case.args(),
        algorithm=algorithm,
        checkpoints=mx.array([2, 64, 70], dtype=mx.uint16),
        **case.options,
    )[2]
    assert mx.array_equal(from_list, from_array).item()


def test_no_checkpoints_and_no_tokens_give_empty_stacks():
    case = core_case()
    _, state, empty = gated_delta_rule(*case.args(), checkpoints=[], **case.options)
    assert empty.shape == (0, *state.shape) and empty.dtype == mx.float32
    zero = core_case(tokens=0)
    _, state, empty = gated_delta_rule(*zero.args(), checkpoints=[], **zero.options)
    assert empty.shape == (0, *state.shape)
    assert mx.array_equal(state, zero.state).item()
    with pytest.raises(ValueError, match="checkpoints"):
        gated_delta_rule(*zero.args(), checkpoints=[1], **zero.options)


def test_a_checkpoint_at_the_end_is_the_final_state():
    case = core_case(tokens=70)
    for algorithm in ("recurrent", "chunked"):
        _, state, checkpoints = gated_delta_rule(
            *case.args(), algorithm=algorithm, checkpoints=[70], **case.options
        )
        assert mx.array_equal(checkpoints[0], state).item(), algorithm


def test_vmap_maps_the_batch_of_checkpoint_states():
    case = core_case(batch=3)
    q, k, v, g, beta, state = case.args()
    options = {key: value for key, value in case.options.items() if key != "mask"}

    def call(q, k, v, g, beta, state):
        return gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            state[None],
            checkpoints=[4, 9],
            **options,
        )[2][:, 0]

    mapped = mx.vmap(call, out_axes=1)(q, k, v, g, beta, state)
    direct = gated_delta_rule(q, k, v, g, beta, state, checkpoints=[4, 9], **options)[2]
    np.testing.assert_array_equal(np.array(mapped), np.array(direct))


def test_masked_tokens_count_as_positions_and_keep_the_state():
    case = core_case(tokens=8, batch=1)
    mask = mx.array([[True, True, False, False, True, True, True, True]])
    options = {**case.options, "mask": mask}
    for algorithm in ("recurrent", "chunked"):
        _, _, checkpoints = gated_delta_rule(
            *case.args(), algorithm=algorithm, checkpoints=[2, 3, 4], **options
        )
        # Tokens 3 and 4 are masked: the state after 2, 3 and 4 tokens is one state.
        assert mx.array_equal(checkpoints[0], checkpoints[1]).item(), algorithm
        assert mx.array_equal(checkpoints[0], checkpoints[2]).item(), algorithm


@pytest.mark.parametrize(
    "parents, error, words",
    [
        ([-1, 0, 2, 1, 0, 0, 0, 0, 0, 0], ValueError, "parents[2] must lie in [-1, 1]"),
        ([-2] + [0] * 9, ValueError, "parents[0] must lie in [-1, -1]"),
        ([-1, 0], ValueError, "one parent index per token"),
        ([-1] + [0.0] * 9, TypeError, "ints"),
        (mx.array([-1.0] * 10), TypeError, "integers"),
    ],
)
def test_bad_parents_are_refused_naming_them(parents, error, words):
    case = core_case()
    with pytest.raises(error, match="parents") as raised:
        gated_delta_rule(*case.args(), parents=parents, **case.options)
    assert words in str(raised.value)


def test_a_tree_runs_the_recurrent_form_only():
    case = core_case()
    with pytest.raises(ValueError, match="parents .*recurrent"):
        gated_delta_rule(*case.args(), parents=[-1] * 10, algorithm="chunked", **case.options)
    # "auto" picks the recurrent form for a tree, however long.
    long = core_case(tokens=70)
    chain = list(range(-1, 69))
    tree_y = gated_delta_rule(*long.args(), parents=chain, **long.options)[0]
    recurrent_y = gated_delta_rule(*long.args(), algorithm="recurrent", **long.options)[0]
    assert mx.array_equal(tree_y, recurrent_y).item()
