"""Compares the GPU's results (run_cuda.py's results.npz) with the float64
oracle under the core op's numerical contracts, and the segment's under the
segment's (the registry's current ones).

Usage: python tools/cuda_check/compare.py RESULTS.npz
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# metal_emulated.py lives beside the emulator's tests, outside the package.
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "metal"))
from cases import (  # noqa: E402
    BACKWARD_CASES,
    CASES,
    CHECKPOINT_CASES,
    SEGMENT_CASES,
    backward_cotangents,
    make_case,
)

from mlx_gated_delta.reference import gated_delta_rule_reference_vjp  # noqa: E402
from mlx_gated_delta.testing.contracts import CONTRACTS, assert_matches  # noqa: E402
from mlx_gated_delta.tests.test_core import (  # noqa: E402
    ORACLE_OUTPUT_CONTRACTS,
    ORACLE_STATE_CONTRACTS,
    oracle_terms,
)

import metal_emulated  # noqa: E402


def compare_segment(name, results):
    """Checks one segment case; returns a line to print."""
    algorithm, case = make_case(name)
    dtype = case.recipe["dtype"]
    expected = dict(zip(("out", "conv_state_out", "state_out"), case.reference()))
    terms = dict(zip(("out", "state_out"), case.terms(algorithm)))
    contracts = {
        "out": f"segment.oracle.v3.{dtype}.output",
        "conv_state_out": "segment.oracle.v1.any.conv_state",
        "state_out": "segment.oracle.v3.float32.state",
    }
    errors = []
    for buffer, contract_id in contracts.items():
        raw = results[f"{name}/{buffer}"].tobytes()
        if buffer == "state_out":
            actual = np.frombuffer(raw, np.float32)
        else:
            actual = metal_emulated._activation_values(raw, dtype)
        actual = actual.reshape(expected[buffer].shape)
        error = assert_matches(
            buffer,
            actual,
            expected[buffer],
            contract_id,
            terms=terms.get(buffer),
        )
        errors.append(f"{buffer} {error:.2e} (<= {CONTRACTS[contract_id].threshold:g})")
    return f"{name:36s} " + ", ".join(errors)


# Checkpoint and tree cases against the CPU op on the same inputs: float32
# states summed in other orders agree to rounding, relative to their size.
CHECKPOINT_RELATIVE_TOLERANCE = 2e-5


def compare_checkpoints(name, results):
    """Checks one checkpoint or tree case against the CPU op; returns a line."""
    import mlx.core as mx

    from mlx_gated_delta import gated_delta_rule, gated_delta_segment

    source, checkpoints, parents = CHECKPOINT_CASES[name]
    algorithm, case = make_case(name)
    dtype = case.recipe["dtype"]
    if source in SEGMENT_CASES:
        outputs = gated_delta_segment(
            *case.args(),
            algorithm=algorithm,
            stream=mx.cpu,
            checkpoints=checkpoints,
            **case.options,
        )
        # Conv states are copies of input rows: exact.
        conv = metal_emulated._activation_values(
            results[f"{name}/conv_checkpoint_states"].tobytes(), dtype
        )
        expected_conv = np.array(outputs[3].astype(mx.float32))
        if not np.array_equal(conv.reshape(expected_conv.shape), expected_conv):
            raise AssertionError("conv_checkpoint_states differ")
        expected = {"checkpoint_states": outputs[4], "state_out": outputs[2]}
    else:
        y, state, states = gated_delta_rule(
            *case.args(),
            algorithm=algorithm,
            stream=mx.cpu,
            checkpoints=checkpoints,
            parents=parents,
            **case.options,
        )
        expected = {"checkpoint_states": states, "state_out": state}
    errors = []
    for buffer, value in expected.items():
        value = np.array(value)
        actual = np.frombuffer(results[f"{name}/{buffer}"].tobytes(), np.float32)
        error = float(np.abs(actual.reshape(value.shape) - value).max() / np.abs(value).max())
        if error > CHECKPOINT_RELATIVE_TOLERANCE:
            raise AssertionError(f"{buffer}: relative error {error:.2e}")
        errors.append(f"{buffer} {error:.2e}")
    return f"{name:36s} against the CPU op: " + ", ".join(errors)


# The backward's gradients by plan buffer: (reference name, kind of contract).
BACKWARD_GRADIENTS = {
    "dq": ("q", "activation_grad"),
    "dk": ("k", "activation_grad"),
    "dv": ("v", "activation_grad"),
    "dg": ("g", "gate_grad"),
    "dgamma": ("gamma", "gate_grad"),
    "dbeta": ("beta", "gate_grad"),
    "dstate": ("state", "state_grad"),
}


def compare_backward(name, results):
    """Checks one backward case against the float64 reference vjp under the
    core gradient contracts; returns a line to print."""
    _, case = make_case(name)
    dtype = case.recipe["dtype"]
    y_cotangent, state_cotangent = backward_cotangents(case)
    expected = gated_delta_rule_reference_vjp(
        *case.args(),
        y_cotangent=y_cotangent,
        state_cotangent=state_cotangent,
        **case.options,
    )
    errors = []
    for buffer, (gradient, kind) in BACKWARD_GRADIENTS.items():
        raw = results[f"{name}/{buffer}"].tobytes()
        activation = kind == "activation_grad"
        actual = (
            metal_emulated._activation_values(raw, dtype)
            if activation
            else np.frombuffer(raw, np.float32)
        ).reshape(expected[gradient].shape)
        contract_id = f"core_grad.oracle.v1.{dtype if activation else 'float32'}.{kind}"
        error = assert_matches(
            buffer,
            actual,
            expected[gradient],
            contract_id,
        )
        errors.append(f"{buffer} {error:.1e} (<= {CONTRACTS[contract_id].threshold:g})")
    return f"{name:32s} norm_ratio " + ", ".join(errors)


def main(path):
    results = np.load(path)
    failures = 0
    for name in CHECKPOINT_CASES:
        if f"{name}/checkpoint_states" not in results.files:
            print(f"{name}: no result")
            failures += 1
            continue
        try:
            print(compare_checkpoints(name, results))
        except AssertionError as error:
            print(f"{name}: FAILED {error}")
            failures += 1
    for name in SEGMENT_CASES:
        if f"{name}/out" not in results.files:
            print(f"{name}: no result")
            failures += 1
            continue
        try:
            print(compare_segment(name, results))
        except AssertionError as error:
            print(f"{name}: FAILED {error}")
            failures += 1
    for name in CASES:
        algorithm, case = make_case(name)
        if f"{name}/y" not in results.files:
            print(f"{name}: no result")
            failures += 1
            continue
        dtype = case.recipe["dtype"]
        expected_y, expected_state = case.reference()
        y = metal_emulated._activation_values(results[f"{name}/y"].tobytes(), dtype)
        y = y.reshape(expected_y.shape)
        state = np.frombuffer(results[f"{name}/state_out"].tobytes(), np.float32)
        state = state.reshape(expected_state.shape)
        output_id = ORACLE_OUTPUT_CONTRACTS[algorithm, dtype]
        state_id = ORACLE_STATE_CONTRACTS[algorithm]
        output_terms, state_terms = oracle_terms(case, algorithm)
        try:
            error_y = assert_matches("y", y, expected_y, output_id, terms=output_terms)
            error_state = assert_matches(
                "state", state, expected_state, state_id, terms=state_terms
            )
            print(
                f"{name:32s} y max_rel {error_y:.2e} (<= {CONTRACTS[output_id].threshold:g}), "
                f"state max_rel {error_state:.2e} (<= {CONTRACTS[state_id].threshold:g})"
            )
        except AssertionError as error:
            print(f"{name}: FAILED {error}")
            failures += 1
    for name in BACKWARD_CASES:
        if f"{name}/dstate" not in results.files:
            print(f"{name}: no result")
            failures += 1
            continue
        try:
            print(compare_backward(name, results))
        except AssertionError as error:
            print(f"{name}: FAILED {error}")
            failures += 1
    total = len(CASES) + len(SEGMENT_CASES) + len(CHECKPOINT_CASES) + len(BACKWARD_CASES)
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
