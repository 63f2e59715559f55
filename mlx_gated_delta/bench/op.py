"""Benchmark of the gated delta rule against its peers, with rooflines measured in the same run.

Peers (all computing the same thing on the same inputs):

- MLX core: ``mx.fast.gated_delta_update`` with ``gamma = exp(g)`` and ``q`` pre-scaled by
  ``Dk ** -0.5`` (MLX applies no scale of its own).
- mlx-lm: ``mlx_lm.models.gated_delta.gated_delta_ops``, what mlx-lm runs off-Metal, with the
  same pre-scaled ``q`` and linear ``gamma``.
- ours: ``gated_delta_rule`` with ``algorithm`` = ``"recurrent"``, ``"chunked"`` and ``"auto"``.

``--kda`` runs Kimi Delta Attention instead: Kimi-Linear's shape with a decay per key channel
(``g`` of shape ``[B, T, Hv, Dk]``) for every implementation (mlx-lm's ``kimi_linear`` runs
``gated_delta_ops`` with that vector gate off-Metal), each row next to the same shape with
scalar gates, measured in the same run.

Machines are shared and noisy, so every figure is a median of repeats after a warm-up, and
the rooflines (copy bandwidth, float32 GEMM FLOP/s through NumPy's BLAS) are measured in the
same run so that ratios stay meaningful. Work per call is ``8 * B * T * Hv * Dk * Dv`` FLOP;
the state traffic of a decode call is ``2 * B * Hv * Dv * Dk * 4`` bytes (read and written
once), and decode calls rotate among states whose total exceeds the last-level cache, so the
traffic reaches memory rather than the cache.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from .machine import MiB, available_memory_bytes
from .shapes import DTYPES, Shape, io_bytes, state_bytes, state_traffic_bytes, work_flop
from .timing import Budget, Progress, repeats_within, time_rounds

IMPLEMENTATIONS = ("mlx_core", "mlx_lm", "recurrent", "chunked", "auto")

# MLX core and mlx-lm unroll the recurrence into an op graph per token on the CPU: about 4 s
# per call at T=2048 on 2 cores (MLX core's warm-up takes three times as long), and the graph
# holds every token's state until it is evaluated (4 GiB at T=2048, 16 GiB at T=8192).
PEERS = ("mlx_core", "mlx_lm")
PEERS_MAX_T_UNLESS_FULL = 2048


# ---------------------------------------------------------------------------------------
# Inputs and implementations
# ---------------------------------------------------------------------------------------


FALLBACK_STATE_POOL_BYTES = 512 * MiB


def state_pool_bytes(llc: int | None) -> int:
    """Total size of the rotated decode states: twice the LLC, since adaptive replacement
    policies keep part of a cyclic working set only slightly larger than the cache."""
    return 2 * llc if llc else FALLBACK_STATE_POOL_BYTES


@dataclasses.dataclass
class Inputs:
    """One row's inputs in the form each implementation takes, all evaluated up front."""

    q: mx.array
    k: mx.array
    v: mx.array
    g: mx.array  # log-space decay, float32 ([B, T, Hv] or, per key, [B, T, Hv, Dk])
    beta: mx.array  # float32
    q_prescaled: mx.array  # q * Dk**-0.5, for the peers that apply no scale
    gamma: mx.array  # exp(g), the peers' linear decay
    states: list  # float32 [B, Hv, Dv, Dk]; decode rotates among them
    # states[0] is the warm-ups' (the same for every implementation, so their outputs can be
    # compared); the timed calls rotate from the next one on.
    next_state: int = 1

    def take_state(self) -> mx.array:
        state = self.states[self.next_state % len(self.states)]
        self.next_state += 1
        return state


