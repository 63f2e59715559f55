#!/usr/bin/env bash
# Builds the Metal emulator with ThreadSanitizer and with AddressSanitizer and
# runs tests/metal/sanitizer_driver.cpp (a few shapes through every kernel).
# Needs only g++ (with its libtsan/libasan) and python3. Minutes on 2 cores.
#
#   tests/metal/run_sanitizers.sh [thread] [address]    (default: both)
#
# KERNEL_DIR overrides the .metal sources (tests/metal/break_kernels.sh builds
# deliberately broken copies with it); BUILD_DIR the build directory.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
KERNEL_DIR="${KERNEL_DIR:-$ROOT/csrc/metal/kernels}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/sanitizers}"
CXX="${CXX:-g++}"
SANITIZERS=("$@")
[ ${#SANITIZERS[@]} -eq 0 ] && SANITIZERS=(thread address)

KERNELS=(recurrent qk_norm gate_cumsum k_gram kkt_inverse recompute_w_u chunk_qk chunk_carry
         chunk_output prepare_conv prepare_gates collect_conv_state gated_norm boundary_states
         chunk_states recurrent_chunk_backward qk_grad_reduce chunk_output_backward chunk_carry_backward
         recompute_w_u_backward kkt_inverse_backward gate_cumsum_backward
         channel_pairs_backward)
EMULATOR="$ROOT/csrc/metal/emulator"

for sanitizer in "${SANITIZERS[@]}"; do
  out="$BUILD_DIR/$sanitizer"
  mkdir -p "$out"
  sources=("$EMULATOR/runtime.cpp" "$EMULATOR/dispatch.cpp" "$EMULATOR/executor.cpp"
           "$ROOT"/csrc/metal/plan/*.cpp "$ROOT/csrc/core/core_params.cpp"
           "$ROOT/csrc/core/dispatch.cpp" "$ROOT/csrc/validation/extents.cpp"
           "$ROOT/tests/metal/sanitizer_driver.cpp")
  for name in "${KERNELS[@]}"; do
    python3 "$EMULATOR/prep_metal.py" "$KERNEL_DIR/$name.metal" "$out/$name.cpp"
    sources+=("$out/$name.cpp")
  done
  flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer "-fsanitize=$sanitizer" -Wno-attributes
         -I"$EMULATOR/include" -I"$EMULATOR" -I"$KERNEL_DIR" -I"$ROOT/csrc")
  echo "== building the emulator with -fsanitize=$sanitizer"
  # Two compilers at a time (2 cores); each object is rebuilt only when its source is newer.
  # Objects are named by folder and file (core/dispatch.cpp and emulator/dispatch.cpp both exist).
  printf '%s\n' "${sources[@]}" | xargs -P 2 -I{} sh -c '
    object="$0/$(basename "$(dirname "{}")")_$(basename "{}" .cpp).o"
    if [ ! -f "$object" ] || [ "{}" -nt "$object" ] || [ -n "$1" ]; then
      '"$CXX"' '"${flags[*]}"' -c "{}" -o "$object"
    fi' "$out" "${FORCE_REBUILD:-}"
  objects=()
  for source in "${sources[@]}"; do
    objects+=("$out/$(basename "$(dirname "$source")")_$(basename "$source" .cpp).o")
  done
  "$CXX" "-fsanitize=$sanitizer" "${objects[@]}" -o "$out/sanitizer_driver" -lpthread
  echo "== running the driver under -fsanitize=$sanitizer"
  TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}" \
  ASAN_OPTIONS="halt_on_error=1 detect_leaks=1 ${ASAN_OPTIONS:-}" \
    "$out/sanitizer_driver"
done
echo "sanitizers clean: ${SANITIZERS[*]}"
