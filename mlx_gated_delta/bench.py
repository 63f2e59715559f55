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

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

MiB = 1 << 20
STATE_BYTES_PER_ELEMENT = 4  # the recurrent state is always float32
IMPLEMENTATIONS = ("mlx_core", "mlx_lm", "recurrent", "chunked", "auto")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16"}

# MLX core and mlx-lm unroll the recurrence into an op graph per token on the CPU: about 4 s
# per call at T=2048 on 2 cores (MLX core's warm-up takes three times as long), and the graph
# holds every token's state until it is evaluated (4 GiB at T=2048, 16 GiB at T=8192).
PEERS = ("mlx_core", "mlx_lm")
PEERS_MAX_T_UNLESS_FULL = 2048


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark row: the problem size and the activation dtype."""

    family: str  # "qwen3-next", or what a generic shape changes from it ("Dk=96")
    B: int
    T: int
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    dtype: str  # a key of DTYPES; the state is float32 whatever this is
    per_key: bool = False  # a decay per key channel (Kimi Delta Attention), g [B, T, Hv, Dk]

    @property
    def is_decode(self) -> bool:
        return self.T == 1

    @property
    def short_label(self) -> str:
        return f"{self.family} {SHORT_DTYPE[self.dtype]} B={self.B} T={self.T}"

    @property
    def label(self) -> str:
        return f"{self.short_label} Hk={self.Hk} Hv={self.Hv} Dk={self.Dk} Dv={self.Dv}"


def work_flop(s: Shape) -> int:
    """FLOP of one call: decay, prediction S@k, rank-1 update and readout S@q, 2 per MAC."""
    return 8 * s.B * s.T * s.Hv * s.Dk * s.Dv


def state_bytes(s: Shape) -> int:
    """Bytes of one float32 state [B, Hv, Dv, Dk]."""
    return s.B * s.Hv * s.Dv * s.Dk * STATE_BYTES_PER_ELEMENT


def state_traffic_bytes(s: Shape) -> int:
    """Bytes of state one call must move at least: read once and written once."""
    return 2 * state_bytes(s)


def io_bytes(s: Shape) -> int:
    """Inputs read once plus outputs written once (the floor for any implementation)."""
    act = DTYPES[s.dtype].size
    qk = 2 * s.B * s.T * s.Hk * s.Dk * act
    v_and_y = 2 * s.B * s.T * s.Hv * s.Dv * act
    gate_values = s.Dk if s.per_key else 1
    g_and_beta = s.B * s.T * s.Hv * (gate_values + 1) * 4  # read in float32
    return qk + v_and_y + g_and_beta + state_traffic_bytes(s)


def qwen3_next(B: int, T: int, dtype: str) -> Shape:
    return Shape("qwen3-next", B, T, Hk=16, Hv=32, Dk=128, Dv=128, dtype=dtype)


def kimi_linear(B: int, T: int, dtype: str, per_key: bool) -> Shape:
    family = "kimi-linear-kda" if per_key else "kimi-linear-scalar"
    return Shape(family, B, T, Hk=32, Hv=32, Dk=128, Dv=128, dtype=dtype, per_key=per_key)


def kda_shapes(quick: bool) -> list[Shape]:
    """The KDA rows (``--kda``): decode at B=1 and prefill, f32 and bf16, each with per-key
    gates and, measured in the same run, with scalar gates on the same shape (what the
    per-key decay costs); ``quick`` keeps T in {1, 512}."""
    lengths = (1, 512) if quick else (1, 64, 512, 2048)
    return [
        kimi_linear(1, T, d, per_key) for d in DTYPES for T in lengths for per_key in (True, False)
    ]


def benchmark_shapes(quick: bool) -> list[Shape]:
    """The benchmark shapes (benchmarks/RESULTS.md); ``quick`` keeps the Qwen3-Next B=1 rows up to T=2048."""
    dtypes = list(DTYPES)
    if quick:
        return [qwen3_next(1, T, d) for d in dtypes for T in (1, 64, 512, 2048)]
    shapes = [qwen3_next(B, 1, d) for d in dtypes for B in (1, 8)]
    shapes += [qwen3_next(1, T, d) for d in dtypes for T in (64, 512, 2048, 8192)]
    shapes += [qwen3_next(4, 512, d) for d in dtypes]
    shapes += [
        Shape("Dk=Dv=64", 1, 2048, Hk=16, Hv=32, Dk=64, Dv=64, dtype="float32"),
        Shape("Dk=96", 1, 2048, Hk=16, Hv=32, Dk=96, Dv=128, dtype="float32"),
        Shape("Hk=Hv", 1, 2048, Hk=32, Hv=32, Dk=128, Dv=128, dtype="float32"),
    ]
    return shapes


# ---------------------------------------------------------------------------------------
# Rooflines
# ---------------------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, thread pools, BLAS kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 7) -> dict:
    """NumPy ``copyto`` of ``nbytes``: bytes read + written per second.

    Measured on one thread and split over all cores (our kernels use all cores, so the
    larger of the two is the roofline they are held to).
    """
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    moved = 2 * src.nbytes
    one_thread = moved / _median_seconds(lambda: np.copyto(dst, src), repeats)

    cores = os.cpu_count() or 1
    bounds = np.linspace(0, src.size, cores + 1).astype(np.int64)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(cores) as pool:  # copyto releases the GIL

        def copy_all_cores():
            list(pool.map(lambda p: np.copyto(*p), parts))

        all_cores = moved / _median_seconds(copy_all_cores, repeats)
    return {
        "bytes_copied": src.nbytes,
        "one_thread_bytes_per_s": one_thread,
        "all_cores_bytes_per_s": all_cores,
        "threads": cores,
        "bytes_per_s": max(one_thread, all_cores),
    }


def measure_gemm_flops(n: int = 2048, repeats: int = 7) -> dict:
    """Warm float32 ``n x n`` matrix product through NumPy's BLAS: FLOP per second."""
    rng = np.random.default_rng(1)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)  # a cold first call is far slower; keep it out of the median
    seconds = _median_seconds(lambda: np.matmul(a, b, out=c), repeats)
    return {"n": n, "flop_per_s": 2 * n**3 / seconds}


