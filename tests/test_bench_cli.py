"""The benchmark's formulas, tables and robustness, and the command line (no timings here)."""

import argparse
import ast
import dataclasses
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_gated_delta
from mlx_gated_delta import __main__ as cli
from mlx_gated_delta.bench import cli as bench_cli
from mlx_gated_delta.bench import contended, layer, machine, op, shapes, timing

QWEN_DECODE = shapes.qwen3_next(B=8, T=1, dtype="float32")
QWEN_PREFILL_BF16 = shapes.qwen3_next(B=1, T=2048, dtype="bfloat16")
ROOFLINE = {"copy": {"bytes_per_s": 20e9}, "gemm": {"flop_per_s": 200e9}}


def test_work_counts_eight_flop_per_state_element_and_token():
    assert shapes.work_flop(QWEN_PREFILL_BF16) == 8 * 1 * 2048 * 32 * 128 * 128


def test_state_traffic_reads_and_writes_the_float32_state_once():
    assert shapes.state_traffic_bytes(QWEN_DECODE) == 2 * 8 * 32 * 128 * 128 * 4


def test_io_bytes_count_activations_at_their_dtype_and_gates_and_state_in_float32():
    s = QWEN_PREFILL_BF16
    activations = (2 * 2048 * 16 * 128 + 2 * 2048 * 32 * 128) * 2  # q, k, v, y in bf16
    gates = 2 * 2048 * 32 * 4  # g and beta
    state = 2 * 32 * 128 * 128 * 4  # read and written
    assert shapes.io_bytes(s) == activations + gates + state


def test_quick_mode_runs_the_qwen3_next_rows_up_to_2048_in_both_dtypes():
    rows = shapes.benchmark_shapes(quick=True)
    assert sorted((s.dtype, s.T) for s in rows) == sorted(
        (d, T) for d in ("bfloat16", "float32") for T in (1, 64, 512, 2048)
    )
    assert {(s.B, s.Hk, s.Hv, s.Dk, s.Dv) for s in rows} == {(1, 16, 32, 128, 128)}


def test_the_default_rows_are_the_qwen3_next_shape_and_one_size_changed_from_it():
    rows = shapes.benchmark_shapes(quick=False)
    assert len(rows) == 17
    assert {(s.Hk, s.Hv, s.Dk, s.Dv) for s in rows if s.family == "qwen3-next"} == {
        (16, 32, 128, 128)
    }
    assert [s for s in rows if s.family != "qwen3-next"] == [
        shapes.Shape("Dk=Dv=64", 1, 2048, Hk=16, Hv=32, Dk=64, Dv=64, dtype="float32"),
        shapes.Shape("Dk=96", 1, 2048, Hk=16, Hv=32, Dk=96, Dv=128, dtype="float32"),
        shapes.Shape("Hk=Hv", 1, 2048, Hk=32, Hv=32, Dk=128, Dv=128, dtype="float32"),
    ]
    assert shapes.QWEN3_NEXT.text() == "Hk=16 Hv=32 Dk=Dv=128"
    assert vars(shapes.QWEN3_NEXT_LAYER) == dict(
        hidden_size=2048,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )


def test_kda_rows_are_kimi_linear_shapes_with_per_key_gates_counted_in_io():
    rows = shapes.kda_shapes(quick=True)
    assert sorted((s.dtype, s.T, s.per_key) for s in rows) == sorted(
        (d, T, per_key) for d in ("bfloat16", "float32") for T in (1, 512) for per_key in (0, 1)
    )
    assert {(s.B, s.Hk, s.Hv, s.Dk, s.Dv) for s in rows} == {(1, 32, 32, 128, 128)}
    assert {s.family for s in rows if s.per_key} == {"kimi-linear-kda"}
    s = shapes.kimi_linear(B=1, T=512, dtype="float32", per_key=True)
    scalar = shapes.kimi_linear(B=1, T=512, dtype="float32", per_key=False)
    # g is read per key channel: Dk - 1 more float32 values per token and head.
    assert shapes.io_bytes(s) - shapes.io_bytes(scalar) == 512 * 32 * 127 * 4


