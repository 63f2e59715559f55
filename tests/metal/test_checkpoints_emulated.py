"""Checkpoints on the Metal plans, run by the emulator: the recurrent kernels
(SIMD and generic) copy their rows of the state after each checkpoint's
token, chunk_carry cuts a chunk's update at a checkpoint inside it, and the
segment's collect_conv_checkpoints stage collects the conv states; for tree
verification the recurrent kernels start each token from its parent's kept
state. Each is
held to the CPU op's checkpoint states (themselves held to prefix calls by
mlx_gated_delta/tests/test_checkpoints.py), and y and the state to the plan
without checkpoints."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.testing.strategies import make_core_case

import metal_emulated

# Float32 state, float32 inputs: the Metal kernels and the CPU kernels sum in
# different orders, so they agree to rounding, relative to the state's size.
RELATIVE_TOLERANCE = 2e-5


def assert_close(name, actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    scale = max(float(np.abs(expected).max()), 1e-30)
    error = float(np.abs(actual - expected).max()) / scale
    assert error <= RELATIVE_TOLERANCE, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize(
    "algorithm, key_dim, tokens, positions",
    [
        ("recurrent", 32, 9, [1, 4, 5, 9]),  # the SIMD kernel
        ("recurrent", 24, 7, [2, 3, 7]),  # the generic kernel
        ("chunked", 16, 140, [1, 30, 64, 65, 128, 140]),
    ],
)
@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_checkpoint_states_match_the_cpu_op(algorithm, key_dim, tokens, positions, mask_kind):
    case = make_core_case(
        11,
        batch=2,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=key_dim,
        value_dim=8,
        dtype="float32",
        gate_dtype="float32",
        decay="model",
        beta_max=1.0,
        with_state=True,
        mask_kind=mask_kind,
        normalize_qk=True,
    )
    numpy_args = [np.array(x) for x in case.args()]
    mask = case.options["mask"]
    options = dict(
        scale=case.options["scale"],
        head_mapping=case.options["head_mapping"],
        normalize_qk=True,
        algorithm=algorithm,
        mask=None if mask is None else np.array(mask),
    )
    y, state, info = metal_emulated.run(*numpy_args, checkpoints=positions, **options)
    plain_y, plain_state, plain_info = metal_emulated.run(*numpy_args, **options)
    assert info["kernels"] == plain_info["kernels"]
    np.testing.assert_array_equal(y, plain_y)
    np.testing.assert_array_equal(state, plain_state)

    _, _, expected = gated_delta_rule(
        *case.args(), algorithm=algorithm, checkpoints=positions, stream=mx.cpu, **case.options
    )
    assert_close("checkpoint_states", info["checkpoint_states"], np.array(expected))
    # The last checkpoint at the end of the call is the plan's own final state.
    if positions[-1] == tokens:
        np.testing.assert_array_equal(info["checkpoint_states"][-1], state)


@pytest.mark.parametrize(
    "algorithm, tokens, positions",
    [
        ("recurrent", 6, [1, 2, 6]),
        ("chunked", 70, [3, 64, 70]),
    ],
)
def test_segment_checkpoints_match_the_cpu_op(algorithm, tokens, positions):
    case = make_segment_case(
        5,
        batch=2,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        conv_kernel=4,
        mask_kind="random",
    )
    args = [None if x is None else np.array(x) for x in case.args()]
    options = {**case.options, "mask": np.array(case.options["mask"])}
    out, conv_state, state, info = metal_emulated.run_segment(
        *args, algorithm=algorithm, checkpoints=positions, **options
    )
    assert "collect_conv_checkpoints" in " ".join(info["kernels"])
    plain = metal_emulated.run_segment(*args, algorithm=algorithm, **options)
    for name, actual, expected in zip(
        ("out", "conv_state", "state"), (out, conv_state, state), plain[:3]
    ):
        np.testing.assert_array_equal(actual, expected, err_msg=name)

    *_, conv_expected, expected = gated_delta_segment(
        *case.args(), algorithm=algorithm, checkpoints=positions, stream=mx.cpu, **case.options
    )
    # Conv states are copies of input rows: exact.
    np.testing.assert_array_equal(info["conv_checkpoint_states"], np.array(conv_expected))
    assert_close("checkpoint_states", info["checkpoint_states"], np.array(expected))


def test_plans_bind_checkpoints_only_when_asked():
    for algorithm, stage in (("recurrent", "recurrent"), ("chunked", "chunk_carry")):
        plan = metal_emulated.plan(2, 70, 1, 2, 32, 8, algorithm=algorithm)
        assert "checkpoints" not in plan["buffer_bytes"]
        bound = {
            name for d in plan["dispatches"] if d["stage"] == stage for _, name, _ in d["buffers"]
        }
        assert "checkpoint_states" not in bound


@pytest.mark.parametrize("key_dim", [32, 24])  # the SIMD and the generic kernel
@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_tree_verification_matches_the_cpu_op(key_dim, mask_kind):
    case = make_core_case(
        12,
        batch=2,
        tokens=9,
        key_heads=1,
        value_heads=2,
        key_dim=key_dim,
        value_dim=8,
        dtype="float32",
        gate_dtype="float32",
        decay="model",
        beta_max=1.0,
        with_state=True,
        mask_kind=mask_kind,
        normalize_qk=True,
    )
    parents = [-1, 0, 0, 1, -1, 4, 2, 6, 3]
    positions = list(range(1, 10))
    mask = case.options["mask"]
    y, state, info = metal_emulated.run(
        *[np.array(x) for x in case.args()],
        scale=case.options["scale"],
        head_mapping=case.options["head_mapping"],
        normalize_qk=True,
        algorithm="recurrent",
        mask=None if mask is None else np.array(mask),
        parents=parents,
        checkpoints=positions,
    )
    expected_y, expected_state, expected_nodes = gated_delta_rule(
        *case.args(), parents=parents, checkpoints=positions, stream=mx.cpu, **case.options
    )
    assert_close("y", y, np.array(expected_y))
    assert_close("state", state, np.array(expected_state))
    assert_close("node states", info["checkpoint_states"], np.array(expected_nodes))


@pytest.mark.parametrize("key_dim", [32, 24])  # the SIMD and the generic kernel
@pytest.mark.parametrize("tree", [False, True])
def test_per_key_gates_with_checkpoints_match_the_cpu_op(key_dim, tree):
    # Per-key gates: the recurrent kernels keep their tree states, and the
    # chunked stages their checkpoint cuts (chunk_carry), with a decay per
    # state column as with one per head; each against the CPU op's same form.
    case = make_core_case(
        13,
        batch=2,
        tokens=9,
        key_heads=1,
        value_heads=2,
        key_dim=key_dim,
        value_dim=8,
        dtype="float32",
        gate_dtype="float32",
        decay="model",
        beta_max=1.0,
        with_state=True,
        mask_kind="random",
        normalize_qk=True,
        per_key_gates=True,
    )
    assert case.g.shape == (2, 9, 2, key_dim)
    parents = [-1, 0, 0, 1, -1, 4, 2, 6, 3] if tree else None
    positions = [1, 4, 5, 9]
    y, state, info = metal_emulated.run(
        *[np.array(x) for x in case.args()],
        scale=case.options["scale"],
        head_mapping=case.options["head_mapping"],
        normalize_qk=True,
        algorithm="chunked" if not tree else "recurrent",
        mask=np.array(case.options["mask"]),
        parents=parents,
        checkpoints=positions,
    )
    algorithm = "chunked" if not tree else "recurrent"
    assert info["algorithm"] == algorithm
    expected_y, expected_state, expected_checkpoints = gated_delta_rule(
        *case.args(),
        parents=parents,
        checkpoints=positions,
        algorithm=algorithm,
        stream=mx.cpu,
        **case.options,
    )
    assert_close("y", y, np.array(expected_y))
    assert_close("state", state, np.array(expected_state))
    assert_close("checkpoint_states", info["checkpoint_states"], np.array(expected_checkpoints))
