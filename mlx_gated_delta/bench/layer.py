"""The whole gated-delta layer, ours against mlx-lm's stock layer, on the CPU.

Qwen3-Next's layer (hidden 2048, Hk=16, Hv=32, Dk=Dv=128, conv 4), in every
run of ``bench``:

A row times one layer call (input projection, conv, gates, recurrence, gated
norm, output projection) with a cache: decode (T=1) at B=1 and B=8 from a
carried conv state and recurrent state, and prefill at T=512 and T=2048 from
an empty cache. Both layers hold the same weights and see the same inputs;
their calls are interleaved and each time is the median of the repeats after
a warm-up call. mlx-lm's layer is slow here (its projections go through MLX's
CPU matmul, its recurrence through MLX ops), so prefill rows use few repeats.

    python -m mlx_gated_delta.bench.layer [--quick]

The layers with separate q, k and v projections and convolutions
(``bench --kda-layers``): Kimi-Linear's ``KimiDeltaAttention``
(per-key-channel gates) and OLMo-Hybrid's ``GatedDeltaNet`` (the same layout
with scalar gates), both at Kimi-Linear's heads (32 of 128, hidden 2048,
conv 4), bf16: prefill from an empty cache and the training step (forward
and backward over the layer's parameters). See ``core_op_layer_rows``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx

from .machine import MiB, available_memory_bytes, cpu_run_record, load_average
from .op import format_table
from .shapes import KIMI_LINEAR, KIMI_LINEAR_LAYER, OLMO_HYBRID_LAYER, QWEN3_NEXT_LAYER
from .timing import time_rounds

DTYPE_NAMES = {mx.float32: "f32", mx.bfloat16: "bf16"}


def shapes(quick: bool):
    """(dtype, batch, tokens, timed repeats). bfloat16 is what Qwen3-Next
    runs in; float32 is added outside quick mode (mlx-lm's stock layer takes
    about 2 minutes per float32 call at T=2048 on 2 cores)."""
    rows = []
    dtypes = [mx.bfloat16] if quick else [mx.bfloat16, mx.float32]
    for dtype in dtypes:
        rows += [
            (dtype, 1, 1, 10 if quick else 30),
            (dtype, 8, 1, 5 if quick else 15),
            (dtype, 1, 512, 1 if quick else 3),
            (dtype, 1, 2048, 1 if quick else 2),
        ]
    return rows


def qwen3_next_layers(dtype):
    """(ours, mlx-lm's stock layer) at the Qwen3-Next shape, holding the same
    weights (drawn with seed 0), in ``dtype``."""
    from mlx_lm.models import qwen3_next

    from ..nn import Qwen3NextGatedDeltaNet

    mx.random.seed(0)
    stock = qwen3_next.Qwen3NextGatedDeltaNet(QWEN3_NEXT_LAYER)
    stock.set_dtype(dtype)
    ours = Qwen3NextGatedDeltaNet(QWEN3_NEXT_LAYER)
    ours.update(stock.parameters())
    mx.eval(stock.parameters())
    return ours, stock


def layer_inputs(dtype, batch, tokens):
    from mlx_lm.models.cache import ArraysCache

    c = QWEN3_NEXT_LAYER
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + (
        c.linear_num_value_heads * c.linear_value_head_dim
    )
    x = mx.random.normal((batch, tokens, c.hidden_size)).astype(dtype)
    carried = None
    if tokens == 1:  # decode continues a sequence
        carried = (
            mx.random.normal((batch, c.linear_conv_kernel_dim - 1, conv_dim)).astype(dtype),
            mx.random.normal(
                (batch, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim)
            )
            * 0.1,
        )
    mx.eval(x, carried)

    def fresh_cache():
        cache = ArraysCache(2)
        if carried is not None:
            cache[0], cache[1] = carried
        return cache

    return x, fresh_cache


def run_layer_benchmark(quick: bool, progress: Callable | None = None) -> list[dict]:
    """One row per shape: name, shape, ours_ms, mlx_lm_ms, speedup (and the
    dtype, B, T and repeats)."""
    rows = []
    layers = {}
    for dtype, batch, tokens, repeats in shapes(quick):
        if dtype not in layers:
            layers = {dtype: qwen3_next_layers(dtype)}
        ours, stock = layers[dtype]
        label = f"{DTYPE_NAMES[dtype]} B={batch} T={tokens}"
        if progress is not None:
            progress(f"layer {label}")
        x, fresh_cache = layer_inputs(dtype, batch, tokens)

        def call(layer, cache):
            mx.eval(layer(x, cache=cache), cache[0], cache[1])

        # Each call starts from a fresh cache, made before its clock starts.
        times = time_rounds(
            {"ours": partial(call, ours), "mlx-lm": partial(call, stock)},
            repeats,
            prepare=lambda: (fresh_cache(),),
        )
        ours_ms = statistics.median(times["ours"]) * 1e3
        stock_ms = statistics.median(times["mlx-lm"]) * 1e3
        rows.append(
            {
                "name": "Qwen3-Next GatedDeltaNet",
                "shape": f"{label} {'decode' if tokens == 1 else 'prefill'}",
                "dtype": DTYPE_NAMES[dtype],
                "B": batch,
                "T": tokens,
                "repeats": repeats,
                "ours_ms": ours_ms,
                "mlx_lm_ms": stock_ms,
                "speedup": stock_ms / ours_ms,
            }
        )
    return rows


def layer_step(layer):
    """One training step of a whole layer: ``nn.value_and_grad`` over its
    parameters of loss = the sum of its output (float32); a function of the
    input."""
    import mlx.nn as nn

    def loss(model, x):
        return model(x).astype(mx.float32).sum()

    grad = nn.value_and_grad(layer, loss)
    return lambda x: grad(layer, x)


def layer_io_bytes(layer, x: mx.array) -> int:
    """The bytes a layer's training step cannot do without: the input x, the
    output (x's shape and dtype), the trainable parameters and their
    gradients (each the size of its parameter)."""
    import mlx.nn as nn

    parameters = sum(p.nbytes for _, p in nn.utils.tree_flatten(layer.trainable_parameters()))
    return 2 * x.nbytes + 2 * parameters


# The core-op layers of ``--kda-layers``: the family's name in mlx-lm (and in
# mlx_gated_delta.layers.FAMILIES), how the rows name it, and its mlx-lm
# arguments.
CORE_OP_LAYERS = {
    "kimi_linear": ("Kimi-Linear KimiDeltaAttention", KIMI_LINEAR_LAYER),
    "olmo_hybrid": ("OLMo-Hybrid GatedDeltaNet", OLMO_HYBRID_LAYER),
}


@dataclasses.dataclass(frozen=True)
class CoreOpRow:
    """One row of ``--kda-layers``: a layer, ``prefill`` (one forward call
    from an empty cache) or ``train`` (``layer_step``), T tokens at B=1 in
    bf16, and the timed repeats of ours and of mlx-lm's layer."""

    family: str  # a key of CORE_OP_LAYERS
    mode: str
    T: int
    ours_repeats: int
    stock_repeats: int

    @property
    def label(self) -> str:
        return f"{self.family} bf16 B=1 T={self.T} {self.mode}"


def core_op_layer_rows(quick: bool, full: bool) -> list[CoreOpRow]:
    """For each layer of CORE_OP_LAYERS: prefill at T = 512 and 2048 and the
    training step at T = 512 and 2048, and with ``full`` both at T = 8192
    (mlx-lm's layer takes minutes per prefill call there, and is not trained:
    ``stock_training_skip_reason``); ``quick`` drops the training step at
    T = 2048 and times everything once. mlx-lm's calls take seconds to
    minutes, so they get few repeats."""
    specs = [("prefill", 512, 3), ("prefill", 2048, 2), ("train", 512, 2), ("train", 2048, 1)]
    if quick:
        specs = [spec for spec in specs if spec[:2] != ("train", 2048)]
    if full:
        specs += [("prefill", 8192, 1), ("train", 8192, 1)]
    return [
        CoreOpRow(family, mode, T, 3 if quick else 5, 1 if quick else stock_repeats)
        for family in CORE_OP_LAYERS
        for mode, T, stock_repeats in specs
    ]


def core_op_layers(family: str, dtype=mx.bfloat16):
    """(ours, mlx-lm's stock layer) of ``family`` (a key of CORE_OP_LAYERS),
    holding the same weights (drawn with seed 0), in ``dtype``; ours is
    built from the stock layer as ``patch_mlx_lm`` builds it."""
    import importlib

    from ..layers import FAMILIES

    record = next(f for f in FAMILIES if f.name == family)
    _, args = CORE_OP_LAYERS[family]
    mx.random.seed(0)
    stock_class = getattr(importlib.import_module(f"mlx_lm.models.{family}"), record.mlx_lm_class)
    stock = stock_class(args, 0) if family == "kimi_linear" else stock_class(args)  # 0: layer_idx
    stock.set_dtype(dtype)
    ours = record.layer(record.config_from_layer(stock))
    ours.update(stock.parameters())
    mx.eval(stock.parameters())
    return ours, stock


# The longest training step of mlx-lm's layer that ``--kda-layers`` runs: at
# T = 2048 it took 7 minutes and 16 GiB on a 2-core VM, and both grow with T.
STOCK_TRAINING_MAX_T = 2048


def stock_training_skip_reason(tokens: int) -> str | None:
    """Why mlx-lm's layer is not trained at this length, or None to run it:
    its training path (``gated_delta_ops``, one MLX op loop per token) keeps
    about four float32 states per token for its backward (one state per
    token is 4 GiB at T = 2048 here; the step peaked at 16 GiB); it runs
    up to STOCK_TRAINING_MAX_T tokens, where that fits in the memory
    available now."""
    if tokens > STOCK_TRAINING_MAX_T:
        return (
            f"not trained above T={STOCK_TRAINING_MAX_T}: its step grows with T from "
            "7 minutes and 16 GiB there"
        )
    needed = 4 * tokens * KIMI_LINEAR.Hv * KIMI_LINEAR.Dv * KIMI_LINEAR.Dk * 4
    available = available_memory_bytes()
    if available is not None and needed > available:
        return f"skipped: needs about {needed / 2**30:.0f} GiB, {available / 2**30:.0f} available"
    return None


def time_core_op_row(row: CoreOpRow, ours, stock) -> dict:
    """Times one row: ours and mlx-lm's layer take turns (ours warmed up
    first; mlx-lm's calls are long enough that a warm-up would only double
    them), each call after MLX's buffer cache is emptied. Also records, per
    layer, the most memory a call allocated above what was held before it
    (mx.get_peak_memory)."""
    from mlx_lm.models.cache import ArraysCache

    hidden = CORE_OP_LAYERS[row.family][1].hidden_size
    x = mx.random.normal((1, row.T, hidden)).astype(mx.bfloat16)
    mx.eval(x)
    for layer in (ours, stock):
        layer.train(row.mode == "train")  # as mlx-lm's lora and generate run them

    if row.mode == "train":
        steps = {"ours": layer_step(ours), "mlx-lm": layer_step(stock)}

        def call(name):
            mx.eval(steps[name](x))

        def arguments():
            return ()
    else:
        layers = {"ours": ours, "mlx-lm": stock}

        def call(name, cache):
            mx.eval(layers[name](x, cache=cache), cache.cache)

        def arguments():
            return (ArraysCache(4),)  # [q, k, v conv states, state]

    held, peaks = {}, {}

    def prepare(name):
        def fresh():
            args = arguments()
            mx.clear_cache()
            mx.reset_peak_memory()
            held[name] = mx.get_active_memory()
            return args

        return fresh

    def measured(name):
        def run(*args):
            call(name, *args)
            peaks[name] = max(peaks.get(name, 0), mx.get_peak_memory() - held[name])

        return run

    calls = {name: measured(name) for name in ("ours", "mlx-lm")}
    repeats = {"ours": row.ours_repeats, "mlx-lm": row.stock_repeats}
    skip = stock_training_skip_reason(row.T) if row.mode == "train" else None
    if skip:
        del calls["mlx-lm"]
    calls["ours"](*prepare("ours")())  # warm-up
    times = time_rounds(calls, repeats, warm_up=False, prepare={n: prepare(n) for n in calls})
    result = dataclasses.asdict(row) | {"name": CORE_OP_LAYERS[row.family][0], "shape": row.label}
    # What the training step cannot do without: the scale its peak is read
    # against (the table's peak / io).
    result["io_bytes"] = layer_io_bytes(ours, x) if row.mode == "train" else None
    for name, key in (("ours", "ours"), ("mlx-lm", "mlx_lm")):
        if name in times:
            result[f"{key}_ms"] = statistics.median(times[name]) * 1e3
            result[f"{key}_peak_bytes"] = peaks[name]
    result["mlx_lm_note"] = skip
    result["speedup"] = result["mlx_lm_ms"] / result["ours_ms"] if not skip else None
    return result


def run_core_op_layer_benchmark(rows: list[CoreOpRow], progress: Callable | None = None):
    """The timed rows of ``--kda-layers`` (``time_core_op_row``), one layer
    pair built per family."""
    results = []
    for family in CORE_OP_LAYERS:
        family_rows = [row for row in rows if row.family == family]
        if not family_rows:
            continue
        ours, stock = core_op_layers(family)
        for row in family_rows:
            if progress is not None:
                progress(f"layer {row.label}")
            results.append(time_core_op_row(row, ours, stock))
        del ours, stock  # one family's weights at a time
    return results


def core_op_layer_table(results: list[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    def mib(value):
        return "-" if value is None else f"{value / MiB:.0f}"

    def per_io(r):
        io, peak = r.get("io_bytes"), r.get("ours_peak_bytes")
        return "-" if io is None or peak is None else f"{peak / io:.2f}x"

    headers = [
        "layer",
        "mode",
        "T",
        "ours ms",
        "mlx-lm ms",
        "speed-up",
        "ours MiB",
        "mlx-lm MiB",
        "ours MiB / io",
    ]
    body = [
        [
            r["name"],
            r["mode"],
            str(r["T"]),
            ms(r.get("ours_ms")),
            ms(r.get("mlx_lm_ms")),
            "-" if r["speedup"] is None else f"{r['speedup']:.1f}x",
            mib(r.get("ours_peak_bytes")),
            mib(r.get("mlx_lm_peak_bytes")),
            per_io(r),
        ]
        for r in results
    ]
    notes = [f"{r['shape']}: mlx-lm {r['mlx_lm_note']}" for r in results if r["mlx_lm_note"]]
    return "\n".join([format_table(headers, body), *notes])


def run_core_op_layers(args: argparse.Namespace) -> dict:
    """``bench --kda-layers``: the rows of ``core_op_layer_rows`` (those
    ``--filter`` matches), on the CPU; prints the table and writes
    layers_results.json and layers_results.txt to ``--out``."""
    mx.set_default_device(mx.cpu)
    rows = core_op_layer_rows(getattr(args, "quick", False), getattr(args, "full", False))
    pattern = getattr(args, "filter", None)
    if pattern is not None:
        rows = [row for row in rows if pattern.search(row.label)]
        if not rows:
            raise SystemExit(f"no layer row matches --filter {pattern.pattern!r}")

    def progress(label):
        print(f"... {label}", file=sys.stderr, flush=True)

    load_before = load_average()
    results = run_core_op_layer_benchmark(rows, progress)
    record = {
        **cpu_run_record(load_before),
        "rows": results,
    }
    m = record["machine"]
    text = "\n".join(
        [
            f"Whole layer, CPU: {m['cpu_model']}, {m['cores']} cores, our CPU pool "
            f"{m['cpu_threads']} threads, kernels {m['cpu_kernel_level']}; load average "
            f"{m['load_before']} before, {m['load_after']} after",
            f"Kimi-Linear's heads ({KIMI_LINEAR.text(', ')}, hidden "
            f"{KIMI_LINEAR_LAYER.hidden_size}, conv 4), bf16, B=1; median ms per call; "
            "MiB: the most a call allocated above what was held before it; io: the "
            "training step's input, output, parameters and their gradients",
            core_op_layer_table(results),
        ]
    )
    out = Path(getattr(args, "out", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "layers_results.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "layers_results.txt").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'layers_results.json'}, {out / 'layers_results.txt'}")
    return record


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'shape':<26}{'ours ms':>10}{'mlx-lm ms':>12}{'speed-up':>10}"]
    for r in rows:
        lines.append(
            f"{r['shape']:<26}{r['ours_ms']:10.1f}{r['mlx_lm_ms']:12.1f}{r['speedup']:9.1f}x"
        )
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="bfloat16 rows only, fewer repeats")
    args = parser.parse_args(argv)

    def progress(label):
        print(f"... {label}", flush=True)

    rows = run_layer_benchmark(args.quick, progress)
    print(f"Whole layer, CPU ({mx.default_device()}), Qwen3-Next shape; median ms per call")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
