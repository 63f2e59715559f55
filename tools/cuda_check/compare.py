"""Compares the GPU's results (run_cuda.py's results.npz) with the float64
oracle under the core op's numerical contracts.

Usage: python tools/cuda_check/compare.py RESULTS.npz
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import CASES, make_case  # noqa: E402

from mlx_gated_delta.testing import metal_emulated  # noqa: E402
from mlx_gated_delta.testing.contracts import CONTRACTS, assert_matches  # noqa: E402
from mlx_gated_delta.testing.properties import (  # noqa: E402
    ORACLE_OUTPUT_CONTRACTS,
    ORACLE_STATE_CONTRACTS,
)


def main(path):
    results = np.load(path)
    failures = 0
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
            print(f"{name:32s} y max_rel {error_y:.2e} (<= {CONTRACTS[output_id].threshold:g}), "
                  f"state max_rel {error_state:.2e} (<= {CONTRACTS[state_id].threshold:g})")
        except AssertionError as error:
            print(f"{name}: FAILED {error}")
            failures += 1
    print(f"{len(CASES) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
