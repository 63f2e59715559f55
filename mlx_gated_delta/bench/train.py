"""Training-step benchmark: forward plus backward of the core op and of the
whole layer, on the CPU.

``python -m mlx_gated_delta bench --train [--quick] [--full]``

Core op, for the Qwen3-Next shape (Hk = 16, Hv = 32, Dk = Dv = 128, B = 1,
bfloat16 activations, float32 gates and state): one training step is
``mx.value_and_grad`` of a loss on both outputs with respect to q, k, v, the
linear decay gamma, beta and the state, so the forward and the backward both run.
Three implementations:

- ours: ``gated_delta_update`` ("auto": the chunked forward and backward),
  and beside it the same call with per-key-channel gates (gamma
  ``[B, T, Hv, Dk]``, Kimi Delta Attention's form);
- ``mx.fast.gated_delta_update``, whose vjp runs through MLX's op loop;
- mlx-lm's training path (``use_kernel=False``: ``gated_delta_ops``, a loop
  of MLX ops per token).

The peers keep states per token for their backward (about four: 17 GiB at
T = 2048, 67 GiB at T = 8192), so they run only up to T = 2048 unless
``--full``, and only where that fits in the memory available; a skipped cell
says why.

Ours is also timed backward alone (``mx.grad``: the gradient of this loss does
not read y, so the forward primitive is not evaluated), and the products the
backward computes (counted in ``backward_product_flops``) are divided by that
time and compared with NumPy's float32 GEMM measured in the same run.

Whole layer: one training step (``nn.value_and_grad`` over the layer's
parameters, loss = sum of the output) of our ``nn.Qwen3NextGatedDeltaNet`` against
mlx-lm's stock ``Qwen3NextGatedDeltaNet`` holding the same weights. Each step's
peak is also given over the bytes it cannot do without: its input and output,
the parameters and their gradients (``layer_io_bytes``).

Times are medians of the repeats after a warm-up call (the peers: no warm-up
and few repeats, each call takes seconds to minutes); peak memory is
``mx.get_peak_memory`` over one step after a reset (it includes the inputs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import thread_count
from ..ops import gated_delta_update
from .layer import layer_io_bytes, layer_step, qwen3_next_layers
from .machine import (
    available_memory_bytes,
    best_rooflines,
    cpu_run_record,
    load_average,
    measure_rooflines,
)
from .op import PEERS_MAX_T_UNLESS_FULL
from .shapes import QWEN3_NEXT, QWEN3_NEXT_LAYER
from .timing import median_seconds

TOKENS = (512, 2048, 8192)
QUICK_TOKENS = (512, 2048)
CHUNK = 64
MiB = 1 << 20
NAMES = ("q", "k", "v", "gamma", "beta", "state")


def make_inputs(tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    Hk, Hv, Dk, Dv = QWEN3_NEXT.Hk, QWEN3_NEXT.Hv, QWEN3_NEXT.Dk, QWEN3_NEXT.Dv

    def unit_rows(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    def array(x, dtype=mx.bfloat16):
        return mx.array(x.astype(np.float32)).astype(dtype)

    return dict(
        q=array(unit_rows((1, tokens, Hk, Dk))),
        k=array(unit_rows((1, tokens, Hk, Dk))),
        v=array(rng.standard_normal((1, tokens, Hv, Dv))),
        gamma=array(np.exp(rng.uniform(-2.0, 0.0, (1, tokens, Hv))), mx.float32),
        beta=array(rng.uniform(0.0, 1.0, (1, tokens, Hv)), mx.float32),
        state=array(rng.standard_normal((1, Hv, Dv, Dk)) * 0.1, mx.float32),
        key_gamma=array(np.exp(rng.uniform(-2.0, 0.0, (1, tokens, Hv, Dk))), mx.float32),
    )


def ours(q, k, v, gamma, beta, state):
    return gated_delta_update(q, k, v, gamma, beta, state, stream=mx.cpu)


def mlx_fast(q, k, v, gamma, beta, state):
    return mx.fast.gated_delta_update(q, k, v, gamma, beta, state, stream=mx.cpu)


def mlx_lm_ops(q, k, v, gamma, beta, state):
    # mlx-lm's training path: gated_delta_update(use_kernel=False) runs this
    # loop on its gates (the linear decay and beta); the gate math before it
    # is not part of the core op.
    from mlx_lm.models.gated_delta import gated_delta_ops

    return gated_delta_ops(q, k, v, gamma, beta, state)


IMPLEMENTATIONS = (
    ("ours", ours),
    ("mx.fast vjp", mlx_fast),
    ("mlx-lm ops", mlx_lm_ops),
)
# Ours again with per-key-channel gates, same shape and inputs but gamma.
PER_KEY = "ours, per-key gates"


def _loss(op):
    def loss(q, k, v, gamma, beta, state):
        y, final = op(q, k, v, gamma, beta, state)
        return y.astype(mx.float32).sum() + final.sum()

    return loss


def training_step(op):
    """Forward and backward: the loss value and every gradient."""
    return mx.value_and_grad(_loss(op), argnums=tuple(range(6)))


def backward_step(op):
    """The gradients alone: for this loss, the backward without the forward."""
    return mx.grad(_loss(op), argnums=tuple(range(6)))


def measure(step, args, repeats: int, warm_up: bool = True):
    """(median seconds, peak bytes) of mx.eval(step(*args)). MLX's buffer
    cache is emptied first: a peer's gigabytes of freed states would otherwise
    stay held and count against the next peer's memory check."""
    mx.clear_cache()
    if warm_up:
        mx.eval(step(*args))
    # Reset once, after the warm-up: the peak over the repeats is the largest
    # of theirs, since nothing is allocated between them.
    mx.reset_peak_memory()
    seconds = median_seconds(lambda: mx.eval(step(*args)), repeats, warm_up=False)
    return seconds, mx.get_peak_memory()


