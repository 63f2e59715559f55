"""Compares the GPU's results (run_cuda.py's results.npz) with the float64
oracle under the core op's numerical contracts, and the segment's under the
segment's (the registry's current ones).

Usage: python tools/cuda_check/compare.py RESULTS.npz
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import CASES, SEGMENT_CASES, make_case  # noqa: E402

from mlx_gated_delta.testing import metal_emulated  # noqa: E402
from mlx_gated_delta.testing.contracts import CONTRACTS, assert_matches  # noqa: E402
from mlx_gated_delta.testing.properties import (  # noqa: E402
    ORACLE_OUTPUT_CONTRACTS,
    ORACLE_STATE_CONTRACTS,
)


def compare_segment(name, results):
    """Checks one segment case; returns a line to print."""
    _, case = make_case(name)
    dtype = case.recipe["dtype"]
    expected = dict(zip(("out", "conv_state_out", "state_out"), case.reference()))
    contracts = {
        "out": f"segment.oracle.v2.{dtype}.output",
        "conv_state_out": "segment.oracle.v1.any.conv_state",
        "state_out": "segment.oracle.v2.float32.state",
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
            buffer, actual, expected[buffer], contract_id, CONTRACTS[contract_id].fingerprint
        )
        errors.append(f"{buffer} {error:.2e} (<= {CONTRACTS[contract_id].threshold:g})")
    return f"{name:36s} " + ", ".join(errors)


def main(path):
    results = np.load(path)
    failures = 0
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
        output_id, output_print = ORACLE_OUTPUT_CONTRACTS[algorithm, dtype]
        state_id, state_print = ORACLE_STATE_CONTRACTS[algorithm]
        try:
            error_y = assert_matches("y", y, expected_y, output_id, output_print)
            error_state = assert_matches("state", state, expected_state, state_id, state_print)
            print(
                f"{name:32s} y max_rel {error_y:.2e} (<= {CONTRACTS[output_id].threshold:g}), "
                f"state max_rel {error_state:.2e} (<= {CONTRACTS[state_id].threshold:g})"
            )
        except AssertionError as error:
            print(f"{name}: FAILED {error}")
            failures += 1
    print(f"{len(CASES) + len(SEGMENT_CASES) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