def make_inputs(s: Shape, state_count: int, seed: int = 0) -> Inputs:
    """Realistic, numerically tame inputs: unit-norm q and k per head (as after the layer's
    L2 norm, so the delta rule stays contractive), decays in [0.9, 1), beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[s.dtype]

    def unit_rows(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit_rows((s.B, s.T, s.Hk, s.Dk))
    k = unit_rows((s.B, s.T, s.Hk, s.Dk))
    v = rng.standard_normal((s.B, s.T, s.Hv, s.Dv), dtype=np.float32)
    gate_shape = (s.B, s.T, s.Hv, s.Dk) if s.per_key else (s.B, s.T, s.Hv)
    gamma = rng.uniform(0.9, 1.0, gate_shape).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (s.B, s.T, s.Hv)).astype(np.float32)
    states = [
        mx.array(rng.uniform(-0.1, 0.1, (s.B, s.Hv, s.Dv, s.Dk)).astype(np.float32))
        for _ in range(state_count)
    ]
    inputs = Inputs(
        q=mx.array(q).astype(dtype),
        k=mx.array(k).astype(dtype),
        v=mx.array(v).astype(dtype),
        g=mx.array(np.log(gamma)),
        beta=mx.array(beta),
        q_prescaled=mx.array(q * s.Dk**-0.5).astype(dtype),
        gamma=mx.array(gamma),
        states=states,
    )
    mx.eval(
        inputs.q,
        inputs.k,
        inputs.v,
        inputs.g,
        inputs.beta,
        inputs.q_prescaled,
        inputs.gamma,
        *states,
    )
    return inputs


def _mlx_lm_ops():
    try:
        from mlx_lm.models.gated_delta import gated_delta_ops
    except ImportError:
        return None
    return gated_delta_ops


def implementation_call(name: str) -> Callable[[Inputs, mx.array], tuple]:
    """The call that computes (y, final state) for one implementation name."""
    if name == "mlx_core":
        return lambda x, state: mx.fast.gated_delta_update(
            x.q_prescaled, x.k, x.v, x.gamma, x.beta, state
        )
    if name == "mlx_lm":
        ops = _mlx_lm_ops()
        return lambda x, state: ops(x.q_prescaled, x.k, x.v, x.gamma, x.beta, state)
    from .. import gated_delta_rule

    return lambda x, state: gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, state, algorithm=name)


def peer_memory_bytes(s: Shape) -> int:
    """What MLX core and mlx-lm allocate per call: one float32 state per token (measured
    peaks: 4.1 GiB at T=2048, 16.3 GiB at T=8192 for the Qwen3-Next shape)."""
    return s.T * state_bytes(s)


def skip_reason(name: str, s: Shape, full: bool, available: int | None) -> str | None:
    """Why an implementation is not run on a shape, or None to run it."""
    if name == "mlx_lm" and _mlx_lm_ops() is None:
        return "mlx-lm not installed"
    if name not in PEERS:
        return None
    if s.T > PEERS_MAX_T_UNLESS_FULL and not full:
        return (
            f"MLX core and mlx-lm are not run at T > {PEERS_MAX_T_UNLESS_FULL} unless --full: "
            "their op-graph loops take about 2 s per 1000 tokens and hold one state per "
            "token in memory"
        )
    needed = peer_memory_bytes(s)
    if available is not None and needed > available // 2:
        return (
            f"{name} not run at {s.short_label}: it holds one state per token, about "
            f"{needed / 2**30:.1f} GiB, over half the {available / 2**30:.1f} GiB available"
        )
    return None


# ---------------------------------------------------------------------------------------
# One row
# ---------------------------------------------------------------------------------------


def warm_up(call: Callable[[Inputs, mx.array], tuple], x: Inputs) -> dict:
    """The first call: it compiles and fills caches, so it is timed but not counted. It also
    records the memory the call allocates and the output, to compare implementations."""
    active_before = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    out = call(x, x.states[0])
    mx.eval(out)
    seconds = time.perf_counter() - start
    return {
        "warm_up_s": seconds,
        "peak_allocated_bytes": int(mx.get_peak_memory() - active_before),
        "y": np.array(out[0].astype(mx.float32)),
    }


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|: how far two implementations' outputs are."""
    scale = float(np.max(np.abs(expected))) or 1.0
    return float(np.max(np.abs(actual.astype(np.float64) - expected))) / scale


