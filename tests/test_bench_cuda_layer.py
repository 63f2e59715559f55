"""The whole-layer rows of ``bench --cuda`` (mlx_gated_delta/bench/cuda_layer.py): the
table they print, from a record (the rows themselves run on the GPU machine)."""

from mlx_gated_delta.bench import cuda_layer
from mlx_gated_delta.layers import token_blocks


def test_table_lists_every_forward_and_training_row_with_its_speed_up():
    record = {
        "forward": [
            {"shape": "bf16 B=1 T=1 decode", "ours_ms": 0.5, "mlx_lm_ms": 1.0, "speedup": 2.0},
            {"shape": "bf16 B=1 T=2048 prefill", "ours_ms": 4.0, "mlx_lm_ms": 300.0, "speedup": 75},
        ],
        "training": [
            {
                "T": 2048,
                "ours": {"ms": 20.0, "peak_mib": 900.0},
                "mlx-lm": {"ms": 2000.0, "peak_mib": 9000.0},
                "speedup": 100.0,
            }
        ],
    }
    text = cuda_layer.table(record)
    assert "| bf16 B=1 T=1 decode | 0.50 | 1.00 | 2.0x |" in text
    assert "| bf16 B=1 T=2048 prefill | 4.00 | 300.00 | 75.0x |" in text
    assert (
        "| training step B=1 T=2048 | 20.00 (peak 900 MiB) | 2000.00 (peak 9000 MiB) | 100.0x |"
        in text
    )
    assert "one call" not in text  # a record from before the one-call column


def test_table_compares_the_step_in_token_blocks_with_one_call():
    record = {
        "forward": [],
        "training": [
            {
                "T": 2048,
                "ours": {"ms": 24.0, "peak_mib": 300.0},
                "ours, one call": {"ms": 20.0, "peak_mib": 900.0},
                "mlx-lm": {"ms": 2000.0, "peak_mib": 9000.0},
                "speedup": 2000.0 / 24.0,
            }
        ],
    }
    text = cuda_layer.table(record)
    assert "| training step B=1 T=2048 | 24.00 (300) | 20.00 (900) | 1.20x |" in text


def test_one_call_runs_the_step_without_token_blocks_and_restores_the_default():
    seen = []

    def step(x):
        seen.append(token_blocks.TOKEN_BLOCK)
        return x

    default = token_blocks.TOKEN_BLOCK
    assert cuda_layer.in_one_call(step)(3) == 3
    assert seen == [None]
    assert token_blocks.TOKEN_BLOCK == default


def test_table_compares_the_segments_kernels_with_the_segment_as_ops():
    record = {
        "forward": [
            {
                "shape": "bf16 B=1 T=1 decode",
                "ours_ms": 0.5,
                "segment_as_ops_ms": 0.75,
                "mlx_lm_ms": 1.0,
                "speedup": 2.0,
            }
        ],
        "training": [],
    }
    lines = cuda_layer.table(record).splitlines()
    header = lines.index("| rows | kernels ms | as ops ms | ratio |")
    assert lines[header - 1] == "" and lines[header + 1] == "|---|---|---|---|"
    assert lines[header + 2] == "| bf16 B=1 T=1 decode | 0.50 | 0.75 | 1.5x |"
