#!/usr/bin/env bash
# On the GPU machine: the oracle run, then compute-sanitizer racecheck and
# memcheck over the sanitizer cases, then racecheck over the broken copy.
# Writes results.npz and the logs to $OUT (or ./out).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
SMALL="recurrent_simd_f32_mask,recurrent_generic_f16,chunked_bf16_norm,chunked_k_gram_f16,segment_recurrent_f16_mask,checkpoints_chunked,tree_recurrent_generic,checkpoints_segment_chunked,backward_f16_per_key,chunked_per_key_f16_wipes_mask,backward_bf16_norm,backward_bf16_recurrent_scalar"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy; print('cupy', cupy.__version__)"
echo "=== oracle run (all cases)"
python3 "$HERE/run_cuda.py" "$HERE" --out "$OUT/results.npz" 2>&1 | tee "$OUT/run.log"
for tool in racecheck memcheck; do
  echo "=== compute-sanitizer --tool $tool (intact kernels)"
  compute-sanitizer --tool "$tool" python3 "$HERE/run_cuda.py" "$HERE" --cases "$SMALL" \
    > "$OUT/$tool.log" 2>&1
  echo "exit $?"; tail -n 3 "$OUT/$tool.log"
done
echo "=== compute-sanitizer --tool racecheck (chunk_output with its barrier deleted)"
compute-sanitizer --tool racecheck python3 "$HERE/run_cuda.py" "$HERE" --source kernels_broken \
  --cases chunked_bf16_norm > "$OUT/racecheck_broken.log" 2>&1
echo "exit $?"; grep -m 3 -E "Race reported|hazard" "$OUT/racecheck_broken.log"; tail -n 3 "$OUT/racecheck_broken.log"
echo "=== compute-sanitizer --tool racecheck (recurrent_chunk_backward with its first barrier deleted)"
compute-sanitizer --tool racecheck python3 "$HERE/run_cuda.py" "$HERE" --source kernels_broken \
  --cases backward_f16_per_key > "$OUT/racecheck_broken_backward.log" 2>&1
echo "exit $?"; grep -m 3 -E "Race reported|hazard" "$OUT/racecheck_broken_backward.log"; tail -n 3 "$OUT/racecheck_broken_backward.log"