def benchmark_row(
    s: Shape, pool_bytes: int, full: bool, budget: Budget, progress: Progress
) -> dict:
    state_count = 1
    if s.is_decode:
        state_count = max(2, math.ceil(pool_bytes / state_bytes(s)))
    x = make_inputs(s, state_count)
    row = {
        "label": s.label,
        "shape": dataclasses.asdict(s),
        "work_flop": work_flop(s),
        "state_traffic_bytes": state_traffic_bytes(s),
        "io_bytes": io_bytes(s),
        "rotated_states": state_count,
        "rotated_state_bytes": state_count * state_bytes(s),
        "results": {},
    }
    calls, outputs, repeats = {}, {}, {}
    for name in IMPLEMENTATIONS:
        progress(f"{s.short_label} {name} (warm-up)")
        reason = skip_reason(name, s, full, available_memory_bytes())
        if reason is not None:
            row["results"][name] = {"status": "skipped", "reason": reason}
        else:
            try:
                calls[name] = implementation_call(name)
                first = warm_up(calls[name], x)
            except Exception as error:  # a failing peer is a result, never the end of the run
                calls.pop(name, None)
                row["results"][name] = {
                    "status": "error",
                    "error": f"{type(error).__name__}: {error}",
                }
            else:
                outputs[name] = first.pop("y")
                repeats[name] = repeats_within(budget, first["warm_up_s"])
                row["results"][name] = {"status": "ok", "times_s": [], **first}
        progress.advance()

    def failed(name: str, error: Exception) -> None:
        row["results"][name] = {"status": "error", "error": f"{type(error).__name__}: {error}"}

    # A timed call builds the graph of one call and evaluates it, on the next rotated state.
    times = time_rounds(
        {name: lambda state, call=call: mx.eval(call(x, state)) for name, call in calls.items()},
        repeats,
        warm_up=False,  # warm_up above ran each call once
        prepare=lambda: (x.take_state(),),
        on_round=lambda i, rounds: progress(f"{s.short_label} timed round {i + 1}/{rounds}"),
        on_error=failed,
    )
    for name, result in row["results"].items():
        if result["status"] == "ok":
            result["times_s"] = times[name]
            result["median_s"] = statistics.median(result["times_s"])
    progress.advance()

    # Every implementation computes the same y; say how far each is from the first that ran.
    outputs = {n: y for n, y in outputs.items() if row["results"][n]["status"] == "ok"}
    if outputs:
        reference = next(iter(outputs))
        row["agreement_reference"] = reference
        for name, y in outputs.items():
            row["results"][name]["max_rel_diff_vs_reference"] = relative_difference(
                y, outputs[reference].astype(np.float64)
            )
    return row


def _median(row: dict, name: str) -> float | None:
    result = row["results"].get(name, {})
    return result.get("median_s") if result.get("status") == "ok" else None


