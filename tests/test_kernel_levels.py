"""The compiled levels of the CPU kernels (docs/cpu.md): each level this CPU
runs, forced through MLX_GATED_DELTA_CPU_LEVEL in a subprocess, meets the
float64 oracle contracts of the op, its gradients, the segment and the
projection; the levels that fuse multiply-adds give bitwise equal results; and
the forced level is the one that runs (the baseline, which rounds a * b + c
twice, gives different bits).

A build for the host CPU alone (MLX_GATED_DELTA_NATIVE=ON) holds one level,
"native": the oracle test runs on it and the comparisons between levels skip.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_gated_delta import _ext

RUNNABLE = _ext.cpu_kernel_levels()
ROOT = Path(__file__).resolve().parent.parent
# The oracle properties each level must meet, at the `selftest` profile's
# budget (10 draws each): the full budget runs on the default level in the
# rest of the suite.
ORACLE_TESTS = (
    "mlx_gated_delta/tests/test_core.py::test_matches_the_float64_oracle",
    "mlx_gated_delta/tests/test_core.py::test_wipes_match_the_float64_oracle",
    "mlx_gated_delta/tests/test_per_key.py::test_per_key_gates_match_the_float64_oracle",
    "mlx_gated_delta/tests/test_core_gradients.py::test_gradients_match_the_float64_reference",
    "mlx_gated_delta/tests/test_per_key.py::test_per_key_gradients_match_the_float64_reference",
    "mlx_gated_delta/tests/test_segment.py::test_segment_matches_oracle",
    "tests/test_projection.py::test_dense_projection_matches_float64",
)
# Levels whose kernels write every a * b + c as one fused multiply-add.
FUSED_LEVELS = ("x86_64_v3", "x86_64_v4")


def run_at_level(level, code, *args):
    """Runs `code` (Python) with the kernels forced to `level`, at the
    selftest profile's Hypothesis budget; returns its stdout."""
    env = {
        **os.environ,
        "MLX_GATED_DELTA_CPU_LEVEL": level,
        "MLX_GATED_DELTA_HYPOTHESIS_PROFILE": "selftest",
    }
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_the_default_level_is_the_highest_this_cpu_runs():
    code = "from mlx_gated_delta import _ext; print(_ext.cpu_kernel_level())"
    env = {k: v for k, v in os.environ.items() if k != "MLX_GATED_DELTA_CPU_LEVEL"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [RUNNABLE[-1]]


@pytest.mark.parametrize("level", RUNNABLE)
def test_each_level_meets_the_oracle_contracts(level):
    code = (
        "import sys, pytest\n"
        "from mlx_gated_delta import _ext\n"
        "assert _ext.cpu_kernel_level() == sys.argv[1], _ext.cpu_kernel_level()\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[2:]]))\n"
    )
    tests = [str(ROOT / test) for test in ORACLE_TESTS]
    run_at_level(level, code, level, *tests)


# A forward (both algorithms, float32 and bfloat16) with its gradients, the
# segment and a projection on fixed inputs, saved to the file named by argv[1].
RESULTS = """
import sys
import mlx.core as mx
import numpy as np
from mlx_gated_delta import _ext, gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.testing.strategies import make_core_case

out = {"level": np.array(_ext.cpu_kernel_level())}
for dtype in ("float32", "bfloat16"):
    case = make_core_case(
        7, batch=2, tokens=150, key_heads=2, value_heads=4, key_dim=64, value_dim=32,
        dtype=dtype,
    )
    for algorithm in ("recurrent", "chunked"):
        def loss(q, k, v):
            y, state = gated_delta_rule(q, k, v, *case.args()[3:], algorithm=algorithm,
                                        **case.options)
            return (y.astype(mx.float32) ** 2).sum() + (state ** 2).sum(), (y, state)
        (_, (y, state)), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(*case.args()[:3])
        for name, value in (("y", y), ("state", state), *zip(("dq", "dk", "dv"), grads)):
            out[f"{dtype}.{algorithm}.{name}"] = np.array(value.astype(mx.float32))
# The recurrent step in each of its forms: rows in blocks with rows left over
# (Dv = 7), and a key size that is no multiple of the dot product's 16 lanes
# (Dk = 40); decode steps and a short prefill, scalar and per-key gates.
for index, (key_dim, value_dim, tokens, per_key) in enumerate(
    [(128, 7, 1, False), (128, 7, 1, True), (40, 6, 5, False), (40, 6, 5, True)]
):
    step = make_core_case(
        11 + index, batch=2, tokens=tokens, key_heads=1, value_heads=2, key_dim=key_dim,
        value_dim=value_dim, per_key_gates=per_key,
    )
    y, state = gated_delta_rule(*step.args(), algorithm="recurrent", **step.options)
    out[f"step{index}.y"], out[f"step{index}.state"] = np.array(y), np.array(state)
segment = make_segment_case(
    3, batch=1, tokens=70, key_heads=1, value_heads=2, key_dim=16, value_dim=8,
    wipes="none", mask_kind="none",
)
results = gated_delta_segment(*segment.args(), **segment.options, algorithm="chunked")
for name, value in zip(("out", "conv_state", "state"), results):
    out[f"segment.{name}"] = np.array(value.astype(mx.float32))
rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal((64, 200)).astype(np.float32))
w = mx.array(rng.standard_normal((96, 200)).astype(np.float32))
out["projection"] = np.array(_ext.dense_projection(x, w, None))
np.savez(sys.argv[1], **out)
"""


def results_at(level, tmp_path):
    path = tmp_path / f"{level}.npz"
    run_at_level(level, RESULTS, str(path))
    results = dict(np.load(path))
    assert str(results.pop("level")) == level
    return results


def test_the_levels_that_fuse_multiply_adds_give_bitwise_equal_results(tmp_path):
    fused = [level for level in FUSED_LEVELS if level in RUNNABLE]
    if len(fused) < 2:
        pytest.skip(f"this CPU runs {len(fused)} of {FUSED_LEVELS} in this build")
    first = results_at(fused[0], tmp_path)
    for level in fused[1:]:
        other = results_at(level, tmp_path)
        assert first.keys() == other.keys()
        for name in first:
            assert np.array_equal(first[name], other[name], equal_nan=True), (level, name)


def test_forcing_the_baseline_runs_other_code(tmp_path):
    """A probe that the switch is real, not only the name it reports: the
    baseline rounds a * b + c twice where the fused levels round once, so some
    of its float32 results differ in the last bits (each within the contracts,
    test_each_level_meets_the_oracle_contracts)."""
    fused = [level for level in FUSED_LEVELS if level in RUNNABLE]
    if "baseline" not in RUNNABLE or not fused:
        pytest.skip("this build or CPU has no baseline and fused level to compare")
    baseline, other = results_at("baseline", tmp_path), results_at(fused[0], tmp_path)
    differ = [name for name in baseline if not np.array_equal(baseline[name], other[name])]
    assert "float32.recurrent.y" in differ and "float32.chunked.y" in differ, differ


def test_a_level_the_build_does_not_hold_is_ignored_with_a_message():
    code = "from mlx_gated_delta import _ext; print(_ext.cpu_kernel_level())"
    env = {**os.environ, "MLX_GATED_DELTA_CPU_LEVEL": "x86_64_v9"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [RUNNABLE[-1]]
    assert "MLX_GATED_DELTA_CPU_LEVEL=x86_64_v9" in result.stderr


def load_link_map_check():
    """tools/check_kernel_levels.py, which the build runs on its link map."""
    import importlib.util

    path = ROOT / "tools" / "check_kernel_levels.py"
    spec = importlib.util.spec_from_file_location("check_kernel_levels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def link_map(discarded, kept):
    """A GNU ld map listing (section, object level) pairs as discarded and kept."""

    def lines(sections):
        return [
            f" {name}\n                0x0000000000001000       0x40 "
            f"CMakeFiles/gated_delta_kernels_{level}.dir/csrc/cpu/forward.cpp.o"
            for name, level in sections
        ]

    return "\n".join(
        ["Discarded input sections", "", *lines(discarded), "", "Memory Configuration", ""]
        + ["Linker script and memory map", "", ".text           0x1000     0x4000", *lines(kept)]
    )


SHARED = ".text._ZNSt6vectorIfSaIfEE6resizeEm"  # std::vector<float>::resize, a shared template


def test_the_link_map_check_finds_shared_code_kept_from_a_wide_level():
    check = load_link_map_check()
    in_order = link_map(discarded=[(SHARED, "x86_64_v4")], kept=[(SHARED, "baseline")])
    assert check.foreign_code(in_order) == []
    only_v4 = link_map(discarded=[], kept=[(SHARED, "x86_64_v4")])
    assert check.foreign_code(only_v4) == []  # only the v4 copy calls it
    reversed_order = link_map(discarded=[(SHARED, "baseline")], kept=[(SHARED, "x86_64_v4")])
    assert len(check.foreign_code(reversed_order)) == 1
    startup = link_map(discarded=[], kept=[(".text.startup", "x86_64_v3")])
    assert len(check.foreign_code(startup)) == 1
