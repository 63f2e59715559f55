"""The whole-layer rows of ``bench --cuda``: the patched Qwen3-Next layer (our segment, whose
conv, gates and norm run as MLX ops on the GPU around our CUDA kernels) against mlx-lm's stock
layer (MLX ops, and mx.fast.gated_delta_update's per-token op loop on CUDA) with the same
weights, bf16, on MLX's CUDA device: decode and prefill (``layer.run_layer_benchmark``'s quick
shapes) and a training step (``nn.value_and_grad`` of the summed output over the layer's
parameters). Wall time from issue to the GPU's end (``mx.eval`` waits for it), medians of
calls that take turns; peak memory is the growth of MLX's peak over one call."""

from __future__ import annotations

import statistics

import mlx.core as mx

from .layer import layer_inputs, layer_step, qwen3_next_layers, run_layer_benchmark
from .timing import time_rounds

TRAINING_TOKENS = (512, 2048)


def peak_mib(call) -> float:
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    call()
    mx.synchronize()
    return (mx.get_peak_memory() - before) / 2**20


def training_rows(tokens=TRAINING_TOKENS, repeats: int = 3) -> list[dict]:
    ours, stock = qwen3_next_layers(mx.bfloat16)
    steps = {"ours": layer_step(ours), "mlx-lm": layer_step(stock)}
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


def run(progress) -> dict:
    """Both kinds of rows, on the default device (the caller sets MLX's GPU)."""
    return {
        "forward": run_layer_benchmark(quick=True, progress=progress),
        "training": training_rows(),
    }


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
    for r in record["training"]:
        lines.append(
            f"| training step B=1 T={r['T']} | {r['ours']['ms']:.2f} "
            f"(peak {r['ours']['peak_mib']:.0f} MiB) | {r['mlx-lm']['ms']:.2f} "
            f"(peak {r['mlx-lm']['peak_mib']:.0f} MiB) | {r['speedup']:.1f}x |"
        )
    return "\n".join(lines)
