"""The command line of the benchmarks, ``python -m mlx_gated_delta bench``: the op against its
peers with rooflines (``op``) and the whole layer (``layer``), or with ``--train`` the training
step (``train``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import _ext, thread_count
from . import contended, layer, train
from .machine import (
    best_rooflines,
    command_line,
    cpu_model,
    git_commit,
    last_level_cache_bytes,
    load_average,
    measure_rooflines,
    package_version,
    usable_cpus,
)
from .op import (
    IMPLEMENTATIONS,
    PEERS_MAX_T_UNLESS_FULL,
    add_derived_figures,
    benchmark_row,
    report_text,
    state_pool_bytes,
    write_plot,
)
from .shapes import benchmark_shapes, kda_shapes
from .timing import Budget, Progress


def run_layer_rows(quick: bool, progress: Progress) -> tuple[list | None, str | None]:
    """Rows of the whole-layer benchmark, or a note of why it failed."""
    try:
        return layer.run_layer_benchmark(quick, progress), None
    except Exception as error:
        return None, f"layer benchmark failed: {type(error).__name__}: {error}"


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"not a regular expression: {error}") from None


# `--contended` without a count: one busy process per usable CPU (a count given is never
# negative, and argparse converts a string constant with `type`, so the marker is an int).
ONE_PER_USABLE_CPU = -1


def _busy_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a count of busy processes: {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Qwen3-Next B=1 at T in {1, 64, 512, 2048}, f32 and bf16, fewer "
        "repeats (a few minutes on 2 cores)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"also run MLX core and mlx-lm at T > {PEERS_MAX_T_UNLESS_FULL} "
        "(slow: about 2 s per 1000 tokens; and they hold one state per "
        "token: 16 GiB at T=8192, skipped when memory is short)",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="the training benchmark instead (mlx_gated_delta/bench/train.py): forward "
        "plus backward time and peak memory of the core op at T in {512, 2048, 8192} "
        "against mx.fast.gated_delta_update's vjp and mlx-lm's training path, the "
        "backward's GFLOP/s against the GEMM roofline, and the whole layer's training "
        "step; --quick and --full apply",
    )
    parser.add_argument(
        "--filter",
        metavar="REGEX",
        type=_regex,
        help="only rows whose label matches, e.g. 'bf16 B=1 T=2048' (with --train: "
        "'T=2048'); the whole-layer rows are then left out",
    )
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="the CUDA benchmark instead (mlx_gated_delta/bench/cuda.py): on MLX's CUDA "
        "build, ours against mx.fast.gated_delta_update and FLA (with PyTorch), "
        "Qwen3-Next shape, decode B in {1, 8, 64}, prefill B=1 T in {2048, 8192, 32768}",
    )
    parser.add_argument(
        "--kda",
        action="store_true",
        help="the Kimi Delta Attention rows instead: Kimi-Linear's shape (Hk=Hv=32, "
        "Dk=Dv=128) with per-key-channel gates and with scalar gates, decode and "
        "prefill (with --quick: T in {1, 512}); the whole-layer rows are left out",
    )
    parser.add_argument(
        "--kda-layers",
        action="store_true",
        help="the whole-layer rows of the core-op layers instead (mlx_gated_delta/bench/"
        "layer.py): Kimi-Linear's KimiDeltaAttention (per-key-channel gates) and "
        "OLMo-Hybrid's GatedDeltaNet (the same layout, scalar gates) at Kimi-Linear's heads, "
        "hidden 2048, bf16, each against mlx-lm's stock layer with the same weights: prefill "
        "at T in {512, 2048} and the training step at T in {512, 2048} (--quick: not at "
        "2048), both also at 8192 with --full (mlx-lm's layer not trained there), with "
        "each step's peak over its io; --filter selects rows by label, e.g. "
        "'kimi_linear.*2048'",
    )
    parser.add_argument(
        "--contended",
        metavar="N",
        nargs="?",
        type=_busy_count,
        const=ONE_PER_USABLE_CPU,
        help="the CPU path on a busy machine instead (mlx_gated_delta/bench/contended.py): "
        "N busy processes (default: one per usable CPU; 0 for none) run while the op's "
        "decode and prefill take turns with MLX core's, the layer's decode and the demo "
        "model's decode with stock mlx-lm's; --quick and --out apply",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="benchmarks/out",
        help="where results.json, results.txt and the plot go (default: benchmarks/out)",
    )


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "contended", None) is not None:
        busy = None if args.contended == ONE_PER_USABLE_CPU else args.contended
        return contended.run(busy, args.quick, args.out)
    if getattr(args, "train", False):
        return train.run(args)
    if getattr(args, "kda_layers", False):
        return layer.run_core_op_layers(args)
    if getattr(args, "cuda", False):
        from . import cuda

        return cuda.run(args)
    shapes = kda_shapes(args.quick) if args.kda else benchmark_shapes(args.quick)
    if args.filter:
        shapes = [s for s in shapes if args.filter.search(s.label)]
        if not shapes:
            raise SystemExit(f"no benchmark row matches --filter {args.filter.pattern!r}")
    budget = (
        Budget(seconds=1.0, max_repeats=15) if args.quick else Budget(seconds=3.0, max_repeats=30)
    )
    decode_budget = (
        Budget(seconds=1.0, max_repeats=50) if args.quick else Budget(seconds=2.0, max_repeats=200)
    )

    llc = last_level_cache_bytes()
    pool = state_pool_bytes(llc)
    progress = Progress(total=2 + len(shapes) * (len(IMPLEMENTATIONS) + 1))
    load_before = load_average()
    progress("rooflines (before the rows)")
    before = measure_rooflines()
    progress.advance()

    rows = []
    for s in shapes:
        rows.append(
            benchmark_row(s, pool, args.full, decode_budget if s.is_decode else budget, progress)
        )
    progress("rooflines (after the rows)")
    roofline = best_rooflines(before, measure_rooflines())
    progress.advance()
    for s, row in zip(shapes, rows):
        add_derived_figures(row, s, roofline)
    if args.filter or args.kda:
        flag = "--filter" if args.filter else "--kda"
        layer_rows, layer_note = None, f"whole-layer benchmark: not run with {flag}"
    else:
        layer_rows, layer_note = run_layer_rows(args.quick, progress)
    progress.close()

    record = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "mode": "quick" if args.quick else ("full" if args.full else "default"),
        "kda": args.kda,
        "machine": {
            "platform": platform.platform(),
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "usable_cpus": usable_cpus(),
            "cpu_threads": thread_count(),
            "cpu_kernel_level": _ext.cpu_kernel_level(),
            "last_level_cache_bytes": llc,
            "mlx_default_device": str(mx.default_device()),
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_average(),
        },
        "versions": {
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx-lm": package_version("mlx-lm"),
            "numpy": np.__version__,
            "mlx-gated-delta": package_version("mlx-gated-delta"),
        },
        "git_commit": git_commit(),
        "roofline": roofline,
        "state_pool_bytes": pool,
        "rows": rows,
        "layer_rows": layer_rows,
        "layer_note": layer_note,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report_text(record)
    plot_note = write_plot(rows, out / "tokens_per_s.png")
    record["plot"] = plot_note or str(out / "tokens_per_s.png")
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "results.txt").write_text(text + "\n")
    print(text)
    print(
        f"\nwrote {out / 'results.json'}, {out / 'results.txt'}"
        + (f"; {plot_note}" if plot_note else f", {out / 'tokens_per_s.png'}")
    )
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_gated_delta bench",
        description="Time the gated delta rule against MLX core and mlx-lm, with rooflines "
        "measured in the same run.",
    )
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0
