"""The strict MSL check of the embedded Metal library (tools/apple_check/check_library.py):
the real library passes, and every probe (a small edit of the real kernels) is
rejected with its own error, so the check cannot quietly lose its teeth.

Needs clang-19; skipped without it, unless MLX_GATED_DELTA_REQUIRE_APPLE_CHECK=1
(CI), where a missing compiler is a failure.
"""

import importlib.util
import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK_PATH = os.path.join(REPO, "tools", "apple_check", "check_library.py")


def load_check():
    spec = importlib.util.spec_from_file_location("check_library", CHECK_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_library = load_check()

if shutil.which(check_library.CLANG) is None:
    if os.environ.get("MLX_GATED_DELTA_REQUIRE_APPLE_CHECK") == "1":
        pytest.fail(
            f"{check_library.CLANG} is required (MLX_GATED_DELTA_REQUIRE_APPLE_CHECK=1)",
            pytrace=False,
        )
    pytest.skip(f"{check_library.CLANG} not installed", allow_module_level=True)


def test_real_library_passes():
    errors = check_library.check(check_library.KERNEL_DIR, check_library.BUILD_DIR)
    assert errors == []


def test_library_is_what_get_library_receives():
    library, _ = check_library.library_text(check_library.KERNEL_DIR, check_library.BUILD_DIR)
    with open(library) as handle:
        text = handle.read()
    # Every kernel file and local header is inlined once, and nothing of the
    # C++ wrapper (raw-string delimiter, namespace) leaks into the string.
    for name in check_library.kernel_names():
        assert text.count(f'#line 1 "{name}.metal"\n') == 1
    assert text.count('#line 1 "gated_delta_common.h"\n') == 1
    assert "metal_source" not in text and "kMetalLibrarySource" not in text
    assert text.count("#include <metal_stdlib>") == 1


PROBES = check_library.load_probes()


@pytest.mark.parametrize("probe", PROBES, ids=[p["name"] for p in PROBES])
def test_probe_is_rejected_with_its_error(probe):
    errors = check_library.run_probe(probe)
    assert errors, f"the check passed probe {probe['name']}: {probe['why']}"
    assert any(probe["expect"] in error for error in errors), "\n".join(errors)


def test_old_host_name_macro_fails_on_every_instantiation():
    probe = next(p for p in PROBES if p["name"] == "old_host_name_macro")
    errors = check_library.run_probe(probe)
    instantiation_lines = sum(
        1
        for name in check_library.kernel_names()
        for line in open(os.path.join(check_library.KERNEL_DIR, f"{name}.metal"))
        if line.startswith("instantiate_kernel(")
    )
    assert sum("expected ']'" in error for error in errors) >= instantiation_lines
