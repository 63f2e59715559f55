#!/usr/bin/env bash
# Proves that the sanitizer net catches kernel bugs: builds deliberately
# broken copies of the .metal sources and runs run_sanitizers.sh on them.
# Each broken build must FAIL; the script fails if one passes.
#
#   1. chunk_output.metal with its barrier deleted      -> ThreadSanitizer: data race
#   2. chunk_carry.metal with its first barrier deleted -> ThreadSanitizer: data race
#   3. chunk_output.metal with a loop bound widened     -> AddressSanitizer / sentinel guard
#   4. collect_conv_state.metal with its channel bound widened -> sentinel guard
#   5. the instantiation macro's parameter named host_name again -> the build
#      fails: it expands to [["name"("name")]], as Metal's compiler would see it
#   6. boundary_states.metal with its row bound widened -> sentinel guard
#   7. chunk_states.metal with its row bound widened    -> sentinel guard
#   8. recurrent_chunk_backward.metal with its first barrier deleted -> ThreadSanitizer: data race
#   9. qk_grad_reduce.metal with its row bound widened  -> sentinel guard
#  10. chunk_output_backward.metal with its barrier deleted -> ThreadSanitizer
#  11. kkt_inverse_backward.metal with the barrier before dA deleted -> ThreadSanitizer
#  12. recompute_w_u_backward.metal with its row bound widened -> sentinel guard
#  13. chunk_carry_backward.metal with its device barrier deleted -> ThreadSanitizer
#  14. key_decayed_grams (per-key kkt_inverse, chunk_qk) with its pairs'
#      staging bound widened, writing past the tiles    -> AddressSanitizer
#      (its column bound guards reads only: a read past a row lands in the
#      next row or in a buffer's guard bytes, which are finite, so the net
#      cannot see it; the oracle test at Dk = 17 does)
#  15. key_decayed_grams with the pairs' second barrier deleted -> ThreadSanitizer: data race
#  16. gate_cumsum.metal with its scan bound widened (per-key: one scan per
#      channel)                                         -> sentinel guard
#  17. key_decayed_grams with the barrier after the factored tiles deleted
#                                                      -> ThreadSanitizer: data race
#  18. key_decayed_grams with its columns factored from the previous
#      sub-chunk's first row (a wrong reference row)    -> the driver's
#      strong channels (g = -60) overflow: outputs not finite
#      (tests/metal/test_per_key_chunked_emulated.py's oracle tests fail too)
#  19. gate_cumsum_backward.metal with the barrier between its two scans
#      deleted                                          -> ThreadSanitizer: data race
#  20. channel_pairs_backward.metal (per-key gates) with the device barrier
#      before the dbeta sums deleted                    -> ThreadSanitizer: data race
#
#   tests/metal/break_kernels.sh [NAME...]    (default: every case)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
status=0
ONLY=("$@")

