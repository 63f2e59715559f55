"""The embedded library source (csrc/metal/embed_metal.py): every line maps
back through its #line marker to the .metal or header line it came from, and
a non-ASCII byte, which MLX's ASCII hand-over to Metal would garble, is refused."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "csrc" / "metal" / "kernels"
EMBED = ROOT / "csrc" / "metal" / "embed_metal.py"
LINE_MARKER = re.compile(r'^#line (\d+) "([^"]+)"$')


def embed(tmp_path, kernels):
    header = tmp_path / "library.h"
    subprocess.run(
        [sys.executable, str(EMBED), str(header), *map(str, kernels)],
        check=True,
        capture_output=True,
        text=True,
    )
    text = header.read_text()
    # The writer puts the source between a newline after the opening
    # delimiter and one before the closing delimiter.
    start = text.index('R"metal_source(\n') + len('R"metal_source(\n')
    return text[start : text.index('\n)metal_source"')]


def test_every_line_maps_back_to_its_source(tmp_path):
    kernels = sorted(KERNELS.glob("*.metal"))
    source = embed(tmp_path, kernels)
    file_lines, where, checked = {}, None, 0
    for line in source.split("\n"):
        marker = LINE_MARKER.match(line)
        if marker:
            name = marker[2]
            file_lines.setdefault(name, (KERNELS / name).read_text().split("\n"))
            where = [name, int(marker[1])]
            continue
        name, number = where
        original = file_lines[name][number - 1]
        if original.strip() != "#pragma once" and not original.lstrip().startswith('#include "'):
            assert line == original, f"{name}:{number}"
            checked += 1
        where[1] += 1
    assert checked > 1000 and {f.name for f in kernels} <= set(file_lines)


def test_non_ascii_is_refused(tmp_path):
    kernel = tmp_path / "bad.metal"
    kernel.write_text("// decay \u00d7 state\nkernel void k() {}\n")
    with pytest.raises(subprocess.CalledProcessError) as failure:
        embed(tmp_path, [kernel])
    assert "non-ASCII character" in failure.value.stderr
