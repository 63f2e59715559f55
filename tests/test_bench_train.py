"""The training benchmark's formulas, skips, table and command line (no timings here)."""

import argparse

import pytest

from mlx_gated_delta import __main__ as cli
from mlx_gated_delta.bench import cli as bench_cli
from mlx_gated_delta.bench import train

GiB = 1 << 30


def test_backward_flops_of_one_full_chunk():
    # One chunk (boundary_states without the exit state), one value head,
    # L = 64, Dk = Dv = 128.
    L, D = 64, 128
    boundary = L * L * D + L**3 // 3 + 2 * L * D * L + 2 * L * D * D
    chunk_qk = L * L * D
    output = L * D * L + L * L * D + 2 * L * D * L
    carry = 6 * (2 * L * D * D)
    w_u = 2 * L * L * D + 2 * L * D * L
    kkt = 2 * L**3 + 2 * L * D * L
    one_head = boundary + chunk_qk + output + carry + w_u + kkt
    assert train.backward_product_flops(64, Hv=1) == one_head
    assert train.backward_product_flops(64) == 32 * one_head
    assert train.backward_product_flops(64, batch=3) == 3 * 32 * one_head


def test_backward_flops_add_the_exit_state_for_every_chunk_but_the_last():
    L, D = 64, 128
    one, two = (train.backward_product_flops(t, Hv=1) for t in (64, 128))
    assert two == 2 * one + 2 * D * D * L
    # A short last chunk costs less than a full one.
    assert one < train.backward_product_flops(65, Hv=1) < two


def test_io_bytes_count_inputs_outputs_and_gradients():
    inputs = train.make_inputs(8)
    T, Hk, Hv, D = 8, 16, 32, 128
    inputs_bytes = 2 * T * Hk * D * 2 + T * Hv * D * 2 + 2 * T * Hv * 4 + Hv * D * D * 4
    outputs = T * Hv * D * 2 + Hv * D * D * 4  # y, the final state
    assert train.io_bytes(inputs) == 2 * inputs_bytes + outputs


def test_peers_run_to_2048_tokens_unless_full_and_only_where_memory_allows(monkeypatch):
    monkeypatch.setattr(train, "available_memory_bytes", lambda: 80 * GiB)
    assert train.peer_skip_reason(2048, full=False) is None
    assert "--full" in train.peer_skip_reason(8192, full=False)
    assert train.peer_skip_reason(8192, full=True) is None  # about 64 GiB
    monkeypatch.setattr(train, "available_memory_bytes", lambda: 20 * GiB)
    assert "about 64 GiB, 20 GiB available" in train.peer_skip_reason(8192, full=True)
    assert train.peer_skip_reason(2048, full=True) is None  # about 16 GiB
    monkeypatch.setattr(train, "available_memory_bytes", lambda: 12 * GiB)
    assert "about 16 GiB, 12 GiB available" in train.peer_skip_reason(2048, full=False)


def _record():
    cell = {"ms": 100.0, "peak_bytes": 200 * 2**20, "repeats": 5}
    core = {
        "T": 512,
        "io_bytes": 100 * 2**20,
        "cells": {
            "ours": cell,
            "mx.fast vjp": {**cell, "ms": 3000.0, "repeats": 2},
            "mlx-lm ops": {"skipped": "skipped: T > 2048 needs --full"},
            train.PER_KEY: {**cell, "ms": 175.0},
        },
        "backward": {
            "ms": 50.0,
            "peak_bytes": 130 * 2**20,
            "scratch_bytes": 20 * 2**20,
            "product_flops": 5e9,
            "flop_per_s": 1e11,
        },
    }
    layer = {
        "T": 512,
        "io_bytes": 80 * 2**20,
        "cells": {
            "ours (patched layer)": cell,
            "mlx-lm stock layer": {**cell, "ms": 1000.0},
        },
    }
    return {
        "machine": {
            "cpu_model": "cpu",
            "cores": 2,
            "cpu_threads": 2,
            "cpu_kernel_level": "x86_64_v3",
            "load_before": 1.0,
            "load_after": 2.0,
        },
        "roofline": {"gemm": {"flop_per_s": 2e11, "n": 2048}},
        "core_rows": [core],
        "layer_rows": [layer],
    }


def test_the_table_gives_speed_ups_the_fraction_of_gemm_and_skips():
    text = train.report_text(_record())
    assert "Core op, Qwen3-Next shape (Hk=16, Hv=32, Dk=Dv=128, B=1)" in text
    assert "Whole layer (Qwen3-Next GatedDeltaNet, hidden 2048, bf16)" in text
    assert "30.0x" in text  # mx.fast: 3000 ms against 100
    assert "skipped: T > 2048 needs --full" in text
    assert "50%" in text  # 100 GFLOP/s of a 200 GFLOP/s roofline
    assert "1.50" in text  # peak 130 MiB + 20 MiB of scratch over 100 MiB of inputs and outputs
    assert "10.0x" in text  # the layer: 1000 ms against 100
    assert "2.50" in text  # the layer: peak 200 MiB over 80 MiB of io
    assert "1.75x" in text  # per-key gates: 175 ms against the scalar gates' 100


def test_layer_io_bytes_count_input_output_and_the_trainable_parameters_twice():
    import mlx.core as mx
    import mlx.nn as nn

    layer = nn.Linear(4, 3)  # weight 12 floats, bias 3
    layer.freeze(keys=["bias"])
    x = mx.zeros((1, 2, 4))
    assert train.layer_io_bytes(layer, x) == 2 * (2 * 4 * 4) + 2 * (12 * 4)


def test_bench_train_flag_delegates_to_the_training_benchmark(monkeypatch):
    seen = {}
    monkeypatch.setattr(train, "run", lambda args: seen.setdefault("args", args))
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--train", "--quick"])
    bench_cli.run(args)
    assert seen["args"].train and seen["args"].quick
    assert not parser.parse_args([]).train


@pytest.mark.parametrize("argv", (["bench", "--train", "--help"],))
def test_the_cli_lists_the_train_flag(argv, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "--train" in capsys.readouterr().out


def test_bench_train_filter_selects_core_rows_and_leaves_the_layer_out(monkeypatch, tmp_path):
    seen = {}
    record = _record()

    def core_rows(tokens_list, quick, full, progress):
        seen["core"] = list(tokens_list)
        return record["core_rows"]

    def layer_rows(tokens_list, quick, full, progress):
        seen["layer"] = list(tokens_list)
        return record["layer_rows"]

    monkeypatch.setattr(train, "core_rows", core_rows)
    monkeypatch.setattr(train, "layer_rows", layer_rows)
    monkeypatch.setattr(train, "measure_rooflines", lambda: record["roofline"])
    monkeypatch.setattr(train, "best_rooflines", lambda before, after: before)
    monkeypatch.setattr(train, "cpu_run_record", lambda load: {"machine": record["machine"]})
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    out = str(tmp_path)
    filtered = train.run(parser.parse_args(["--train", "--filter", "T=8192", "--out", out]))
    assert seen == {"core": [8192]}
    assert filtered["layer_rows"] == []
    assert (
        (tmp_path / "train_results.txt")
        .read_text()
        .rstrip()
        .endswith("whole-layer benchmark: not run with --filter")
    )
    train.run(parser.parse_args(["--train", "--quick", "--out", out]))
    assert seen == {"core": [512, 2048], "layer": [512, 2048]}
    with pytest.raises(SystemExit, match="no training row matches"):
        train.run(parser.parse_args(["--train", "--quick", "--filter", "T=8192", "--out", out]))
