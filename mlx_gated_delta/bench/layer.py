"""The whole Gated DeltaNet layer, ours against mlx-lm's stock layer, on the
CPU, at the Qwen3-Next shape (hidden 2048, Hk=16, Hv=32, Dk=Dv=128, conv 4).

A row times one layer call (input projection, conv, gates, recurrence, gated
norm, output projection) with a cache: decode (T=1) at B=1 and B=8 from a
carried conv state and recurrent state, and prefill at T=512 and T=2048 from
an empty cache. Both layers hold the same weights and see the same inputs;
their calls are interleaved and each time is the median of the repeats after
a warm-up call. mlx-lm's layer is slow here (its projections go through MLX's
CPU matmul, its recurrence through MLX ops), so prefill rows use few repeats.

    python -m mlx_gated_delta.bench.layer [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import mlx.core as mx

from .shapes import QWEN3_NEXT_LAYER
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
