#!/usr/bin/env bash
# compute-sanitizer over the CUDA kernels (tools/cuda/sanitize_case.py), on a GPU
# machine where tools/cuda/gpu_machine.sh has installed the package:
#   memcheck   out-of-bounds and misaligned accesses;
#   racecheck  shared-memory hazards between the threads of a block;
# then the probe: the same build with one __syncthreads of chunk_carry left out
# (CMake option MLX_GATED_DELTA_CUDA_PROBE), which racecheck must report.
# Exits non-zero unless both checks are clean and the probe is caught.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
site=${SITE:-/tmp/gd-site}
probe_site=${PROBE_SITE:-/tmp/gd-probe-site}
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
# Only our kernels (their names start with gd_), not MLX's.
watch=(--kernel-name kns=gd_ --error-exitcode 3 --print-limit 20)
status=0

run() {  # name, then the tool's arguments
    local name=$1
    shift
    echo "== $name"
    "$sanitizer" "${watch[@]}" "$@" "$python" "$here/tools/cuda/sanitize_case.py"
}

run memcheck --tool memcheck || status=1
run racecheck --tool racecheck --racecheck-report all || status=1

echo "== probe build (one __syncthreads of chunk_carry removed)"
rm -rf "$probe_site"
"$python" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$probe_site" \
    -Cbuild-dir=/tmp/gd-probe-build -Ccmake.define.MLX_GATED_DELTA_METAL_EMULATOR=OFF \
    -Ccmake.define.MLX_GATED_DELTA_CUDA_PROBE=ON "$here" || exit 1
probe_log=$(mktemp)
PYTHONPATH="$probe_site:$PYTHONPATH" run "racecheck of the probe" \
    --tool racecheck --racecheck-report hazard 2>&1 | tee "$probe_log"
if grep -qE "hazard detected|Race reported" "$probe_log"; then
    echo "sanitize: the probe was caught (racecheck reported the hazard)"
else
    echo "sanitize: the probe was NOT caught"
    status=1
fi
[ $status -eq 0 ] && echo "sanitize: memcheck and racecheck clean, probe caught"
exit $status
