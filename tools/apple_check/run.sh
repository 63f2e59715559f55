#!/usr/bin/env bash
# The Apple-toolchain check (README.md here): the C++ compiled under _METAL_
# against MLX's own macOS headers, the embedded Metal library through a strict
# MSL front end, and the probes each check must reject. Fails on the first
# check that fails.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
start=$SECONDS
python3 "$HERE/check_host.py"
python3 "$HERE/check_host.py" --probes
python3 "$HERE/check_library.py"
python3 "$HERE/check_library.py" --probes
echo "apple_check: every check passed and every probe was rejected ($((SECONDS - start)) s)"
