#!/usr/bin/env bash
# Installs mlx-gated-delta with its CUDA kernels on an NVIDIA GPU machine that
# has no network, from wheels carried there, and runs the checks and the
# benchmark. For a Hopper GPU (H100, H200) with a CUDA 13 PyTorch (whose
# NVIDIA libraries MLX's CUDA build uses), python3 with nanobind,
# scikit-build-core, CMake, ninja, pytest and Hypothesis, and nvcc 13.
#
#   bash tools/cuda/gpu_machine.sh CARRY OUT STEP...
#
# CARRY holds the wheels: mlx-0.32.4-*.whl and mlx_cuda_13-0.32.4-*.whl
# (`pip download "mlx[cuda13]==0.32.4" --no-deps`), and for the benchmark's
# FLA columns fla_core-*.whl and flash_linear_attention-*.whl (0.6.0), and
# for the layer's properties mlx_lm-*.whl (0.32.2), and where the machine's
# scikit-build-core is older than pyproject.toml's floor (0.11.2: the dynamic
# dependencies) scikit_build_core-*.whl. OUT receives one log per step.
# Steps, run in the order given:
#   install    MLX and this checkout (nvcc builds the kernels) into SITE
#   check      tools/cuda/check.py: the kernels against the CPU and the oracle
#   selftest   python -m mlx_gated_delta selftest on the CUDA device (TF32 off)
#   sanitize   tools/cuda/sanitize.sh: memcheck, racecheck and the probes
#   bench      python -m mlx_gated_delta bench --cuda
#   stages     tools/cuda/stage_times.py: each chunked kernel's GPU time
# Environment: SITE (default /tmp/gd-site), PYTHON (default python3),
# SELFTEST_EXAMPLES (default 25).
set -euo pipefail

carry=$(cd "${1:?usage: gpu_machine.sh CARRY OUT STEP...}" && pwd)
out=$(mkdir -p "${2:?}" && cd "$2" && pwd)
shift 2
site=${SITE:-/tmp/gd-site}
python=${PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

environment() {
    # MLX's CUDA build loads the CUDA libraries of PyTorch's environment:
    # libmlx.so looks for them in ../../nvidia beside its package, and cuDNN
    # and NVRTC open more by name.
    local torch_dir nvidia
    torch_dir=$("$python" -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')
    nvidia=$(dirname "$torch_dir")/nvidia
    mkdir -p "$site"
    ln -sfn "$nvidia" "$site/nvidia"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    LD_LIBRARY_PATH="$(find -L "$nvidia" -mindepth 2 -maxdepth 2 -type d -name lib | sort | paste -sd: -)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
    export PYTHONUNBUFFERED=1
}

install() {
    rm -rf "$site"
    environment
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" \
        "$carry"/mlx-*.whl "$carry"/mlx_cuda_13-*.whl
    shopt -s nullglob
    local extra=("$carry"/fla_core-*.whl "$carry"/flash_linear_attention-*.whl "$carry"/mlx_lm-*.whl
        "$carry"/scikit_build_core-*.whl)
    if [ ${#extra[@]} -gt 0 ]; then
        "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "${extra[@]}"
    fi
    # No build isolation: the build must see the CUDA build of MLX (the
    # CMake switch MLX_GATED_DELTA_CUDA detects it) and has no network.
    "$python" -m pip install --no-index --no-deps --no-build-isolation --target "$site" \
        -Cbuild-dir=/tmp/gd-build -Ccmake.define.MLX_GATED_DELTA_METAL_EMULATOR=OFF "$here"
    "$python" -c 'import mlx.core as mx, mlx_gated_delta as gd; print("mlx", mx.__version__, mx.default_device(), "cuda", mx.cuda.is_available())'
}

for step in "$@"; do
    [ "$step" = install ] || environment
    echo "== $step"
    case "$step" in
        install) install ;;
        check) "$python" "$here/tools/cuda/check.py" ;;
        # MLX's CUDA matmuls default to TF32; the layer properties' contracts assume
        # float32 products in the model around our op (docs/cuda.md).
        selftest) MLX_ENABLE_TF32=${MLX_ENABLE_TF32:-0} "$python" -m mlx_gated_delta selftest \
            --examples "${SELFTEST_EXAMPLES:-25}" ;;
        sanitize) bash "$here/tools/cuda/sanitize.sh" ;;
        bench) "$python" -m mlx_gated_delta bench --cuda ;;
        stages) "$python" "$here/tools/cuda/stage_times.py" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac 2>&1 | tee "$out/$step.log"
done
