"""The whole-layer rows of ``bench --cuda``: the patched Qwen3-Next layer (our segment: its
conv, gates and norm as CUDA kernels around our core kernels) against mlx-lm's stock layer (MLX
ops, and mx.fast.gated_delta_update's per-token op loop on CUDA) with the same weights, bf16, on
MLX's CUDA device: decode and prefill (``layer.shapes``' quick shapes), with the same patched
layer's segment as MLX ops around our core kernels (the path before the segment's kernels,
through the test hook) timed in turn; a Kimi-Linear prefill row; and a
training step (``nn.value_and_grad`` of the summed output over the layer's parameters), ours
in token blocks and in one call. Wall
time from issue to the GPU's end (``mx.eval`` waits for it), medians of calls that take turns;
peak memory is the growth of MLX's peak over one call."""

from __future__ import annotations

import statistics
from functools import partial

import mlx.core as mx

from .. import _ext
from ..layers import token_blocks
from .layer import (
    DTYPE_NAMES,
    CoreOpRow,
    core_op_layers,
    layer_inputs,
    layer_step,
    qwen3_next_layers,
    shapes,
    time_core_op_row,
)
from .timing import time_rounds

TRAINING_TOKENS = (512, 2048)


def peak_mib(call) -> float:
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    call()
    mx.synchronize()
    return (mx.get_peak_memory() - before) / 2**20


def in_one_call(step):
    """`step` with `token_blocks.TOKEN_BLOCK` None: the layer's call without a cache in one
    call, not in token blocks (the default from 2 blocks of tokens)."""

    def one_call(x):
        default = token_blocks.TOKEN_BLOCK
        token_blocks.TOKEN_BLOCK = None
        try:
            return step(x)
        finally:
            token_blocks.TOKEN_BLOCK = default

    return one_call


def training_rows(tokens=TRAINING_TOKENS, repeats: int = 3) -> list[dict]:
    """The patched layer's step (in token blocks from 2 blocks of tokens), the same step in
    one call, and mlx-lm's step, taking turns."""
    ours, stock = qwen3_next_layers(mx.bfloat16)
    steps = {
        "ours": layer_step(ours),
        "ours, one call": in_one_call(layer_step(ours)),
        "mlx-lm": layer_step(stock),
    }
    rows = []
    for t in tokens:
        x, _ = layer_inputs(mx.bfloat16, 1, t)
        calls = {name: (lambda step=step: mx.eval(step(x))) for name, step in steps.items()}
        times = time_rounds(calls, repeats)
        row = {"T": t, "repeats": repeats}
        for name, call in calls.items():
            row[name] = {
                "ms": statistics.median(times[name]) * 1e3,
                "peak_mib": peak_mib(call),
            }
        row["speedup"] = row["mlx-lm"]["ms"] / row["ours"]["ms"]
        rows.append(row)
    return rows


def forward_rows(progress=None) -> list[dict]:
    """Per quick shape of ``layer.shapes``: ours, ours with the segment as MLX ops around the
    core op (``_ext.set_segment_as_ops_on_every_stream``, read while the call's graph is
    built) and mlx-lm's layer, taking turns from fresh caches."""
    ours, stock = qwen3_next_layers(mx.bfloat16)
    rows = []
    for dtype, batch, tokens, repeats in shapes(quick=True):
        label = f"{DTYPE_NAMES[dtype]} B={batch} T={tokens}"
        if progress is not None:
            progress(f"layer {label}")
        x, fresh_cache = layer_inputs(dtype, batch, tokens)

        def call(layer, as_ops, cache):
            _ext.set_segment_as_ops_on_every_stream(as_ops)
            try:
                out = layer(x, cache=cache)
            finally:
                _ext.set_segment_as_ops_on_every_stream(False)
            mx.eval(out, cache[0], cache[1])

        times = time_rounds(
            {
                "ours": partial(call, ours, False),
                "as ops": partial(call, ours, True),
                "mlx-lm": partial(call, stock, False),
            },
            repeats,
            prepare=lambda: (fresh_cache(),),
        )
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append(
            {
                "shape": f"{label} {'decode' if tokens == 1 else 'prefill'}",
                "B": batch,
                "T": tokens,
                "repeats": repeats,
                "ours_ms": ms["ours"],
                "segment_as_ops_ms": ms["as ops"],
                "mlx_lm_ms": ms["mlx-lm"],
                "speedup": ms["mlx-lm"] / ms["ours"],
            }
        )
    return rows


def kimi_linear_rows(progress=None) -> list[dict]:
    """Kimi-Linear's layer (per-key gates: the segment's KDA options) at prefill T=512, B=1,
    bf16, against mlx-lm's (``layer.time_core_op_row``)."""
    ours, stock = core_op_layers("kimi_linear")
    row = CoreOpRow("kimi_linear", "prefill", 512, 3, 1)
    if progress is not None:
        progress(f"layer {row.label}")
    return [time_core_op_row(row, ours, stock)]


def _section(title: list[str], columns: list[str]) -> list[str]:
    """A titled table's first lines, after a blank line: its title, a blank line, the
    header row and the separator row."""
    return ["", *title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def table(record: dict) -> str:
    lines = [
        "Whole patched Qwen3-Next layer against mlx-lm's stock layer (bf16, same weights):",
        "",
        "| rows | ours ms | mlx-lm ms | speed-up |",
        "|---|---|---|---|",
    ]
    for r in record["forward"]:
        lines.append(
            f"| {r['shape']} | {r['ours_ms']:.2f} | {r['mlx_lm_ms']:.2f} | {r['speedup']:.1f}x |"
        )
    for r in record.get("kimi_linear", []):
        lines.append(
            f"| {r['shape']} | {r['ours_ms']:.2f} | {r['mlx_lm_ms']:.2f} | {r['speedup']:.1f}x |"
        )
    for r in record["training"]:
        lines.append(
            f"| training step B=1 T={r['T']} | {r['ours']['ms']:.2f} "
            f"(peak {r['ours']['peak_mib']:.0f} MiB) | {r['mlx-lm']['ms']:.2f} "
            f"(peak {r['mlx-lm']['peak_mib']:.0f} MiB) | {r['speedup']:.1f}x |"
        )
    one_call = [r for r in record["training"] if "ours, one call" in r]
    if one_call:
        lines += _section(
            [
                "The training step in token blocks (the default) against one call (TOKEN_BLOCK = None):"
            ],
            ["rows", "blocks ms (peak MiB)", "one call ms (peak MiB)", "time ratio"],
        )
        for r in one_call:
            blocks, whole = r["ours"], r["ours, one call"]
            lines.append(
                f"| training step B=1 T={r['T']} | {blocks['ms']:.2f} ({blocks['peak_mib']:.0f}) "
                f"| {whole['ms']:.2f} ({whole['peak_mib']:.0f}) "
                f"| {blocks['ms'] / whole['ms']:.2f}x |"
            )
    compared = [r for r in record["forward"] if "segment_as_ops_ms" in r]
    if compared:
        lines += _section(
            [
                "The segment's stages as CUDA kernels against the segment as MLX ops around the same",
                "core kernels (the same patched layer, the same run):",
            ],
            ["rows", "kernels ms", "as ops ms", "ratio"],
        )
        for r in compared:
            lines.append(
                f"| {r['shape']} | {r['ours_ms']:.2f} | {r['segment_as_ops_ms']:.2f} "
                f"| {r['segment_as_ops_ms'] / r['ours_ms']:.1f}x |"
            )
    return "\n".join(lines)
