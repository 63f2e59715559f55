"""pyproject.toml's CUDA build (`MLX_GATED_DELTA_CUDA=13 pip install .`) against the
rest of the repository: its nvcc pins are tools/cuda/requirements.txt's (CI's compile
check installs that file), and its runtime dependencies are the CPU build's with MLX's
CUDA wheel in place of the CPU one."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11

ROOT = Path(__file__).resolve().parent.parent


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _cuda_override(pyproject):
    """The override that MLX_GATED_DELTA_CUDA=13 selects and that adds the compiler."""
    matches = [
        o
        for o in pyproject["tool"]["scikit-build"]["overrides"]
        if o["if"].get("env", {}).get("MLX_GATED_DELTA_CUDA") == "^13$"
        and "CUDA_HOME" not in o["if"]["env"]
    ]
    assert len(matches) == 1, matches
    return matches[0]


def test_cuda_build_pins_the_compile_checks_nvcc():
    lines = (ROOT / "tools" / "cuda" / "requirements.txt").read_text().splitlines()
    pins = [line for line in lines if line.strip() and not line.startswith("#")]
    assert _cuda_override(_pyproject())["build"]["requires"] == pins


def test_cuda_build_swaps_only_the_mlx_backend():
    pyproject = _pyproject()
    assert "dependencies" in pyproject["project"]["dynamic"]
    cpu = [
        Requirement(d)
        for d in pyproject["tool"]["scikit-build"]["metadata"]["dependencies"]["result"]
    ]
    cuda = [Requirement(d) for d in _cuda_override(pyproject)["metadata"]["dependencies"]["result"]]
    assert [str(r) for r in cpu if r.name != "mlx"] == [str(r) for r in cuda if r.name != "mlx"]
    (cpu_mlx,) = [r for r in cpu if r.name == "mlx" and r.extras == {"cpu"}]
    (cuda_mlx,) = [r for r in cuda if r.name == "mlx"]
    assert cuda_mlx.extras == {"cuda13"}
    assert cuda_mlx.specifier == cpu_mlx.specifier
    # The override applies on Linux only, so the requirement needs no platform marker.
    assert cuda_mlx.marker is None
