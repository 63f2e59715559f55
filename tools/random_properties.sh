#!/usr/bin/env bash
# The property suites of the core op (oracle, split, checkpoints, per-key
# gates), the segment and the gradients, drawn at random: the `random`
# Hypothesis profile (mlx_gated_delta/testing/strategies.py), one pytest run
# per seed, MLX_GATED_DELTA_EXAMPLES examples per property (default 500).
#
#   bash tools/random_properties.sh            # seeds 1, 2 and 3
#   bash tools/random_properties.sh 17 42      # the seeds given
#
# CI's derandomized profile draws the same cases every run; these runs show
# that the properties hold for other draws too. A failure prints its example
# and a @reproduce_failure blob.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITES=(
  mlx_gated_delta/tests/test_core.py
  mlx_gated_delta/tests/test_checkpoints.py
  mlx_gated_delta/tests/test_per_key.py
  mlx_gated_delta/tests/test_segment.py
  mlx_gated_delta/tests/test_core_gradients.py
  mlx_gated_delta/tests/test_segment_gradients.py
)
seeds=("$@")
if [ ${#seeds[@]} -eq 0 ]; then seeds=(1 2 3); fi
export MLX_GATED_DELTA_HYPOTHESIS_PROFILE=random
export MLX_GATED_DELTA_EXAMPLES="${MLX_GATED_DELTA_EXAMPLES:-500}"
status=0
for seed in "${seeds[@]}"; do
  echo "== seed $seed, $MLX_GATED_DELTA_EXAMPLES examples per property"
  pytest -q -p no:cacheprovider --hypothesis-seed="$seed" "${SUITES[@]}" || status=1
done
exit $status
