#!/usr/bin/env bash
# compute-sanitizer over the CUDA kernels (tools/cuda/sanitize_case.py), on a GPU
# machine where tools/cuda/gpu_machine.sh has installed the package:
#   memcheck   out-of-bounds and misaligned accesses;
#   racecheck  shared-memory hazards between the threads of a block;
# then the probe build (CMake option MLX_GATED_DELTA_CUDA_PROBE): one
# __syncthreads of chunk_carry left out, and recurrent_backward's per-token
# sums in one shared buffer instead of two, races that racecheck must report
# in both kernels.
# Exits non-zero unless both checks are clean and the probe is caught.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
site=${SITE:-/tmp/gd-site}
probe_site=${PROBE_SITE:-/tmp/gd-probe-site}
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
status=0

run() {  # name, the kernels watched (a name prefix), the case's flags, then the tool's arguments
    local name=$1 kernels=$2 case_flags=$3
    shift 3
    echo "== $name"
    "$sanitizer" --kernel-name "kns=$kernels" --error-exitcode 3 --print-limit 20 "$@" \
        "$python" "$here/tools/cuda/sanitize_case.py" $case_flags
}

# Only our kernels (their names start with gd_), not MLX's.
run memcheck gd_ "" --tool memcheck || status=1
run racecheck gd_ "" --tool racecheck --racecheck-report all || status=1

echo "== probe build (races planted in chunk_carry and recurrent_backward)"
rm -rf "$probe_site"
"$python" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$probe_site" \
    -Cbuild-dir=/tmp/gd-probe-build -Ccmake.define.MLX_GATED_DELTA_METAL_EMULATOR=OFF \
    -Ccmake.define.MLX_GATED_DELTA_CUDA_PROBE=ON "$here" || exit 1
# One kernel at a time: the first hazards printed would all be chunk_carry's.
# recurrent_backward's probe runs on a short case of its own: its race is reported at
# every token, and over the whole case that took longer than a device run may.
# SANITIZE_PROBES picks some of them (a device run short of time).
for kernel in ${SANITIZE_PROBES:-gd_chunk_carry gd_recurrent_backward}; do
    probe_log=$(mktemp)
    case_flags=""
    [ "$kernel" = gd_recurrent_backward ] && case_flags=--recurrent-backward
    PYTHONPATH="$probe_site:$PYTHONPATH" run "racecheck of the probe in $kernel" "$kernel" "$case_flags" \
        --tool racecheck --racecheck-report hazard 2>&1 | tee "$probe_log"
    if grep -E "hazard detected|Race reported" -A 3 "$probe_log" | grep -q "$kernel"; then
        echo "sanitize: the probe in $kernel was caught (racecheck reported the hazard)"
    else
        echo "sanitize: the probe in $kernel was NOT caught"
        status=1
    fi
done
[ $status -eq 0 ] && echo "sanitize: memcheck and racecheck clean, probe caught"
exit $status