def backward_product_flops(tokens: int, batch: int = 1, **heads) -> int:
    """The FLOPs of the matrix products of our chunked backward (scalar gates)
    at the Qwen3-Next shape with the sizes in ``heads`` changed (``Hv=1``), as
    csrc/cpu/chunked_backward.cpp computes them: an m x n x k product is
    2 m n k, one that a triangle halves is m n k. Per chunk of L tokens and
    value head: boundary_states (the exit state for all chunks but the last),
    chunk_qk again, and the five backward stages."""
    shape = dataclasses.replace(QWEN3_NEXT, **heads)
    K, V = shape.Dk, shape.Dv

    def full(m, n, k):
        return 2 * m * n * k

    def half(m, n, k):
        return m * n * k

    total = 0
    chunks = -(-tokens // CHUNK)
    for c in range(chunks):
        L = min(CHUNK, tokens - c * CHUNK)
        solve = L**3 // 3  # the triangular inverse, row by row
        w_u = half(L, V, L) + half(L, K, L)
        total += half(L, L, K) + solve + w_u + full(L, V, K)  # boundary_states
        if c + 1 < chunks:
            total += full(K, V, L)  # the exit state
        total += half(L, L, K)  # chunk_qk
        total += half(L, V, L) + half(L, L, V) + 2 * half(L, K, L)  # chunk_output_backward
        total += 6 * full(L, K, V)  # chunk_carry_backward
        total += half(L, L, V) + half(L, L, K) + half(L, V, L) + half(L, K, L)  # recompute_w_u_b.
        total += 2 * half(L, L, L) + 2 * half(L, K, L)  # kkt_inverse_backward
    return total * batch * shape.Hv


def io_bytes(inputs: dict) -> int:
    """The bytes of one step's inputs and outputs: the six inputs, y and the
    final state, and the six gradients (each the size of its input)."""
    inputs_bytes = sum(inputs[n].nbytes for n in NAMES)
    return 2 * inputs_bytes + inputs["v"].nbytes + inputs["state"].nbytes


def backward_scratch_bytes(tokens: int, threads: int) -> int:
    """What our CPU backward allocates outside MLX's allocator, which
    mx.get_peak_memory does not see: the per-value-head float32 dq and dk of
    one wave of problems ([T, Dk] each per problem; a wave is whole key-head
    groups, about one problem per thread, summed over each group before the
    next wave), and per thread one problem's chunk store (per chunk the entry
    state, K K^T, T, W and V') and chunk scratch (under 2 MiB)."""
    Hk, Hv, Dk, Dv = QWEN3_NEXT.Hk, QWEN3_NEXT.Hv, QWEN3_NEXT.Dk, QWEN3_NEXT.Dv
    ratio = Hv // Hk
    wave_heads = ratio * min(Hk, -(-threads // ratio))
    per_head_grads = 2 * wave_heads * tokens * Dk * 4
    per_chunk = (Dk * Dv + 2 * CHUNK * CHUNK + CHUNK * (Dk + Dv)) * 4
    return per_head_grads + threads * (-(-tokens // CHUNK) * per_chunk + 2 * MiB)


def peer_skip_reason(tokens: int, full: bool) -> str | None:
    """Why a peer is not run at this length, or None to run it. A peer's
    backward holds about four float32 states per token, T Hv Dv Dk each (MLX
    core's vjp peaked at 16.8 GiB at T = 2048, where one state per token is 4
    GiB); it runs only where that fits in the memory available now."""
    states = tokens * QWEN3_NEXT.Hv * QWEN3_NEXT.Dv * QWEN3_NEXT.Dk * 4
    if tokens > PEERS_MAX_T_UNLESS_FULL and not full:
        return f"skipped: T > {PEERS_MAX_T_UNLESS_FULL} needs --full"
    available = available_memory_bytes()
    if available is not None and 4 * states > available:
        return (
            f"skipped: needs about {4 * states / 2**30:.0f} GiB, "
            f"{available / 2**30:.0f} GiB available"
        )
    return None


def peer_repeats(tokens: int, quick: bool) -> int:
    return 1 if quick or tokens > 512 else 2


def core_rows(tokens_list, quick: bool, full: bool, progress) -> list[dict]:
    rows = []
    repeats = 3 if quick else 5
    for tokens in tokens_list:
        inputs = make_inputs(tokens)
        mx.eval(inputs)
        args = [inputs[n] for n in NAMES]
        row = {"T": tokens, "io_bytes": io_bytes(inputs), "cells": {}}
        for name, op in IMPLEMENTATIONS:
            progress(f"core T={tokens} {name}")
            skip = None if name == "ours" else peer_skip_reason(tokens, full)
            if skip:
                row["cells"][name] = {"skipped": skip}
                continue
            is_ours = name == "ours"
            n = repeats if is_ours else peer_repeats(tokens, quick)
            seconds, peak = measure(training_step(op), args, n, warm_up=is_ours)
            row["cells"][name] = {"ms": seconds * 1e3, "peak_bytes": peak, "repeats": n}
        progress(f"core T={tokens} {PER_KEY}")
        key_args = [inputs["key_gamma" if n == "gamma" else n] for n in NAMES]
        seconds, peak = measure(training_step(ours), key_args, repeats)
        row["cells"][PER_KEY] = {"ms": seconds * 1e3, "peak_bytes": peak, "repeats": repeats}
        progress(f"core T={tokens} ours backward alone")
        seconds, peak = measure(backward_step(ours), args, repeats)
        flops = backward_product_flops(tokens)
        row["backward"] = {
            "ms": seconds * 1e3,
            "peak_bytes": peak,
            "scratch_bytes": backward_scratch_bytes(tokens, thread_count()),
            "product_flops": flops,
            "flop_per_s": flops / seconds,
        }
        rows.append(row)
        del inputs, args
    return rows


def layer_rows(tokens_list, quick: bool, full: bool, progress) -> list[dict]:
    patched, stock = qwen3_next_layers(mx.bfloat16)
    rows = []
    repeats = 3 if quick else 5
    for tokens in tokens_list:
        x = mx.random.normal((1, tokens, QWEN3_NEXT_LAYER.hidden_size)).astype(mx.bfloat16)
        mx.eval(x)
        row = {"T": tokens, "io_bytes": layer_io_bytes(patched, x), "cells": {}}
        for name, layer in (("ours (patched layer)", patched), ("mlx-lm stock layer", stock)):
            progress(f"layer T={tokens} {name}")
            is_ours = name.startswith("ours")
            skip = None if is_ours else peer_skip_reason(tokens, full)
            if skip:
                row["cells"][name] = {"skipped": skip}
                continue
            n = repeats if is_ours else peer_repeats(tokens, quick)
            seconds, peak = measure(layer_step(layer), [x], n, warm_up=is_ours)
            row["cells"][name] = {"ms": seconds * 1e3, "peak_bytes": peak, "repeats": n}
        rows.append(row)
    return rows


def _cell(cell: dict) -> str:
    if "skipped" in cell:
        return cell["skipped"]
    return f"{cell['ms']:.0f} ms, {cell['peak_bytes'] / MiB:.0f} MiB (x{cell['repeats']})"


def _speedup(row: dict, peer: str, ours_name: str = "ours") -> str:
    cells = row["cells"]
    if "ms" not in cells.get(peer, {}):
        return "-"
    return f"{cells[peer]['ms'] / cells[ours_name]['ms']:.1f}x"


def report_text(record: dict) -> str:
    gemm = record["roofline"]["gemm"]["flop_per_s"]
    lines = [
        f"Training step (forward + backward), CPU: {record['machine']['cpu_model']}, "
        f"{record['machine']['cores']} cores, our CPU pool {record['machine']['cpu_threads']} "
        f"threads, kernels {record['machine']['cpu_kernel_level']}; load average "
        f"{record['machine']['load_before']} "
        f"before, {record['machine']['load_after']} after",
        f"Core op, Qwen3-Next shape ({QWEN3_NEXT.text(', ')}, B=1), bf16 activations; "
        "median ms per step, peak MiB, (timed repeats)",
        "",
        f"{'T':>5}  {'ours':<26}{'mx.fast vjp':<34}{'mlx-lm ops (use_kernel=False)':<40}"
        f"{'vs mx.fast':>11}{'vs mlx-lm':>11}",
    ]
    for row in record["core_rows"]:
        c = row["cells"]
        lines.append(
            f"{row['T']:>5}  {_cell(c['ours']):<26}{_cell(c['mx.fast vjp']):<34}"
            f"{_cell(c['mlx-lm ops']):<40}{_speedup(row, 'mx.fast vjp'):>11}"
            f"{_speedup(row, 'mlx-lm ops'):>11}"
        )
    lines += [
        "",
        "Ours with per-key-channel gates (gamma [B, T, Hv, Dk]), the same inputs otherwise",
        f"{'T':>5}  {PER_KEY:<26}{'per-key / scalar':>18}",
    ]
    for row in record["core_rows"]:
        c = row["cells"]
        ratio = c[PER_KEY]["ms"] / c["ours"]["ms"]
        lines.append(f"{row['T']:>5}  {_cell(c[PER_KEY]):<26}{ratio:>17.2f}x")
    lines += [
        "",
        "Our backward alone (mx.grad: the forward is not evaluated): its matrix products' "
        f"FLOPs over its median time, against NumPy's float32 GEMM ({gemm / 1e9:.0f} GFLOP/s, "
        f"{record['roofline']['gemm']['n']}^3, the better of before and after the rows)",
        "peak: MLX's peak over the step; + scratch: with what the backward allocates "
        "outside MLX (bench.train.backward_scratch_bytes); io: the step's inputs, outputs and "
        "gradients",
        f"{'T':>5}  {'backward ms':>12}{'GFLOP':>9}{'GFLOP/s':>9}{'of GEMM':>9}"
        f"{'peak MiB':>10}{'+ scratch':>11}{'io MiB':>8}{'(peak+scratch)/io':>19}",
    ]
    for row in record["core_rows"]:
        b = row["backward"]
        lines.append(
            f"{row['T']:>5}  {b['ms']:>12.0f}{b['product_flops'] / 1e9:>9.1f}"
            f"{b['flop_per_s'] / 1e9:>9.1f}{b['flop_per_s'] / gemm:>9.0%}"
            f"{b['peak_bytes'] / MiB:>10.0f}{(b['peak_bytes'] + b['scratch_bytes']) / MiB:>11.0f}"
            f"{row['io_bytes'] / MiB:>8.0f}"
            f"{(b['peak_bytes'] + b['scratch_bytes']) / row['io_bytes']:>19.2f}"
        )
    if not record["layer_rows"]:
        return "\n".join([*lines, "", "whole-layer benchmark: not run with --filter"])
    lines += [
        "",
        f"Whole layer (Qwen3-Next GatedDeltaNet, hidden {QWEN3_NEXT_LAYER.hidden_size}, bf16): "
        "one training step "
        "(value_and_grad over the layer's parameters); io: its input, output, parameters and "
        "gradients (bench.train.layer_io_bytes)",
        f"{'T':>5}  {'ours (patched layer)':<30}{'mlx-lm stock layer':<40}{'speed-up':>10}"
        f"{'io MiB':>8}{'ours peak/io':>14}",
    ]
    for row in record["layer_rows"]:
        c = row["cells"]
        ours = c["ours (patched layer)"]
        lines.append(
            f"{row['T']:>5}  {_cell(ours):<30}"
            f"{_cell(c['mlx-lm stock layer']):<40}"
            f"{_speedup(row, 'mlx-lm stock layer', 'ours (patched layer)'):>10}"
            f"{row['io_bytes'] / MiB:>8.0f}{ours['peak_bytes'] / row['io_bytes']:>14.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """The --train benchmark of `python -m mlx_gated_delta bench`."""
    mx.set_default_device(mx.cpu)
    quick = getattr(args, "quick", False)
    full = getattr(args, "full", False)
    tokens_list = QUICK_TOKENS if quick else TOKENS
    # --filter selects the core op's rows by their label, "T=<tokens>", and
    # leaves the whole-layer rows out (mlx-lm's stock layer holds the cores
    # for minutes at T=2048), as in the default benchmark.
    row_filter = getattr(args, "filter", None)
    if row_filter:
        tokens_list = [t for t in tokens_list if row_filter.search(f"T={t}")]
        if not tokens_list:
            raise SystemExit(f"no training row matches --filter {row_filter.pattern!r}")

    def progress(label):
        print(f"... {label}", file=sys.stderr, flush=True)

    load_before = load_average()
    progress("GEMM roofline (before the rows)")
    before = measure_rooflines()
    core = core_rows(tokens_list, quick, full, progress)
    layer = [] if row_filter else layer_rows(tokens_list, quick, full, progress)
    progress("GEMM roofline (after the rows)")
    roofline = best_rooflines(before, measure_rooflines())
    record = {
        **cpu_run_record(load_before),
        "roofline": roofline,
        "core_rows": core,
        "layer_rows": layer,
    }
    text = report_text(record)
    out = Path(getattr(args, "out", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_results.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "train_results.txt").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'train_results.json'}, {out / 'train_results.txt'}")
    return record
