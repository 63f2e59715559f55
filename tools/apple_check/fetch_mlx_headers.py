"""Fetches MLX's macOS headers: the `mlx/include/` tree of the mlx-metal wheel
whose version pyproject.toml pins for macOS (mlx/backend/metal/*.h, metal_cpp/
and the rest of MLX's public headers, exactly as a Mac build compiles against).

The wheel is downloaded with pip (about 45 MB) into build/apple_check/wheels/
and only `mlx/include/` is unpacked, into build/apple_check/mlx-metal-VERSION/.
Nothing is downloaded when that tree is already complete.

Usage: python tools/apple_check/fetch_mlx_headers.py   (prints the include directory)
"""

import glob
import os
import re
import subprocess
import sys
import zipfile

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, "build", "apple_check")
INCLUDE_PREFIX = "mlx/include/"
# Written last, so that an interrupted unpack is redone rather than trusted.
COMPLETE_MARKER = ".complete"


def pinned_mlx_version():
    """The exact MLX version the package's dependencies pin for macOS (dynamic metadata:
    pyproject.toml's [tool.scikit-build.metadata.dependencies], whose list a CUDA build
    replaces)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        pyproject = tomllib.load(handle)
    dependencies = pyproject["tool"]["scikit-build"]["metadata"]["dependencies"]["result"]
    pins = set()
    for requirement in dependencies:
        match = re.fullmatch(r"mlx==(\S+?)\s*;\s*(.*)", requirement)
        if match and "darwin" in match[2]:
            pins.add(match[1])
    if len(pins) != 1:
        raise SystemExit(
            f"fetch_mlx_headers: expected one 'mlx==VERSION; sys_platform == \"darwin\"' "
            f"dependency in pyproject.toml, found {sorted(pins)}"
        )
    return pins.pop()


def include_dir(version):
    return os.path.join(BUILD, f"mlx-metal-{version}", "mlx", "include")


def is_fetched(version):
    return os.path.exists(os.path.join(BUILD, f"mlx-metal-{version}", COMPLETE_MARKER))


def downloaded_wheel(wheels, version):
    """The mlx-metal wheel of `version` in `wheels`, or None."""
    names = glob.glob(os.path.join(wheels, f"mlx_metal-{version}-*.whl"))
    return names[0] if names else None


def fetch(version):
    """Returns the unpacked include directory, downloading the wheel if needed."""
    if is_fetched(version):
        return include_dir(version)

    wheels = os.path.join(BUILD, "wheels")
    wheel = downloaded_wheel(wheels, version)
    if wheel is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"mlx-metal=={version}",
                "--platform",
                "macosx_14_0_arm64",
                "--only-binary=:all:",
                "--no-deps",
                "--quiet",
                "--dest",
                wheels,
            ],
            check=True,
        )
        wheel = downloaded_wheel(wheels, version)
        if wheel is None:
            raise SystemExit(
                f"fetch_mlx_headers: pip left no mlx-metal {version} wheel in {wheels}"
            )
    wheel_name = os.path.basename(wheel)

    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.startswith(INCLUDE_PREFIX)]
        if not any(name.startswith(INCLUDE_PREFIX + "mlx/backend/metal/") for name in members):
            raise SystemExit(f"fetch_mlx_headers: {wheel_name} has no mlx/backend/metal headers")
        unpacked = os.path.join(BUILD, f"mlx-metal-{version}")
        archive.extractall(unpacked, members)
    with open(os.path.join(unpacked, COMPLETE_MARKER), "w") as handle:
        handle.write(f"{wheel_name}\n")
    return include_dir(version)


if __name__ == "__main__":
    print(fetch(pinned_mlx_version()))