# mutate NAME FILE SANITIZER PYTHON-EXPRESSION: copy the kernels, apply the
# edit to FILE (it must change the file), build and run under SANITIZER.
mutate() {
  local name="$1" file="$2" sanitizer="$3" edit="$4"
  if [ ${#ONLY[@]} -gt 0 ] && [[ ! " ${ONLY[*]} " == *" $name "* ]]; then
    return
  fi
  local kernels="$WORK/$name/kernels"
  mkdir -p "$kernels"
  cp "$ROOT"/csrc/metal/kernels/* "$kernels/"
  python3 - "$kernels/$file" "$edit" <<'PY' || { echo "the edit did not apply"; exit 2; }
import sys
path, edit = sys.argv[1], sys.argv[2]
old, new = edit.split(" ==> ")
text = open(path).read()
assert text.count(old) == 1, f"expected exactly one {old!r} in {path}"
open(path, "w").write(text.replace(old, new))
PY
  echo "=== $name: $file under $sanitizer"
  if KERNEL_DIR="$kernels" BUILD_DIR="$WORK/$name/build" \
       "$ROOT/tests/metal/run_sanitizers.sh" "$sanitizer" > "$WORK/$name/log" 2>&1; then
    echo "NOT CAUGHT: the broken kernel passed"
    status=1
  else
    echo "caught:"
    grep -m 8 -E "WARNING: ThreadSanitizer|ERROR: AddressSanitizer|FAILED|error:|^    #[0-2] .*\.metal|SUMMARY" \
      "$WORK/$name/log" | sed 's/^/  /'
  fi
}

BARRIER='threadgroup_barrier(mem_flags::mem_threadgroup);'
mutate deleted-barrier-chunk-output chunk_output.metal thread \
  "staged before any output reads it.
  $BARRIER ==> staged before any output reads it."
mutate deleted-barrier-chunk-carry chunk_carry.metal thread \
  "and every read of the entry S is done.
    $BARRIER ==> and every read of the entry S is done."
mutate widened-bound-chunk-output chunk_output.metal address \
  "e < length * p.value_dim ==> e <= length * p.value_dim"
mutate widened-bound-collect-conv-state collect_conv_state.metal address \
  "if (c >= p.conv_channels) { ==> if (c > p.conv_channels) {"
mutate host-name-macro gated_delta_common.h address \
  "#define instantiate_kernel(name, function, ...) \\
  template [[host_name(name)]] ==> #define instantiate_kernel(host_name, function, ...) \\
  template [[host_name(host_name)]]"
mutate widened-bound-boundary-states boundary_states.metal address \
  "if (row >= p.value_dim) { ==> if (row > p.value_dim) {"
mutate widened-bound-chunk-states chunk_states.metal address \
  "if (row >= p.value_dim) { ==> if (row > p.value_dim) {"
mutate deleted-barrier-recurrent-chunk-backward recurrent_chunk_backward.metal thread \
  "previous token's partial sums.
    $BARRIER ==> previous token's partial sums."
mutate widened-bound-qk-grad-reduce qk_grad_reduce.metal address \
  "if (row >= p.batch * p.tokens * p.key_heads) { ==> if (row > p.batch * p.tokens * p.key_heads) {"
mutate deleted-barrier-chunk-output-backward chunk_output_backward.metal thread \
  "dMd is complete before the products read it.
  $BARRIER ==> dMd is complete before the products read it."
mutate deleted-barrier-kkt-inverse-backward kkt_inverse_backward.metal thread \
  "X is complete before dA reads it.
  $BARRIER ==> X is complete before dA reads it."
mutate widened-bound-recompute-w-u-backward recompute_w_u_backward.metal address \
  "if (tid < length) { ==> if (tid <= length) {"
mutate deleted-barrier-chunk-carry-backward chunk_carry_backward.metal thread \
  "threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup); ==> "
mutate widened-bound-key-decayed-grams gated_delta_common.h address \
  "for (uint e = tid; e < kBlock; e += kChunkThreads) { ==> for (uint e = tid; e <= kBlock; e += kChunkThreads) {"
mutate deleted-barrier-key-decayed-grams gated_delta_common.h thread \
  "Every thread is done reading before the next columns overwrite the tiles.
    $BARRIER ==> Every thread is done reading before the next columns overwrite the tiles."
mutate widened-bound-gate-cumsum gate_cumsum.metal address \
  "if (index >= scans) { ==> if (index > scans) {"
mutate deleted-barrier-key-decayed-grams-factored gated_delta_common.h thread \
  "The factored tiles are complete before any SIMD-group reads them.
    $BARRIER ==> The factored tiles are complete before any SIMD-group reads them."
mutate wrong-reference-row-key-decayed-grams gated_delta_common.h address \
  "const uint p = s * kSub; ==> const uint p = (s - 1) * kSub;"
mutate deleted-barrier-gate-cumsum-backward gate_cumsum_backward.metal thread \
  "before the tokens' sums read its columns.
  $BARRIER ==> before the tokens' sums read its columns."
mutate deleted-barrier-channel-pairs-backward channel_pairs_backward.metal thread \
  "threadgroup_barrier(mem_flags::mem_device); ==> "
exit $status
