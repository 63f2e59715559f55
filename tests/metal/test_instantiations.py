"""The emulator and the CUDA check take the kernels' instantiation lines the
way Metal does: through the real instantiation macro. Host names are read off
the C preprocessor's expansion, and a macro that does not expand to a
host-named kernel instantiation (the parameter once named `host_name`, which
replaced the attribute's own name) stops both."""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "csrc" / "metal" / "kernels"
PREP_METAL = ROOT / "csrc" / "metal" / "emulator" / "prep_metal.py"
PREP_CUDA = ROOT / "tools" / "cuda_check" / "prep_cuda.py"
INTACT = "#define instantiate_kernel(name, function, ...) \\\n  template [[host_name(name)]]"
BROKEN = (
    "#define instantiate_kernel(host_name, function, ...) \\\n  template [[host_name(host_name)]]"
)


def kernels_copy(tmp_path, macro):
    directory = tmp_path / "kernels"
    shutil.copytree(KERNELS, directory)
    common = directory / "gated_delta_common.h"
    text = common.read_text()
    assert text.count(INTACT) == 1
    common.write_text(text.replace(INTACT, macro))
    return directory


def prep_metal(kernel, tmp_path):
    return subprocess.run(
        [sys.executable, str(PREP_METAL), str(kernel), str(tmp_path / "out.cpp")],
        capture_output=True,
        text=True,
    )


def prep_cuda(kernels, tmp_path):
    return subprocess.run(
        [
            sys.executable,
            str(PREP_CUDA),
            str(tmp_path / "k.cu"),
            str(tmp_path / "k.json"),
            *map(str, sorted(kernels.glob("*.metal"))),
        ],
        capture_output=True,
        text=True,
    )


def test_emulator_registers_the_host_names_the_macro_expands_to(tmp_path):
    result = prep_metal(KERNELS / "recurrent.metal", tmp_path)
    assert result.returncode == 0, result.stderr
    registered = re.findall(r'KernelRegistration \w+\("(\w+)"', (tmp_path / "out.cpp").read_text())
    calls = re.findall(
        r'^instantiate_kernel\("(\w+)"', (KERNELS / "recurrent.metal").read_text(), re.MULTILINE
    )
    assert len(calls) == 6 and registered == calls


def test_cuda_check_wraps_the_host_names_the_macro_expands_to(tmp_path):
    result = prep_cuda(KERNELS, tmp_path)
    assert result.returncode == 0, result.stderr
    wrapped = set(json.loads((tmp_path / "k.json").read_text()))
    texts = [path.read_text() for path in KERNELS.glob("*.metal")]
    calls = {
        name
        for text in texts
        for name in re.findall(r'^instantiate_kernel\("(\w+)"', text, re.MULTILINE)
    }
    # Every instantiation line is seen (the host names are unique) and wrapped.
    assert len(calls) == sum(text.count('\ninstantiate_kernel("') for text in texts) > 0
    assert calls <= wrapped


@pytest.mark.parametrize("tool", ["emulator", "cuda"])
def test_broken_macro_stops_the_build(tmp_path, tool):
    kernels = kernels_copy(tmp_path, BROKEN)
    if tool == "emulator":
        first = kernels / "chunk_carry.metal"
        result = prep_metal(first, tmp_path)
    else:
        # The CUDA check reads every kernel file, in sorted order, and stops at
        # the first instantiation.
        first = sorted(kernels.glob("*.metal"))[0]
        result = prep_cuda(kernels, tmp_path)
    host = re.search(r'^instantiate_kernel\("(\w+)"', first.read_text(), re.MULTILINE)[1]
    assert result.returncode != 0
    assert f'expands to template [["{host}"("{host}")]]' in result.stderr
    assert "which is not a host-named [[kernel]] instantiation" in result.stderr
