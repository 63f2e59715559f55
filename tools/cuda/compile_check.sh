#!/usr/bin/env bash
# CI's check of the CUDA side, on a machine with no GPU and no CUDA toolkit:
# nvcc from PyPI (tools/cuda/requirements.txt) compiles every kernel source
# csrc/cuda/*.cu for every architecture the build ships, with the build's
# flags and warnings as errors, and the host compiler checks the executor
# against the CUDA backend headers of the installed MLX wheel. Run from the
# environment that has the package's build requirements (mlx, nanobind).
set -euo pipefail
cd "$(dirname "$0")/../.."

python -m pip install --quiet -r tools/cuda/requirements.txt
cuda=$(python -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("nvidia").submodule_search_locations[0], "cu13"))')
mlx_include=$(python -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("mlx").submodule_search_locations[0], "include"))')
nvcc="$cuda/bin/nvcc"
"$nvcc" --version | tail -1

# The architectures of csrc/cuda/cuda.cmake's default.
archs=$(sed -n 's/^set(MLX_GATED_DELTA_CUDA_ARCHS "\([0-9 ;]*\)".*/\1/p' csrc/cuda/cuda.cmake | tr ';' ' ')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
compile() {  # compile SOURCE ARCH: the build's flags, warnings as errors
    "$nvcc" -fatbin -std=c++17 -O3 "-gencode=arch=compute_$2,code=sm_$2" \
        -Werror all-warnings -I csrc -o "$out/$(basename "$1" .cu).fatbin" "$1"
}

# Probe: a kernel with a warning (an unused variable) must fail the check.
printf '__global__ void probe(float* x) { int unused = 0; x[0] = 1.0f; }\n' > "$out/probe.cu"
for arch in $archs; do
    if compile "$out/probe.cu" "$arch" 2> /dev/null; then
        echo "cuda compile check: the probe's warning passed on sm_$arch" >&2
        exit 1
    fi
done
echo "probe rejected: a warning fails the check"

for source in csrc/cuda/*.cu; do
    for arch in $archs; do
        compile "$source" "$arch"
        echo "nvcc sm_$arch: $source"
    done
done
# The executor, and the primitives' CUDA branches (eval_gpu on a CUDA stream).
for source in csrc/cuda/*.cpp $(grep -l MLX_GATED_DELTA_CUDA csrc/core/*.cpp csrc/segment/*.cpp); do
    "${CXX:-g++}" -std=c++20 -fsyntax-only -Wall -Wextra -Werror -DMLX_GATED_DELTA_CUDA \
        -I csrc -I csrc/cuda/compat -isystem "$mlx_include" -isystem "$cuda/include" "$source"
    echo "host: $source"
done
echo "cuda compile check: every CUDA source compiles"
