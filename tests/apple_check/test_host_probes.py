"""The host check (tools/apple_check/check_host.py) must reject each of its
probes, in both of its modes, with the probe's own error in the probe's real
source file: otherwise it could pass while checking nothing.

Skipped where clang-19 or MLX's macOS headers are missing, unless
MLX_GATED_DELTA_REQUIRE_APPLE_CHECK=1 (CI), where that is a failure. The headers
are fetched by running the check itself (it downloads them once).
"""

import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "apple_check"))
import check_host  # noqa: E402
import fetch_mlx_headers  # noqa: E402

REQUIRED = os.environ.get("MLX_GATED_DELTA_REQUIRE_APPLE_CHECK") == "1"


def missing_tools():
    if shutil.which(check_host.CLANG) is None:
        return f"{check_host.CLANG} is not installed"
    if not fetch_mlx_headers.is_fetched(fetch_mlx_headers.pinned_mlx_version()):
        return "MLX's macOS headers are not fetched (run tools/apple_check/check_host.py)"
    return None


@pytest.fixture(scope="module")
def includes():
    missing = missing_tools()
    if missing:
        if REQUIRED:
            pytest.fail(f"MLX_GATED_DELTA_REQUIRE_APPLE_CHECK=1 but {missing}")
        pytest.skip(missing)
    check_host.generate_library_header()
    return check_host.include_flags(
        fetch_mlx_headers.include_dir(fetch_mlx_headers.pinned_mlx_version())
    )


@pytest.mark.parametrize(
    "path", check_host.probe_files(), ids=lambda path: os.path.basename(path).removesuffix(".probe")
)
@pytest.mark.parametrize("mode", list(check_host.MODES))
def test_probe_is_rejected_with_its_error(path, mode, includes):
    name = os.path.basename(path).removesuffix(".probe")
    probe = check_host.parse_probe(path)
    ok, _, diagnostics = check_host.compile_probe(probe, name, mode, includes)
    assert not ok, f"probe {name} compiled [{mode}]"
    rejected, error = check_host.probe_verdict(probe, ok, diagnostics)
    assert rejected, (
        f"probe {name} [{mode}]: expected '{probe['error']}' in "
        f"{probe['source']}, first error was: {error}"
    )
