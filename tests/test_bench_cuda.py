"""The CUDA benchmark's pieces that need no GPU (mlx_gated_delta/bench/cuda.py): its
inputs, its table's derived figures, what a run cut short keeps, and its refusal where MLX
has no CUDA device."""

import argparse
import json
import types

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta.bench import cuda


def test_inputs_are_the_qwen3_next_shape_with_unit_q_and_k_and_decays_below_one():
    x = cuda.draw(2, 3)
    assert x["q"].shape == x["k"].shape == (2, 3, 16, 128)
    assert x["v"].shape == (2, 3, 32, 128) and x["state"].shape == (2, 32, 128, 128)
    for name in ("q", "k"):
        np.testing.assert_allclose(np.linalg.norm(x[name], axis=-1), 1.0, rtol=1e-5)
    assert (x["g"] < 0).all() and ((x["beta"] >= 0) & (x["beta"] <= 1)).all()


def test_table_derives_bandwidth_flops_and_the_ratio_to_fla_from_the_chained_time():
    record = {
        "gpu": "test",
        "copy_bandwidth_bytes_per_s": 4e12,
        "rows": [
            {
                "batch": 64,
                "tokens": 1,
                "ours": {"call_ms": 0.3, "chained_ms": 0.2, "peak_mib": 128},
                "fla_recurrent": {
                    "call_ms": 0.2,
                    "graph_ms": 0.1,
                    "peak_mib": 128,
                    "y_vs_ours": 1e-5,
                    "state_vs_ours": 1e-7,
                },
            },
            {
                "batch": 1,
                "tokens": 2048,
                "ours": {"call_ms": 3.0, "chained_ms": 2.0, "peak_mib": 99},
                "mlx_core": {"call_ms": 200.0, "chained_ms": 190.0, "peak_mib": 4000},
            },
        ],
    }
    text = cuda.table(record)
    state_bytes = 2 * 64 * 32 * 128 * 128 * 4
    assert f"{state_bytes / 0.2e-3 / 1e12:.2f} TB/s" in text
    assert f"({100 * state_bytes / 0.2e-3 / 4e12:.0f}% of copy)" in text
    assert "| 2.00x |" in text  # 0.2 ms against FLA's 0.1 ms graph replay
    flop = 8 * 2048 * 32 * 128 * 128
    assert f"{flop / 2e-3 / 1e12:.1f} TFLOP/s" in text
    assert "| 200.000 |" in text and "| n/a | 99 | n/a |" in text  # no FLA: no ratio


def test_table_gives_the_gpu_time_its_own_rate_and_ratio_to_fla():
    row = {
        "batch": 64,
        "tokens": 1,
        "ours": {"call_ms": 0.3, "chained_ms": 0.2, "gpu_ms": 0.08, "peak_mib": 128},
        "fla_recurrent": {
            "call_ms": 0.2,
            "graph_ms": 0.1,
            "peak_mib": 128,
            "y_vs_ours": 1e-5,
            "state_vs_ours": 1e-7,
        },
    }
    text = cuda.table({"gpu": "test", "copy_bandwidth_bytes_per_s": 4e12, "rows": [row]})
    state_bytes = 2 * 64 * 32 * 128 * 128 * 4
    assert "| 0.200 | 0.080 |" in text  # chained, then GPU
    assert "| 2.00x | 0.80x |" in text  # each against FLA's 0.1 ms graph replay
    per_s = state_bytes / 0.08e-3
    assert f"; GPU {per_s / 1e12:.2f} TB/s ({100 * per_s / 4e12:.0f}% of copy)" in text