def test_kda_inputs_give_every_implementation_the_same_per_key_problem():
    # A small per-key row run end to end: each implementation that runs
    # (mlx-lm's ops, ours; MLX core where it takes a vector gate) computes
    # the same y as the first, so the rows time one problem.
    s = shapes.Shape("kda-small", 1, 9, Hk=2, Hv=2, Dk=32, Dv=16, dtype="float32", per_key=True)
    x = op.make_inputs(s, state_count=1)
    assert x.g.shape == (1, 9, 2, 32) and x.gamma.shape == (1, 9, 2, 32)
    budget = timing.Budget(seconds=0.01, max_repeats=1)
    progress = timing.Progress(total=len(op.IMPLEMENTATIONS) + 1)
    row = op.benchmark_row(s, 0, False, budget, progress)
    ran = {n: r for n, r in row["results"].items() if r["status"] == "ok"}
    assert {"mlx_lm", "recurrent", "chunked", "auto"} <= set(ran)
    for result in ran.values():
        assert result["max_rel_diff_vs_reference"] < 1e-5


def test_peers_are_skipped_beyond_2048_tokens_unless_full():
    long = shapes.qwen3_next(B=1, T=8192, dtype="float32")
    plenty = 1 << 40
    for peer in op.PEERS:
        assert "--full" in op.skip_reason(peer, long, full=False, available=plenty)
        assert op.skip_reason(peer, long, full=True, available=plenty) is None
    assert op.skip_reason("auto", long, full=False, available=plenty) is None


def test_peers_are_skipped_when_their_per_token_states_would_not_fit_in_memory():
    s = shapes.qwen3_next(B=1, T=2048, dtype="bfloat16")
    needed = op.peer_memory_bytes(s)
    assert needed == 2048 * 32 * 128 * 128 * 4
    assert op.skip_reason("mlx_core", s, full=True, available=2 * needed) is None
    assert "GiB available" in op.skip_reason("mlx_core", s, full=True, available=needed)
    assert op.skip_reason("chunked", s, full=True, available=needed) is None


def test_repeats_fit_the_budget_and_never_drop_below_one():
    budget = timing.Budget(seconds=1.0, max_repeats=5)
    assert timing.repeats_within(budget, warm_up_seconds=0.3) == 3
    assert timing.repeats_within(budget, warm_up_seconds=0.001) == 5
    assert timing.repeats_within(budget, warm_up_seconds=4.0) == 1


def test_timed_calls_take_turns_each_with_its_arguments_prepared_before_it():
    runs, rounds = [], []
    prepared = iter(range(100))

    def call(name):
        return lambda argument: runs.append((name, argument))

    times = timing.time_rounds(
        {"a": call("a"), "b": call("b")},
        {"a": 3, "b": 1},
        prepare=lambda: (next(prepared),),
        on_round=lambda i, n: rounds.append((i, n)),
    )
    # The warm-ups, then round 1 of both, then a alone.
    assert runs == [("a", 0), ("b", 1), ("a", 2), ("b", 3), ("a", 4), ("a", 5)]
    assert rounds == [(0, 3), (1, 3), (2, 3)]
    assert [len(times["a"]), len(times["b"])] == [3, 1]
    assert all(t >= 0 for t in times["a"] + times["b"])


def test_a_timed_call_that_fails_is_dropped_and_the_others_go_on():
    runs = []

    def breaks_on_its_second_run():
        runs.append("breaks")
        if len(runs) == 2:
            raise RuntimeError("second run")

    calls = {"ok": lambda: None, "breaks": breaks_on_its_second_run}
    errors = []
    times = timing.time_rounds(
        calls, 3, warm_up=False, on_error=lambda name, error: errors.append((name, str(error)))
    )
    assert len(times["ok"]) == 3 and len(times["breaks"]) == 1 and len(runs) == 2
    assert errors == [("breaks", "second run")]
    runs.clear()
    with pytest.raises(RuntimeError, match="second run"):  # without on_error
        timing.time_rounds(calls, 3, warm_up=False)


def test_the_higher_roofline_measurement_is_the_one_used():
    slow = {"copy": {"bytes_per_s": 10e9}, "gemm": {"flop_per_s": 300e9}}
    fast = {"copy": {"bytes_per_s": 25e9}, "gemm": {"flop_per_s": 100e9}}
    best = machine.best_rooflines(slow, fast)
    assert best["copy"]["bytes_per_s"] == 25e9
    assert best["gemm"]["flop_per_s"] == 300e9