def add_derived_figures(row: dict, s: Shape, roofline: dict) -> None:
    """Tokens/s, speed-ups, roofline fractions and auto's distance from the best algorithm."""
    derived = {}
    auto = _median(row, "auto")
    if auto:
        derived["tokens_per_s"] = s.B * s.T / auto
        for peer in ("mlx_core", "mlx_lm"):
            peer_time = _median(row, peer)
            if peer_time:
                derived[f"speedup_vs_{peer}"] = peer_time / auto
        flops = work_flop(s) / auto
        derived["gflop_per_s"] = flops / 1e9
        derived["fraction_of_gemm"] = flops / roofline["gemm"]["flop_per_s"]
        bandwidth = state_traffic_bytes(s) / auto
        derived["state_gb_per_s"] = bandwidth / 1e9
        derived["fraction_of_copy"] = bandwidth / roofline["copy"]["bytes_per_s"]
        algorithms = [t for t in (_median(row, "recurrent"), _median(row, "chunked")) if t]
        if algorithms:
            derived["auto_over_best_algorithm"] = auto / min(algorithms) - 1.0
        peak = row["results"]["auto"]["peak_allocated_bytes"]
        derived["auto_peak_over_io"] = peak / row["io_bytes"]
    row["derived"] = derived


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the rest right-aligned."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells):
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _milliseconds_text(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def _ms_cell(row: dict, name: str) -> str:
    result = row["results"][name]
    if result["status"] == "ok":
        return _milliseconds_text(result["median_s"] * 1e3)
    return {"skipped": "skip", "error": "err"}[result["status"]]


def _ratio_cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _percent_cell(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}"


def results_table(rows: list[dict], decode: bool) -> str:
    """The decode table (state GB/s against copy) or the prefill table (GFLOP/s against GEMM)."""
    headers = [
        "shape",
        "core ms",
        "mlx-lm ms",
        "rec ms",
        "chunk ms",
        "auto ms",
        "tok/s",
        "x core",
        "x mlx-lm",
    ]
    headers += ["state GB/s", "% copy"] if decode else ["GFLOP/s", "% GEMM"]
    headers += ["auto vs best", "peak/io MiB"]
    body = []
    for row in rows:
        s = row["shape"]
        if (s["T"] == 1) != decode:
            continue
        d = row["derived"]
        peak = row["results"]["auto"].get("peak_allocated_bytes")
        cells = [Shape(**s).label if s["family"] != "qwen3-next" else Shape(**s).short_label]
        cells += [_ms_cell(row, n) for n in IMPLEMENTATIONS]
        cells.append(_ratio_cell(d.get("tokens_per_s"), ",.0f"))
        cells.append(_ratio_cell(d.get("speedup_vs_mlx_core"), ".1f"))
        cells.append(_ratio_cell(d.get("speedup_vs_mlx_lm"), ".1f"))
        if decode:
            cells.append(_ratio_cell(d.get("state_gb_per_s"), ".1f"))
            cells.append(_percent_cell(d.get("fraction_of_copy")))
        else:
            cells.append(_ratio_cell(d.get("gflop_per_s"), ".1f"))
            cells.append(_percent_cell(d.get("fraction_of_gemm")))
        best = d.get("auto_over_best_algorithm")
        cells.append("-" if best is None else f"{round(100 * best):+d}%")
        cells.append("-" if peak is None else f"{peak / MiB:.1f}/{row['io_bytes'] / MiB:.1f}")
        body.append(cells)
    return format_table(headers, body)


def layer_table(rows: list[dict]) -> str:
    headers = ["layer", "shape", "ours ms", "mlx-lm ms", "speed-up"]
    body = [
        [
            str(r.get("name", "")),
            str(r.get("shape", "")),
            _milliseconds_text(r.get("ours_ms")),
            _milliseconds_text(r.get("mlx_lm_ms")),
            _ratio_cell(r.get("speedup"), ".1f"),
        ]
        for r in rows
    ]
    return format_table(headers, body)


def roofline_summary(roofline: dict) -> str:
    copy, gemm = roofline["copy"], roofline["gemm"]
    return (
        f"Rooflines (this run, the better of before and after the rows): "
        f"copy {copy['bytes_per_s'] / 1e9:.1f} GB/s read+write "
        f"(NumPy copyto of {copy['bytes_copied'] // MiB} MiB; one thread "
        f"{copy['one_thread_bytes_per_s'] / 1e9:.1f}, {copy['threads']} threads "
        f"{copy['all_cores_bytes_per_s'] / 1e9:.1f}); float32 GEMM "
        f"{gemm['flop_per_s'] / 1e9:.0f} GFLOP/s (NumPy BLAS, {gemm['n']}x{gemm['n']}, warm)."
    )


def report_text(record: dict) -> str:
    rows = record["rows"]
    machine = record["machine"]
    parts = [
        f"{machine['cpu_model']}, {machine['cores']} cores ({machine['usable_cpus']} usable), "
        f"our CPU pool {machine['cpu_threads']} threads, kernels "
        f"{machine['cpu_kernel_level']}; 1-min load average "
        f"{machine['load_average_1min_before']} before, {machine['load_average_1min_after']} after.",
        roofline_summary(record["roofline"]),
        "",
    ]
    if any(r["shape"]["T"] == 1 for r in rows):
        llc = record["machine"]["last_level_cache_bytes"]
        llc_text = f"{llc // MiB} MiB" if llc else "unknown"
        parts += [
            f"Decode (T=1; states rotated over {record['state_pool_bytes'] // MiB} MiB, "
            f"last-level cache {llc_text}):",
            results_table(rows, decode=True),
            "",
        ]
    if any(r["shape"]["T"] > 1 for r in rows):
        parts += ["Prefill:", results_table(rows, decode=False), ""]
    parts.append(
        "ms: median per call (graph built and evaluated). core = mx.fast.gated_delta_update, "
        "mlx-lm = gated_delta_ops, rec/chunk/auto = ours. x core / x mlx-lm: speed-up of auto. "
        "auto vs best: auto's time over the faster of rec and chunk. peak/io: memory auto "
        "allocates per call / inputs + outputs. skip: not run (see notes); err: failed (see JSON)."
    )
    notes = sorted(
        {res["reason"] for r in rows for res in r["results"].values() if res["status"] == "skipped"}
    )
    parts += [f"note: {n}" for n in notes]
    errors = [
        f"error: {r['label']} {name}: {res['error']}"
        for r in rows
        for name, res in r["results"].items()
        if res["status"] == "error"
    ]
    parts += errors
    if record.get("layer_rows") is not None:
        parts += [
            "",
            "Whole layer (ours vs mlx-lm's stock layer):",
            layer_table(record["layer_rows"]),
        ]
    elif record.get("layer_note"):
        parts += ["", record["layer_note"]]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------


def write_plot(rows: list[dict], path: Path) -> str | None:
    """Tokens/s against T per implementation (Qwen3-Next, B=1), one panel per dtype.
    Returns a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    if not any(r["shape"]["family"] == "qwen3-next" for r in rows):
        return "plot skipped: no Qwen3-Next rows"
    dtypes = [d for d in DTYPES if any(r["shape"]["dtype"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        series = [
            r
            for r in rows
            if r["shape"]["family"] == "qwen3-next"
            and r["shape"]["B"] == 1
            and r["shape"]["dtype"] == dtype
        ]
        series.sort(key=lambda r: r["shape"]["T"])
        for name in IMPLEMENTATIONS:
            points = [
                (r["shape"]["T"], r["shape"]["T"] / r["results"][name]["median_s"])
                for r in series
                if r["results"][name]["status"] == "ok"
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens per call)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"Qwen3-Next shape, B=1, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