def test_table_sets_the_training_step_against_fla_forward_of_the_same_length():
    record = {
        "gpu": "test",
        "copy_bandwidth_bytes_per_s": 4e12,
        "rows": [
            {
                "batch": 1,
                "tokens": 2048,
                "ours": {"call_ms": 3.0, "chained_ms": 2.0, "peak_mib": 99},
                "fla_chunk": {
                    "call_ms": 0.5,
                    "graph_ms": 0.25,
                    "peak_mib": 50,
                    "y_vs_ours": 1e-3,
                    "state_vs_ours": 1e-3,
                },
            },
            {
                "batch": 1,
                "tokens": 8192,
                "ours": {"call_ms": 9.0, "chained_ms": 8.0, "peak_mib": 1},
            },
        ],
        "training": [
            {
                "tokens": 2048,
                "ours": {"call_ms": 6.0, "chained_ms": 5.0, "peak_mib": 700},
                "ours_per_key": {"call_ms": 9.0, "chained_ms": 8.0, "peak_mib": 800},
                "ours_per_key_recurrent": {"call_ms": 12.0, "chained_ms": 11.0, "peak_mib": 600},
            },
            {"tokens": 8192, "ours": {"call_ms": 21.0, "chained_ms": 20.0, "peak_mib": 900}},
        ],
    }
    text = cuda.table(record)
    # 6 ms / 0.25 ms; the per-key step 9 ms against the scalar step's 6.
    assert "| 2048 | 6.000 | 5.000 | 700 | 0.250 | 24.0x | 9.000 | 12.000 | 800 | 1.50x |" in text
    # No FLA row there, and a record without the per-key cells.
    assert "| 8192 | 21.000 | 20.000 | 900 | n/a | n/a | n/a | n/a | n/a | n/a |" in text


def test_table_sets_per_key_rows_against_fla_chunk_kda_and_our_scalar_row():
    record = {
        "gpu": "test",
        "copy_bandwidth_bytes_per_s": 4e12,
        "rows": [
            {
                "batch": 1,
                "tokens": 2048,
                "ours": {"call_ms": 1.0, "chained_ms": 0.9, "gpu_ms": 0.6, "peak_mib": 1},
            }
        ],
        "kda": [
            {
                "tokens": 2048,
                "ours": {"call_ms": 2.0, "chained_ms": 1.8, "gpu_ms": 1.5, "peak_mib": 1},
                "fla_chunk_kda": {
                    "call_ms": 1.0,
                    "graph_ms": 0.5,
                    "peak_mib": 1,
                    "y_vs_ours": 1e-3,
                    "state_vs_ours": 2e-3,
                },
            }
        ],
    }
    text = cuda.table(record)
    # Our per-key GPU time beside our scalar row's, and 1.5 ms against FLA's 0.5 ms graph.
    assert (
        "| 2048 | 2.000 | 1.800 | 1.500 | 0.600 | 1.000 / 0.500 | 3.00x | 1.0e-03, 2.0e-03 |"
        in (text)
    )


@pytest.mark.skipif(mx.cuda.is_available(), reason="this machine has MLX's CUDA device")
def test_refuses_to_run_without_mlx_cuda():
    with pytest.raises(SystemExit, match="CUDA build"):
        cuda.run(argparse.Namespace(out="unused"))


def test_a_run_cut_short_keeps_every_row_it_measured(tmp_path, monkeypatch, capsys):
    # The GPU parts replaced: the third row never finishes (a lent GPU's time limit).
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "set_default_device", lambda device: None)
    fake_torch = types.SimpleNamespace(
        __version__="0", cuda=types.SimpleNamespace(get_device_name=lambda: "fake GPU")
    )
    monkeypatch.setattr(cuda, "_torch", lambda: fake_torch)
    monkeypatch.setattr(cuda, "_fla", lambda: None)
    monkeypatch.setattr(cuda, "copy_bandwidth", lambda: 1.0)
    measured = []

    def row(batch, tokens, fla):
        if len(measured) == 2:
            raise KeyboardInterrupt  # what a timeout's SIGINT would raise
        measured.append({"batch": batch, "tokens": tokens, "ours": {"ms": 1.0}})
        return measured[-1]

    monkeypatch.setattr(cuda, "row", row)
    with pytest.raises(KeyboardInterrupt):
        cuda.run(argparse.Namespace(out=str(tmp_path)))
    record = json.loads((tmp_path / "cuda.json").read_text())
    assert record["complete"] is False
    assert record["rows"] == measured and len(measured) == 2
    printed = [
        json.loads(line[line.index(": {") + 2 :])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("bench --cuda: B=") and ": {" in line
    ]
    assert printed == measured
    assert not (tmp_path / "cuda.md").exists()
