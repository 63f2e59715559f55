#!/usr/bin/env bash
# Lint and format checks, run by CI: ruff (settings in pyproject.toml) over
# the Python, clang-format (.clang-format) over the C++. The Metal kernel
# sources (csrc/metal/kernels/) are left as written: the emulator's and the
# CUDA check's rewrites and the probes read them a declaration per line.
# `--fix` applies both instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT="${CLANG_FORMAT:-clang-format-19}"
mapfile -t cpp < <(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'tests/*.cpp' | grep -v '^csrc/metal/kernels/')
if [ "${1:-}" = "--fix" ]; then
  ruff check --fix .
  ruff format .
  "$CLANG_FORMAT" -i "${cpp[@]}"
else
  ruff check .
  ruff format --check .
  "$CLANG_FORMAT" --dry-run -Werror "${cpp[@]}"
  echo "format: ruff and clang-format clean (${#cpp[@]} C++ files)"
fi
