"""The Metal library's failure path: a library that does not build on a
user's Mac raises an error that quotes the compiler, names the versions and
asks for a selftest report, and never crashes. The message and the test hook
are checked here on every platform; the GPU call itself only on a Mac."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from mlx_gated_delta import _ext

HOOK = "MLX_GATED_DELTA_TEST_METAL_SOURCE"

# The shape of the exception MLX's Device::build_library_ throws.
COMPILER_OUTPUT = (
    "[metal::Device] Unable to build metal library from source\n"
    'program_source:2:1: note: in file included from "recurrent.metal"\n'
    "recurrent.metal:174:12: error: expected ']'\n"
    "chunk_carry.metal:113:12: error: expected ']'\n"
    "2 errors generated.\n"
)


def test_failure_message_quotes_the_first_errors_and_names_versions():
    message = _ext.metal_library_failure_message(COMPILER_OUTPUT)
    assert "recurrent.metal:174:12: error: expected ']'" in message
    assert "chunk_carry.metal:113:12: error: expected ']'" in message
    assert "note: in file included" not in message  # errors first, not noise
    assert f"mlx-gated-delta {importlib.metadata.version('mlx-gated-delta')}" in message
    assert f"MLX {mx.__version__}" in message
    assert "python -m mlx_gated_delta selftest" in message


def test_failure_message_quotes_at_most_eight_errors():
    output = "".join(f"k.metal:{n}:1: error: number {n}\n" for n in range(1, 21))
    message = _ext.metal_library_failure_message(output)
    assert "error: number 8\n" in message and "error: number 9\n" not in message


def test_failure_message_without_error_lines_quotes_the_first_lines():
    message = _ext.metal_library_failure_message("Compiler encountered an internal error\n")
    assert "Compiler encountered an internal error" in message


def test_source_hook(tmp_path, monkeypatch):
    monkeypatch.delenv(HOOK, raising=False)
    assert _ext.metal_library_source("embedded text") == "embedded text"
    invalid = tmp_path / "invalid.metal"
    invalid.write_text("kernel void broken(")
    monkeypatch.setenv(HOOK, str(invalid))
    assert _ext.metal_library_source("embedded text") == "kernel void broken("
    monkeypatch.setenv(HOOK, str(tmp_path / "missing.metal"))
    with pytest.raises(RuntimeError, match=f"unavailable: {HOOK} names .*missing.metal"):
        _ext.metal_library_source("embedded text")


GPU_CALL = textwrap.dedent(
    """
    import mlx.core as mx
    import mlx_gated_delta as gd
    q = mx.random.normal((1, 4, 2, 32)); v = mx.random.normal((1, 4, 2, 32))
    g = -mx.random.uniform(shape=(1, 4, 2)); beta = mx.random.uniform(shape=(1, 4, 2))
    for attempt in range(2):
        try:
            mx.eval(gd.gated_delta_rule(q, q, v, g, beta, stream=mx.gpu))
            print("NO ERROR")
        except RuntimeError as error:
            print("RAISED", str(error).replace(chr(10), " | "))
    """
)


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU")
@pytest.mark.parametrize("source", ["invalid", "missing"])
def test_gpu_call_with_a_broken_library_raises_twice_and_does_not_crash(tmp_path, source):
    path = tmp_path / "library.metal"
    if source == "invalid":
        path.write_text("#include <metal_stdlib>\nkernel void broken(\n")
    env = dict(os.environ, **{HOOK: str(path)})
    run = subprocess.run(
        [sys.executable, "-c", GPU_CALL], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("RAISED") for line in lines), run.stdout
    assert "failed to build" in lines[0] and "selftest" in lines[0]
    assert lines[0] == lines[1]  # remembered, not compiled again