def measure_rooflines() -> dict:
    """Both rooflines, measured now."""
    return {"copy": measure_copy_bandwidth(), "gemm": measure_gemm_flops()}


def best_rooflines(before: dict, after: dict) -> dict:
    """The higher of the two measurements of each roofline: a neighbour's load during one of
    them must not make our fraction of the machine look better than it is."""
    return {
        "copy": max(before["copy"], after["copy"], key=lambda m: m["bytes_per_s"]),
        "gemm": max(before["gemm"], after["gemm"], key=lambda m: m["flop_per_s"]),
        "before_rows": before,
        "after_rows": after,
    }


def last_level_cache_bytes() -> int | None:
    """Size of the largest data/unified cache of CPU 0 from sysfs, or None if unreadable."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = value if best is None else max(best, value)
    return best


FALLBACK_STATE_POOL_BYTES = 512 * MiB


def state_pool_bytes(llc: int | None) -> int:
    """Total size of the rotated decode states: twice the LLC, since adaptive replacement
    policies keep part of a cyclic working set only slightly larger than the cache."""
    return 2 * llc if llc else FALLBACK_STATE_POOL_BYTES


# ---------------------------------------------------------------------------------------
# Inputs and implementations
# ---------------------------------------------------------------------------------------


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
    from . import gated_delta_rule

    return lambda x, state: gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, state, algorithm=name)


def peer_memory_bytes(s: Shape) -> int:
    """What MLX core and mlx-lm allocate per call: one float32 state per token (measured
    peaks: 4.1 GiB at T=2048, 16.3 GiB at T=8192 for the Qwen3-Next shape)."""
    return s.T * state_bytes(s)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
# Timing
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to spend on one measurement: as many repeats as fit in ``seconds`` after the
    warm-up, at least one, at most ``max_repeats``."""

    seconds: float
    max_repeats: int


def repeats_within(budget: Budget, warm_up_seconds: float) -> int:
    if warm_up_seconds <= 0:
        return budget.max_repeats
    return max(1, min(budget.max_repeats, int(budget.seconds / warm_up_seconds)))


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