def test_format_table_pads_columns_and_right_aligns_numbers():
    table = op.format_table(["shape", "ms"], [["a", "1.5"], ["longer", "12"]])
    assert table.splitlines() == [
        "shape    ms",
        "------  ---",
        "a       1.5",
        "longer   12",
    ]


def _row(shape, seconds):
    results = {}
    for name, value in seconds.items():
        if value == "error":
            results[name] = {"status": "error", "error": "RuntimeError: boom"}
        elif value == "skipped":
            results[name] = {"status": "skipped", "reason": "not run"}
        else:
            results[name] = {"status": "ok", "median_s": value, "peak_allocated_bytes": 3 << 20}
    row = {
        "label": shape.label,
        "shape": dataclasses.asdict(shape),
        "io_bytes": shapes.io_bytes(shape),
        "results": results,
    }
    op.add_derived_figures(row, shape, ROOFLINE)
    return row


def test_derived_figures_and_prefill_table_cells():
    row = _row(
        QWEN_PREFILL_BF16,
        {"mlx_core": 3.0, "mlx_lm": "error", "recurrent": 0.2, "chunked": 0.1, "auto": 0.11},
    )
    d = row["derived"]
    assert d["speedup_vs_mlx_core"] == pytest.approx(3.0 / 0.11)
    assert "speedup_vs_mlx_lm" not in d
    assert d["tokens_per_s"] == pytest.approx(2048 / 0.11)
    assert d["gflop_per_s"] == pytest.approx(shapes.work_flop(QWEN_PREFILL_BF16) / 0.11 / 1e9)
    assert d["auto_over_best_algorithm"] == pytest.approx(0.1)

    _, _, line = op.results_table([row], decode=False).splitlines()
    assert line.startswith("qwen3-next bf16 B=1 T=2048")
    assert line.split()[4:9] == ["3000", "err", "200", "100", "110"]  # core .. auto, ms
    assert "+10%" in line
    assert f"{100 * d['fraction_of_gemm']:.0f}" in line.split()


def test_decode_table_reports_state_bandwidth_and_skips():
    row = _row(
        QWEN_DECODE,
        {
            "mlx_core": "skipped",
            "mlx_lm": 0.004,
            "recurrent": 0.002,
            "chunked": 0.003,
            "auto": 0.002,
        },
    )
    d = row["derived"]
    assert d["state_gb_per_s"] == pytest.approx(
        shapes.state_traffic_bytes(QWEN_DECODE) / 0.002 / 1e9
    )
    assert d["fraction_of_copy"] == pytest.approx(d["state_gb_per_s"] * 1e9 / 20e9)
    table = op.results_table([row], decode=True)
    assert "state GB/s" in table and "skip" in table
    assert op.results_table([row], decode=False).count("\n") == 1  # header and rule only


def test_a_failing_implementation_is_recorded_and_the_row_still_completes(monkeypatch):
    real = op.implementation_call

    def failing_chunked(name):
        if name == "chunked":

            def fail(x, state):
                raise RuntimeError("chunked exploded")

            return fail
        return real(name)

    monkeypatch.setattr(op, "implementation_call", failing_chunked)
    tiny = shapes.Shape("tiny", B=1, T=5, Hk=1, Hv=2, Dk=8, Dv=8, dtype="float32")
    progress = timing.Progress(total=len(op.IMPLEMENTATIONS) + 1)
    row = op.benchmark_row(
        tiny,
        pool_bytes=0,
        full=False,
        budget=timing.Budget(seconds=0.0, max_repeats=1),
        progress=progress,
    )
    progress.close()
    op.add_derived_figures(row, tiny, ROOFLINE)
    assert row["results"]["chunked"] == {
        "status": "error",
        "error": "RuntimeError: chunked exploded",
    }
    assert row["results"]["auto"]["status"] == "ok"
    assert "err" in op.results_table([row], decode=False)
    # Every implementation that ran computed the same outputs on the same inputs.
    for name, result in row["results"].items():
        if result["status"] == "ok":
            assert result["max_rel_diff_vs_reference"] < 1e-5, name