def timed_call(call: Callable[[Inputs, mx.array], tuple], x: Inputs) -> float:
    """Seconds to build the graph of one call and evaluate it."""
    state = x.take_state()
    start = time.perf_counter()
    mx.eval(call(x, state))
    return time.perf_counter() - start


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|: how far two implementations' outputs are."""
    scale = float(np.max(np.abs(expected))) or 1.0
    return float(np.max(np.abs(actual.astype(np.float64) - expected))) / scale


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (tqdm's when it is installed).

    Calling it with a label announces the next step; ``advance()`` counts one step done.
    """

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.started = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self._tqdm = None
        else:
            self._tqdm = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)

    def __call__(self, label: str) -> None:
        if self._tqdm is not None:
            self._tqdm.set_description_str(label)
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.started
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label[:60]:<60}")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.update(1)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            self("done")
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------------------
# One row
# ---------------------------------------------------------------------------------------


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

    # Repeats go round-robin over the implementations, so that a neighbour's burst of load
    # falls on all of them alike rather than on whichever happened to run then.
    rounds = max(repeats.values(), default=0)
    for round_index in range(rounds):
        progress(f"{s.short_label} timed round {round_index + 1}/{rounds}")
        for name, call in calls.items():
            result = row["results"][name]
            if result["status"] != "ok" or len(result["times_s"]) >= repeats[name]:
                continue
            try:
                result["times_s"].append(timed_call(call, x))
            except Exception as error:
                row["results"][name] = {
                    "status": "error",
                    "error": f"{type(error).__name__}: {error}",
                }
    for result in row["results"].values():
        if result["status"] == "ok":
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
        f"{machine['cpu_model']}, {machine['cores']} cores; 1-min load average "
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
# Provenance and plot
# ---------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        return subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"


def load_average() -> float | None:
    """The 1-minute load average: how many other runnable tasks shared the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def git_commit() -> str:
    """The commit of the checkout the benchmark script runs from (``+dirty`` when it has
    uncommitted changes), or "unknown" outside a git checkout (an installed package)."""
    script = Path(sys.argv[0]).resolve()
    where = script.parent if script.is_file() else Path.cwd()

    def git(*args):
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=where, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


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


LAYER_BENCHMARK_MODULE = "mlx_gated_delta.bench_layer"


def run_layer_rows(quick: bool, progress: Progress) -> tuple[list | None, str | None]:
    """Rows of the whole-layer benchmark when ``mlx_gated_delta.bench_layer`` exists."""
    try:
        bench_layer = importlib.import_module(LAYER_BENCHMARK_MODULE)
    except ModuleNotFoundError as error:
        if error.name != LAYER_BENCHMARK_MODULE:
            raise
        return None, None
    try:
        return bench_layer.run_layer_benchmark(quick, progress), None
    except Exception as error:
        return None, f"layer benchmark failed: {type(error).__name__}: {error}"


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"not a regular expression: {error}") from None


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
        help="the training benchmark instead (mlx_gated_delta/bench_train.py): forward "
        "plus backward time and peak memory of the core op at T in {512, 2048, 8192} "
        "against mx.fast.gated_delta_update's vjp and mlx-lm's training path, the "
        "backward's GFLOP/s against the GEMM roofline, and the whole layer's training "
        "step; --quick and --full apply",
    )
    parser.add_argument(
        "--filter",
        metavar="REGEX",
        type=_regex,
        help="only rows whose label matches, e.g. 'bf16 B=1 T=2048' "
        "(the whole-layer rows are then left out)",
    )
    parser.add_argument(
        "--kda",
        action="store_true",
        help="the Kimi Delta Attention rows instead: Kimi-Linear's shape (Hk=Hv=32, "
        "Dk=Dv=128) with per-key-channel gates and with scalar gates, decode and "
        "prefill (with --quick: T in {1, 512}); the whole-layer rows are left out",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="benchmarks/out",
        help="where results.json, results.txt and the plot go (default: benchmarks/out)",
    )


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "train", False):
        from . import bench_train

        return bench_train.run(args)
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
        "command": " ".join(sys.argv),
        "mode": "quick" if args.quick else ("full" if args.full else "default"),
        "kda": args.kda,
        "machine": {
            "platform": platform.platform(),
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
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