def test_decode_rows_compare_implementations_on_the_same_state_and_time_on_rotated_ones():
    tiny_decode = shapes.Shape("tiny", B=2, T=1, Hk=1, Hv=2, Dk=8, Dv=8, dtype="float32")
    pool = 6 * shapes.state_bytes(tiny_decode)
    progress = timing.Progress(total=len(op.IMPLEMENTATIONS) + 1)
    row = op.benchmark_row(
        tiny_decode,
        pool_bytes=pool,
        full=False,
        budget=timing.Budget(seconds=0.0, max_repeats=1),
        progress=progress,
    )
    progress.close()
    assert row["rotated_states"] == 6
    for name, result in row["results"].items():
        assert result["status"] == "ok", name
        assert result["max_rel_diff_vs_reference"] < 1e-5, name


def test_layer_rows_come_from_the_layer_benchmark(monkeypatch):
    seen = {}

    def run_layer_benchmark(quick, progress=None):
        seen["quick"] = quick
        progress("layer decode B=1")
        return [
            {
                "name": "decode",
                "shape": "B=1 T=1",
                "ours_ms": 1.5,
                "mlx_lm_ms": 6.0,
                "speedup": 4.0,
            },
            {
                "name": "prefill",
                "shape": "B=1 T=2048",
                "ours_ms": 1410.4,
                "mlx_lm_ms": 47512.0,
                "speedup": 33.7,
            },
        ]

    monkeypatch.setattr(layer, "run_layer_benchmark", run_layer_benchmark)
    progress = timing.Progress(total=1)
    rows, note = bench_cli.run_layer_rows(quick=True, progress=progress)
    progress.close()
    assert seen == {"quick": True} and note is None
    lines = op.layer_table(rows).splitlines()
    assert lines[2].split() == ["decode", "B=1", "T=1", "1.5", "6", "4.0"]
    assert lines[3].split() == ["prefill", "B=1", "T=2048", "1410", "47512", "33.7"]


def test_a_failing_layer_benchmark_becomes_a_note(monkeypatch):
    def run_layer_benchmark(quick, progress=None):
        raise RuntimeError("no layer today")

    monkeypatch.setattr(layer, "run_layer_benchmark", run_layer_benchmark)
    rows, note = bench_cli.run_layer_rows(quick=True, progress=lambda label: None)
    assert rows is None and "RuntimeError: no layer today" in note


def parse_bench(argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_kda_layer_rows_are_both_layers_prefill_and_training_by_mode():
    def rows(quick, full):
        return {(r.family, r.mode, r.T) for r in layer.core_op_layer_rows(quick, full)}

    families = ("kimi_linear", "olmo_hybrid")
    default = {(f, mode, T) for f in families for mode in ("prefill", "train") for T in (512, 2048)}
    assert rows(quick=False, full=False) == default
    assert rows(quick=True, full=False) == default - {(f, "train", 2048) for f in families}
    long = {(f, mode, 8192) for f in families for mode in ("prefill", "train")}
    assert rows(quick=False, full=True) == default | long
    assert all(r.stock_repeats == 1 for r in layer.core_op_layer_rows(True, False))
    row = layer.CoreOpRow("kimi_linear", "prefill", 2048, 5, 2)
    assert row.label == "kimi_linear bf16 B=1 T=2048 prefill"


def test_kda_layers_flag_runs_the_core_op_layer_rows_its_filter_selects(monkeypatch, tmp_path):
    seen = []

    def run_core_op_layer_benchmark(rows, progress=None):
        seen.extend(rows)
        return [
            {
                "name": "Kimi",
                "shape": r.label,
                "mode": r.mode,
                "T": r.T,
                "ours_ms": 100.0,
                "mlx_lm_ms": 1500.0,
                "speedup": 15.0,
                "ours_peak_bytes": 3 << 20,
                "mlx_lm_peak_bytes": 7 << 20,
                "mlx_lm_note": None,
            }
            for r in rows
        ]

    monkeypatch.setattr(layer, "run_core_op_layer_benchmark", run_core_op_layer_benchmark)
    args = parse_bench(["--kda-layers", "--filter", "kimi.*T=2048 prefill", "--out", str(tmp_path)])
    record = bench_cli.run(args)
    assert [r.label for r in seen] == ["kimi_linear bf16 B=1 T=2048 prefill"]
    assert record["rows"][0]["speedup"] == 15.0
    text = (tmp_path / "layers_results.txt").read_text()
    assert text.splitlines()[-1].split() == [
        "Kimi",
        "prefill",
        "2048",
        "100",
        "1500",
        "15.0x",
        "3",
        "7",
        "-",
    ]
    assert (tmp_path / "layers_results.json").exists()
    with pytest.raises(SystemExit, match="no layer row matches"):
        bench_cli.run(parse_bench(["--kda-layers", "--filter", "qwen", "--out", str(tmp_path)]))


def test_the_kda_layer_table_says_why_mlx_lm_was_not_trained():
    row = {
        "name": "OLMo",
        "shape": "olmo_hybrid bf16 B=1 T=2048 train",
        "mode": "train",
        "T": 2048,
        "ours_ms": 900.0,
        "ours_peak_bytes": 5 << 20,
        "io_bytes": 2 << 20,
        "speedup": None,
        "mlx_lm_note": "skipped: needs about 16 GiB, 9 available",
    }
    lines = layer.core_op_layer_table([row]).splitlines()
    assert lines[2].split() == ["OLMo", "train", "2048", "900", "-", "-", "5", "-", "2.50x"]
    assert (
        lines[3]
        == "olmo_hybrid bf16 B=1 T=2048 train: mlx-lm skipped: needs about 16 GiB, 9 available"
    )


@pytest.mark.parametrize("family", sorted(layer.CORE_OP_LAYERS))
def test_the_kda_layer_rows_time_ours_and_mlx_lms_layer_with_the_same_weights(family, monkeypatch):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # Small heads (the rows' own shape takes seconds per mlx-lm call).
    name, args = layer.CORE_OP_LAYERS[family]
    small = argparse.Namespace(**vars(args))
    small.hidden_size = 64
    if family == "kimi_linear":
        small.linear_attn_config = dict(num_heads=2, head_dim=32, short_conv_kernel_size=4)
    else:
        small.linear_num_key_heads = small.linear_num_value_heads = 2
        small.linear_key_head_dim = small.linear_value_head_dim = 32
    monkeypatch.setitem(layer.CORE_OP_LAYERS, family, (name, small))
    ours, stock = layer.core_op_layers(family)
    theirs = dict(tree_flatten(stock.parameters()))
    mine = dict(tree_flatten(ours.parameters()))
    assert mine.keys() == theirs.keys()
    assert all(
        mine[k].dtype == mx.bfloat16 or not mx.issubdtype(mine[k].dtype, mx.floating) for k in mine
    )
    assert all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    for mode in ("prefill", "train"):
        result = layer.time_core_op_row(layer.CoreOpRow(family, mode, 8, 2, 1), ours, stock)
        assert result["name"] == name and result["mlx_lm_note"] is None
        assert result["ours_ms"] > 0 and result["mlx_lm_ms"] > 0
        assert result["speedup"] == result["mlx_lm_ms"] / result["ours_ms"]
        assert result["ours_peak_bytes"] > 0 and result["mlx_lm_peak_bytes"] > 0
        if mode == "train":
            assert result["io_bytes"] == layer.layer_io_bytes(
                ours, mx.zeros((1, 8, 64), mx.bfloat16)
            )
        else:
            assert result["io_bytes"] is None


def test_mlx_lms_layer_is_not_trained_above_2048_tokens():
    assert layer.stock_training_skip_reason(8192).startswith("not trained above T=2048")


def test_progress_bar_without_tqdm_draws_its_own_on_stderr(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `from tqdm import tqdm` fail
    progress = timing.Progress(total=4)
    progress("first step")
    progress.advance()
    progress("second step")
    progress.close()
    err = capsys.readouterr().err
    assert "0/4" in err and "first step" in err
    assert "1/4" in err and "second step" in err
    assert "[" + "#" * 7 + "." in err  # a quarter of the 30-character bar


def _package_imports() -> dict[str, set[str]]:
    """Each module of the installed package and the package's modules it imports, anywhere in
    its source (lazy imports in functions too), read from the source rather than imported.

    ``from P import n`` imports the module P.n when there is one, else P (its __init__)."""
    root = Path(mlx_gated_delta.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    module = f"{base}.{alias.name}"
                    found.add(module if module in paths else base)
        graph[name] = found & paths.keys()
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that importing ``start`` imports, directly or not."""
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_the_benchmarks_import_one_another_without_a_cycle():
    graph = _package_imports()
    assert {"mlx_gated_delta.bench.cli", "mlx_gated_delta.bench.train"} <= graph.keys()
    for name in graph:
        if name.startswith("mlx_gated_delta.bench"):
            back = sorted(m for m in graph[name] if name in _reachable(graph, m) | {m})
            assert not back, f"{name} imports {back}, which import {name} again"


def test_cli_help_exits_zero_and_lists_the_commands(tmp_path):
    # Run outside the checkout: `python -m` puts the working directory first on the path,
    # and the checkout's package has no compiled extension.
    done = subprocess.run(
        [sys.executable, "-m", "mlx_gated_delta", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    for command in ("demo", "bench", "selftest"):
        assert command in done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--no-such-option"],
        ["bench", "--filter", "T=("],
        ["bench", "--contended", "-2"],
        ["bench", "--kda-layers", "--filter", "T=("],
        ["selftest", "--examples", "0"],
    ],
)
def test_cli_rejects_bad_arguments_with_a_usage_error(argv):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2


def test_selftest_without_hypothesis_asks_for_the_test_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # makes `import hypothesis` fail
    assert cli.run_selftest(examples=None) == 2
    assert 'pip install "mlx-gated-delta[test]"' in capsys.readouterr().err


def test_selftest_runs_every_shipped_suite():
    import mlx_gated_delta.tests as suites

    shipped = {
        f"{suites.__name__}.{module.name}"
        for module in pkgutil.iter_modules(suites.__path__)
        if module.name.startswith("test_")
    }
    assert shipped and set(cli.PROPERTY_MODULES) == shipped


def test_selftest_says_fail_when_the_properties_do_not_run(monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROPERTY_MODULES", {"mlx_gated_delta.tests.no_such_module": "x"})
    # selftest sets the Hypothesis profile variable; restore it for the tests after this one
    monkeypatch.delenv("MLX_GATED_DELTA_HYPOTHESIS_PROFILE", raising=False)
    assert cli.run_selftest(examples=None) == 1
    out = capsys.readouterr().out
    assert "default device" in out and "selftest FAIL" in out


FAKE_PROPERTY_MODULES = {
    "passing": "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
    "failing": "def test_passes():\n    pass\n\ndef test_fails():\n    assert False\n",
    "skipped": "import pytest\n"
    "pytest.importorskip('selftest_no_such_dependency', reason='no dependency here')\n",
}


def use_fake_property_modules(monkeypatch, tmp_path, test_name, kinds):
    """selftest runs these fake modules instead of the package's (module names unique to
    the test: pytest refuses a module name already imported from another directory)."""
    modules = {}
    for kind in kinds:
        module = f"selftest_fake_{test_name}_{kind}"
        (tmp_path / f"{module}.py").write_text(FAKE_PROPERTY_MODULES[kind])
        modules[module] = kind
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setattr(cli, "PROPERTY_MODULES", modules)
    # selftest sets the Hypothesis profile variable; restore it for the tests after this one
    monkeypatch.delenv("MLX_GATED_DELTA_HYPOTHESIS_PROFILE", raising=False)


def test_selftest_verdict_counts_the_tests_of_each_module(tmp_path, monkeypatch, capsys):
    use_fake_property_modules(monkeypatch, tmp_path, "counts", ("passing", "failing", "skipped"))
    assert cli.run_selftest(examples=None) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("selftest FAIL on ")
    assert (
        "passing: 2 passed; failing: 1 passed, 1 failed; skipped: skipped (no dependency here)"
    ) in verdict


def test_selftest_passes_with_a_module_skipped_as_a_whole(tmp_path, monkeypatch, capsys):
    # The layer's properties without mlx-lm: skipped, with the reason, and no failure.
    use_fake_property_modules(monkeypatch, tmp_path, "skip", ("passing", "skipped"))
    assert cli.run_selftest(examples=None) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("selftest PASS on ")
    assert "passing: 2 passed; skipped: skipped (no dependency here)" in verdict


def test_examples_count_reaches_tests_already_decorated_by_given():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    calls = []

    @settings(max_examples=50, database=None)
    @given(st.integers())
    def property_under_test(n):
        calls.append(n)

    class Item:
        obj = property_under_test

    plugin = cli._ExamplesPerProperty(3)
    plugin.pytest_collection_modifyitems([Item(), Item()])  # e.g. two parametrized items
    property_under_test()
    assert len(plugin.tests) == 1
    assert 1 <= len(calls) <= 3


def test_busy_processes_are_killed_when_the_block_raises():
    with pytest.raises(RuntimeError), contended.busy_processes(2) as processes:
        assert len(processes) == 2
        assert all(p.poll() is None for p in processes)
        raise RuntimeError("a row failed")
    assert all(p.poll() is not None for p in processes)


@pytest.mark.parametrize(
    ("argv", "busy"),
    [
        ([], None),
        (["--contended"], bench_cli.ONE_PER_USABLE_CPU),
        (["--contended", "3"], 3),
        (["--contended", "0"], 0),
    ],
)
def test_contended_takes_an_optional_count_of_busy_processes(argv, busy):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert parser.parse_args(argv).contended == busy


def test_contended_report_gives_each_row_against_its_peer():
    record = {
        "machine": {"cpu_model": "cpu"},
        "usable_cpus": 2,
        "thread_count": 2,
        "cpu_kernel_level": "x86_64_v3",
        "busy_processes": 2,
        "load_average_1min_before": 2.0,
        "load_average_1min_after": 4.0,
        "rows": [
            {
                "name": "op decode",
                "peer": "MLX core",
                "ours_ms": 0.5,
                "peer_ms": 2.0,
                "speedup": 4.0,
                "eval_floor_ms": 0.125,
            }
        ],
        "notes": ["a note"],
    }
    text = contended.report_text(record)
    assert "2 usable CPUs, our pool 2 threads, kernels x86_64_v3; 2 busy processes" in text
    assert "op decode" in text and "MLX core" in text and "4.00x" in text
    assert "op decode: an MLX CPU evaluation of a 16-float add took 0.125 ms" in text
    assert "note: a note" in text


def test_contended_runs_its_rows_on_the_cpu(monkeypatch, tmp_path):
    # Recorded rather than observed: on a CPU-only MLX the default device is the CPU anyway.
    chosen = []
    monkeypatch.setattr(mx, "set_default_device", chosen.append)
    for step in ("op_rows", "layer_rows", "demo_rows"):
        monkeypatch.setattr(contended, step, lambda quick, progress: [])
    contended.run(0, True, str(tmp_path))
    assert chosen == [mx.cpu]


PAIRED = Path(__file__).resolve().parent.parent / "benchmarks" / "paired.py"


@pytest.mark.parametrize(
    "mode, algorithm, tokens",
    [("forward", "chunked", 70), ("gradients", "chunked", 70), ("forward", "auto", 1)],
)
def test_paired_times_two_builds_in_turn_and_reports_their_ratio(mode, algorithm, tokens):
    # The installed build against itself, from the folder that holds the package.
    folder = Path(mlx_gated_delta.__file__).resolve().parent.parent
    command = [sys.executable, str(PAIRED), str(folder), str(folder), "--mode", mode]
    command += ["--algorithm", algorithm, "--tokens", str(tokens)]
    result = subprocess.run([*command, "--pairs", "3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.fullmatch(
        rf"{mode} {algorithm} T={tokens} float32, 3 pairs: base median [\d.]+ ms, "
        r"new median [\d.]+ ms, "
        r"new / base per pair: median [\d.]+ \(quartiles [\d.]+, [\d.]+\)\n",
        result.stdout,
    ), result.stdout


def test_paired_refuses_a_folder_without_the_package(tmp_path):
    folder = Path(mlx_gated_delta.__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, str(PAIRED), str(tmp_path), str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{tmp_path} holds no mlx_gated_delta package" in result.stderr


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["/somewhere/site-packages/mlx_gated_delta/__main__.py", "bench", "--kda"],
            "python -m mlx_gated_delta bench --kda",
        ),
        (["/a/checkout/benchmarks/bench.py", "--quick"], "bench.py --quick"),
    ],
)
def test_a_record_names_the_command_without_the_machines_paths(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "argv", argv)
    assert machine.command_line() == expected
