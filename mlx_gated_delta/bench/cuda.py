"""The CUDA benchmark, ``python -m mlx_gated_delta bench --cuda``: on one NVIDIA GPU, in one
run, our op against MLX core's ``mx.fast.gated_delta_update`` (MLX's CUDA build) and FLA's
Triton kernels (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, through
PyTorch), on the Qwen3-Next shape (Hk=16, Hv=32, Dk=Dv=128), bf16 q/k/v, float32 gates and
state.

Every implementation gets the same work: q and k already L2-normalised (untimed), the scale
Dk^-0.5 (MLX core takes it pre-multiplied into q), an initial state, the final state returned.
Times are medians of repeats after a warm-up call:

- ``call``: one call, its wall time from issue to the GPU's end (``mx.eval`` and
  ``mx.synchronize``; for FLA ``torch.cuda.synchronize``): what an eager caller waits;
- ``per call, n chained`` (MLX): ``n`` calls in one graph, the state passed from each to the
  next, one evaluation, divided by ``n``: the launch and graph overheads amortised, the
  nearest MLX figure to GPU time;
- ``GPU`` (MLX): the GPU time of one call, the kernels' times that CUPTI records (through
  PyTorch's profiler, which sees the kernels of MLX's CUDA graphs) summed per call;
- ``graph`` (FLA): one call captured in a CUDA graph, each replay timed by CUDA events: GPU
  time.

The per-key rows (``KDA_TOKENS``, B=1) give every value head a decay per key channel (g
``[B, T, Hv, Dk]``, Kimi Delta Attention's) on the same shape, against FLA's ``chunk_kda``
(graph-replayed) and our own scalar-gate row of the same length.

The whole-layer rows (``cuda_layer``) set the patched Qwen3-Next layer against mlx-lm's stock
layer on MLX's CUDA device.

The training step (``TRAINING_TOKENS``, B=1) is our forward and backward (``mx.vjp`` for the
cotangents of y and of the final state; every input's gradient), timed one step at a time and
``n`` independent steps to an evaluation: the ``n`` figure is a throughput (independent steps
in one graph may run side by side where one leaves the GPU idle), not one step's time, and the
step's figure is the single call. FLA's backward does
not run on the GPU machine's Triton, so the step is set against FLA's chunked forward
(graph-replayed) of the prefill row of the same length. The same row times the step with
per-key gates (the per-key rows' gates) through ``"auto"`` (the chunked forward and backward)
and through ``"recurrent"``, set against the scalar-gate step.

The comparison with FLA uses our chained figure against FLA's graph replay, and our GPU
time against it (GPU time on both sides). Peak memory is the
growth of each framework's allocator peak over one call. Bandwidth and FLOP/s use the copy
bandwidth measured here (a device-to-device copy through PyTorch, bytes read + written) and
the "useful" FLOP count 8 B T Hv Dk Dv of FLA's reports.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import gated_delta_rule
from . import cuda_layer

HK, HV, D = 16, 32, 128
DECODE_BATCHES = (1, 8, 64)
PREFILL_TOKENS = (2048, 8192, 32768)
TRAINING_TOKENS = (2048, 8192)
KDA_TOKENS = (2048, 8192)
# MLX core's CUDA op is a per-token op loop (about 0.1 s per 1000 tokens): timed up to here.
MLX_CORE_MAX_TOKENS = 8192
CHAINED_CALLS = {1: 64, 2048: 8, 8192: 4, 32768: 2}


def _torch():
    import torch

    return torch


def _fla():
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _fla_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def draw(batch: int, tokens: int, seed: int = 0) -> dict:
    """float32 NumPy inputs of one row; q and k L2-normalised per head."""
    rng = np.random.default_rng(seed)

    def normalised(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    return {
        "q": normalised((batch, tokens, HK, D)),
        "k": normalised((batch, tokens, HK, D)),
        "v": rng.standard_normal((batch, tokens, HV, D)).astype(np.float32),
        "g": -rng.uniform(0.01, 0.3, (batch, tokens, HV)).astype(np.float32),
        "beta": rng.uniform(0.0, 1.0, (batch, tokens, HV)).astype(np.float32),
        "state": (0.1 * rng.standard_normal((batch, HV, D, D))).astype(np.float32),
    }


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _repeats(tokens: int) -> int:
    return 50 if tokens == 1 else (20 if tokens <= 8192 else 8)


def gpu_ms(call, repeats: int) -> float:
    """GPU time per call: every kernel (and copy) CUPTI records over ``repeats`` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _torch().cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(repeats):
            mx.eval(call())
            mx.synchronize()
    total_us = sum(e.device_time for e in trace.events() if e.device_type == DeviceType.CUDA)
    return total_us / 1e3 / repeats


def time_mlx(call, state: mx.array, tokens: int, repeats: int | None = None) -> dict:
    """``call(state) -> (y, state)`` timed one call at a time and chained."""
    repeats = repeats or _repeats(tokens)
    # MLX's CUDA buffers are unified memory: a new one faults its pages onto the GPU at
    # first touch. Buffers cached by the rows and implementations before (MLX core's op
    # loop leaves gigabytes of them) are released, so that the warm-up call leaves this
    # implementation's own buffers in the cache for the timed calls to reuse.
    mx.clear_cache()
    mx.eval(call(state))
    mx.synchronize()
    singles = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(call(state))
        mx.synchronize()
        singles.append(time.perf_counter() - start)
    n = CHAINED_CALLS[tokens] if repeats >= 10 else 2

    def chained():
        outputs, s = [], state
        for _ in range(n):
            y, s = call(s)
            outputs.append(y)
        return outputs + [s]

    mx.eval(chained())
    mx.synchronize()
    chains = []
    for _ in range(max(3, repeats // 4)):
        start = time.perf_counter()
        mx.eval(chained())
        mx.synchronize()
        chains.append((time.perf_counter() - start) / n)
    mx.synchronize()
    gpu = gpu_ms(lambda: call(state), repeats)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(call(state))
    mx.synchronize()
    return {
        "call_ms": _median_ms(singles),
        "chained_ms": _median_ms(chains),
        "chained_calls": n,
        "gpu_ms": gpu,
        "peak_mib": (mx.get_peak_memory() - before) / 2**20,
    }


def time_torch(call, tokens: int) -> dict:
    """``call()`` timed eagerly and as a CUDA graph replay."""
    torch = _torch()
    call()
    torch.cuda.synchronize()
    singles = []
    for _ in range(_repeats(tokens)):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        singles.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # Triton compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replays = []
    for _ in range(3):
        graph.replay()
    for _ in range(4 * _repeats(tokens)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) / 1e3)
    return {"call_ms": _median_ms(singles), "graph_ms": _median_ms(replays), "peak_mib": peak}


def time_training(step, tokens: int) -> dict:
    """``step() -> arrays`` (one forward and backward) timed one at a time and ``n`` to
    an evaluation, with the growth of MLX's peak memory over one step."""
    mx.clear_cache()
    mx.eval(step())
    mx.synchronize()
    singles = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(step())
        mx.synchronize()
        singles.append(time.perf_counter() - start)
    n = CHAINED_CALLS[tokens]
    chains = []
    for _ in range(3):
        start = time.perf_counter()
        mx.eval([step() for _ in range(n)])
        mx.synchronize()
        chains.append((time.perf_counter() - start) / n)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(step())
    mx.synchronize()
    return {
        "call_ms": _median_ms(singles),
        "chained_ms": _median_ms(chains),
        "chained_calls": n,
        "peak_mib": (mx.get_peak_memory() - before) / 2**20,
    }


def training_row(tokens: int) -> dict:
    """Our training step with scalar gates, and with per-key gates through each algorithm
    (``"auto"``: the chunked forward and backward; ``"recurrent"``: both recurrent)."""
    x = draw(1, tokens)
    q, k, v = (mx.array(x[n]).astype(mx.bfloat16) for n in ("q", "k", "v"))
    g, beta, state = (mx.array(x[n]) for n in ("g", "beta", "state"))
    key_gates = mx.array(per_key_gates(tokens))
    rng = np.random.default_rng(1)
    dy = mx.array(rng.standard_normal(x["v"].shape).astype(np.float32)).astype(mx.bfloat16)
    dstate = mx.array(rng.standard_normal(x["state"].shape).astype(np.float32))
    mx.eval(q, k, v, g, beta, state, key_gates, dy, dstate)

    def step_of(gates, algorithm):
        def forward(*inputs):
            return list(gated_delta_rule(*inputs, scale=D**-0.5, algorithm=algorithm))

        def step():
            outputs, grads = mx.vjp(forward, [q, k, v, gates, beta, state], [dy, dstate])
            return outputs + grads

        return step

    return {
        "tokens": tokens,
        "ours": time_training(step_of(g, "auto"), tokens),
        "ours_per_key": time_training(step_of(key_gates, "auto"), tokens),
        "ours_per_key_recurrent": time_training(step_of(key_gates, "recurrent"), tokens),
    }


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy through PyTorch."""
    torch = _torch()
    src = torch.empty(2**30, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(samples)


def compare_torch(result: dict, x: dict, implementations: dict, y_ours, state_ours) -> None:
    """Times each ``implementations[name](t, common)`` (PyTorch, FLA's layouts) on the inputs
    ``x`` into ``result[name]``, with its y and final state against ours (norm ratios)."""
    torch = _torch()
    t = {
        n: torch.from_numpy(x[n]).cuda().to(torch.bfloat16 if n in "qkv" else torch.float32)
        for n in ("q", "k", "v", "g", "beta")
    }
    # FLA keeps the state [B, H, Dk, Dv]; ours is [B, H, Dv, Dk].
    h0 = torch.from_numpy(x["state"]).cuda().transpose(-1, -2).contiguous()
    common = {"scale": D**-0.5, "initial_state": h0, "output_final_state": True}
    tokens = x["q"].shape[1]
    y_ours_np = np.asarray(y_ours.astype(mx.float32))
    state_ours_np = np.asarray(state_ours)
    for name, implementation in implementations.items():

        def call(implementation=implementation):
            return implementation(**t, **common)

        result[name] = time_torch(call, tokens)
        y, final = call()
        torch.cuda.synchronize()
        y_fla = y.float().cpu().numpy()
        result[name]["y_vs_ours"] = float(
            np.linalg.norm(y_fla - y_ours_np) / np.linalg.norm(y_ours_np)
        )
        state_fla = final.transpose(-1, -2).float().cpu().numpy()
        result[name]["state_vs_ours"] = float(
            np.linalg.norm(state_fla - state_ours_np) / np.linalg.norm(state_ours_np)
        )


def row(batch: int, tokens: int, fla) -> dict:
    x = draw(batch, tokens)
    scale = D**-0.5
    q, k, v = (mx.array(x[n]).astype(mx.bfloat16) for n in ("q", "k", "v"))
    g, beta, state = (mx.array(x[n]) for n in ("g", "beta", "state"))
    q_prescaled = (q.astype(mx.float32) * scale).astype(mx.bfloat16)
    gamma = mx.exp(g)
    mx.eval(q, k, v, g, beta, state, q_prescaled, gamma)
    result = {"batch": batch, "tokens": tokens}

    def ours(s):
        return gated_delta_rule(q, k, v, g, beta, s, scale=scale)

    result["ours"] = time_mlx(ours, state, tokens)
    y_ours, state_ours = ours(state)
    mx.eval(y_ours, state_ours)
    if tokens <= MLX_CORE_MAX_TOKENS:

        def core(s):
            return mx.fast.gated_delta_update(q_prescaled, k, v, gamma, beta, s)

        # Its op loop takes a tenth of a second per thousand tokens: few repeats.
        result["mlx_core"] = time_mlx(core, state, tokens, repeats=None if tokens == 1 else 3)

    if fla is not None:
        chunk, fused_recurrent = fla
        implementations = {"fla_recurrent": fused_recurrent}
        if tokens > 1:
            implementations["fla_chunk"] = chunk
        compare_torch(result, x, implementations, y_ours, state_ours)
    return result


def per_key_gates(tokens: int) -> np.ndarray:
    """B=1 gates of the per-key rows, a decay per key channel: g [1, T, Hv, Dk]."""
    return -np.random.default_rng(2).uniform(0.01, 0.3, (1, tokens, HV, D)).astype(np.float32)


def kda_row(tokens: int, chunk_kda) -> dict:
    """B=1, per-key gates: ours (``"auto"``, the chunked kernels) against FLA's chunk_kda."""
    x = draw(1, tokens)
    x["g"] = per_key_gates(tokens)
    q, k, v = (mx.array(x[n]).astype(mx.bfloat16) for n in ("q", "k", "v"))
    g, beta, state = (mx.array(x[n]) for n in ("g", "beta", "state"))
    mx.eval(q, k, v, g, beta, state)
    result = {"tokens": tokens}

    def ours(s):
        return gated_delta_rule(q, k, v, g, beta, s, scale=D**-0.5)

    result["ours"] = time_mlx(ours, state, tokens)
    y_ours, state_ours = ours(state)
    mx.eval(y_ours, state_ours)
    if chunk_kda is not None:
        compare_torch(result, x, {"fla_chunk_kda": chunk_kda}, y_ours, state_ours)
    return result


def _prefill_row(record: dict, tokens: int) -> dict:
    """The scalar-gate row of B=1 and ``tokens`` tokens, which the training and per-key
    rows are set against."""
    return next(p for p in record["rows"] if p["batch"] == 1 and p["tokens"] == tokens)


def table(record: dict) -> str:
    bandwidth = record["copy_bandwidth_bytes_per_s"]
    lines = [
        f"GPU: {record['gpu']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)",
        "",
        "| B | T | ours call | ours per call (chained) | ours GPU | MLX core call | "
        "FLA fused_recurrent eager / graph | FLA chunk eager / graph | ours / FLA best graph "
        "| ours GPU / FLA best graph | ours peak MiB | FLA peak MiB | "
        "ours: state TB/s or TFLOP/s (chained; GPU) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        ours = r["ours"]
        core = r.get("mlx_core")
        fla = [r[n] for n in ("fla_recurrent", "fla_chunk") if n in r]
        best = min((f["graph_ms"] for f in fla), default=None)
        gpu = ours.get("gpu_ms")
        if r["tokens"] == 1:
            state_bytes = 2 * r["batch"] * HV * D * D * 4

            def rate_of(ms, state_bytes=state_bytes):
                per_s = state_bytes / (ms / 1e3)
                return f"{per_s / 1e12:.2f} TB/s ({100 * per_s / bandwidth:.0f}% of copy)"

        else:
            flop = 8 * r["batch"] * r["tokens"] * HV * D * D

            def rate_of(ms, flop=flop):
                return f"{flop / (ms / 1e3) / 1e12:.1f} TFLOP/s"

        rate = rate_of(ours["chained_ms"]) + (f"; GPU {rate_of(gpu)}" if gpu else "")

        def pair(name):
            return f"{r[name]['call_ms']:.3f} / {r[name]['graph_ms']:.3f}" if name in r else "n/a"

        core_cell = "n/a (op loop)" if core is None else f"{core['call_ms']:.3f}"
        ratio = f"{ours['chained_ms'] / best:.2f}x" if fla else "n/a"
        gpu_ratio = f"{gpu / best:.2f}x" if fla and gpu else "n/a"
        gpu_cell = f"{gpu:.3f}" if gpu else "n/a"
        fla_peak = f"{max(f['peak_mib'] for f in fla):.0f}" if fla else "n/a"
        lines.append(
            f"| {r['batch']} | {r['tokens']} | {ours['call_ms']:.3f} | {ours['chained_ms']:.3f} | "
            f"{gpu_cell} | {core_cell} | {pair('fla_recurrent')} | {pair('fla_chunk')} | "
            f"{ratio} | {gpu_ratio} | {ours['peak_mib']:.0f} | {fla_peak} | {rate} |"
        )
    lines += [
        "",
        "Training step (forward + backward, B=1):",
        "",
        "| T | ours call | ours per step, n steps to an evaluation | ours peak MiB | "
        "FLA chunk forward graph | ours call / FLA forward | per-key call (auto) | "
        "per-key call (recurrent) | per-key peak MiB (auto) | per-key auto / scalar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record.get("training", []):
        ours = r["ours"]
        prefill = _prefill_row(record, r["tokens"])
        fla = prefill.get("fla_chunk")
        fla_cell = "n/a" if fla is None else f"{fla['graph_ms']:.3f}"
        ratio = "n/a" if fla is None else f"{ours['call_ms'] / fla['graph_ms']:.1f}x"
        key, key_recurrent = r.get("ours_per_key"), r.get("ours_per_key_recurrent")
        key_cells = (
            "n/a | n/a | n/a | n/a"
            if key is None or key_recurrent is None
            else f"{key['call_ms']:.3f} | {key_recurrent['call_ms']:.3f} | "
            f"{key['peak_mib']:.0f} | {key['call_ms'] / ours['call_ms']:.2f}x"
        )
        lines.append(
            f"| {r['tokens']} | {ours['call_ms']:.3f} | {ours['chained_ms']:.3f} | "
            f"{ours['peak_mib']:.0f} | {fla_cell} | {ratio} | {key_cells} |"
        )
    lines += [
        "",
        "Per-key gates (g [B, T, Hv, Dk]), B=1:",
        "",
        "| T | ours call | ours per call (chained) | ours GPU | ours scalar gates GPU | "
        "FLA chunk_kda eager / graph | ours GPU / FLA graph | y, state vs ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record.get("kda", []):
        ours = r["ours"]
        scalar = _prefill_row(record, r["tokens"])
        fla = r.get("fla_chunk_kda")
        gpu, scalar_gpu = ours.get("gpu_ms"), scalar["ours"].get("gpu_ms")
        fla_cells = (
            "n/a | n/a | n/a"
            if fla is None
            else f"{fla['call_ms']:.3f} / {fla['graph_ms']:.3f} | "
            + (f"{gpu / fla['graph_ms']:.2f}x" if gpu else "n/a")
            + f" | {fla['y_vs_ours']:.1e}, {fla['state_vs_ours']:.1e}"
        )
        lines.append(
            f"| {r['tokens']} | {ours['call_ms']:.3f} | {ours['chained_ms']:.3f} | "
            f"{gpu or float('nan'):.3f} | {scalar_gpu or float('nan'):.3f} | {fla_cells} |"
        )
    lines.append("")
    lines.append("ms: median. FLA's y and state against ours (norm ratio):")
    for r in record["rows"]:
        for name in ("fla_recurrent", "fla_chunk"):
            if name in r:
                lines.append(
                    f"- B={r['batch']} T={r['tokens']} {name}: y {r[name]['y_vs_ours']:.1e}, "
                    f"state {r[name]['state_vs_ours']:.1e}"
                )
    return "\n".join(lines)


def run(args) -> dict:
    if not mx.cuda.is_available():
        raise SystemExit("bench --cuda needs MLX's CUDA build on an NVIDIA GPU")
    mx.set_default_device(mx.gpu)
    torch = _torch()
    fla = _fla()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python -m mlx_gated_delta bench --cuda",
        "complete": False,
        "gpu": torch.cuda.get_device_name(),
        "mlx": mx.__version__,
        "torch": torch.__version__,
        "fla": "not installed" if fla is None else "0.6.0",
        "kda": [],
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
        "rows": [],
        "training": [],
        "layer": {},
    }

    started = time.perf_counter()

    def progress(what: str) -> None:
        # With the seconds since the start: what a row costs, for planning a
        # run on a GPU lent by the minute.
        print(f"bench --cuda: {what} (at {time.perf_counter() - started:.0f} s)", flush=True)

    def keep(what: str, measured) -> None:
        # Each measurement is printed as one JSON line and the record is
        # rewritten after it: a run cut short (a lent GPU's time limit) keeps
        # what it measured, in its log and in cuda.json ("complete": false).
        print(f"bench --cuda: {what}: {json.dumps(measured)}", flush=True)
        (out / "cuda.json").write_text(json.dumps(record, indent=2) + "\n")

    shapes = [(b, 1) for b in DECODE_BATCHES] + [(1, t) for t in PREFILL_TOKENS]
    for batch, tokens in shapes:
        progress(f"B={batch} T={tokens}")
        record["rows"].append(row(batch, tokens, fla))
        keep(f"B={batch} T={tokens}", record["rows"][-1])
    chunk_kda = _fla_kda()
    for tokens in KDA_TOKENS:
        progress(f"per-key gates T={tokens}")
        record["kda"].append(kda_row(tokens, chunk_kda))
        keep(f"per-key gates T={tokens}", record["kda"][-1])
    for tokens in TRAINING_TOKENS:
        progress(f"training step T={tokens}")
        record["training"].append(training_row(tokens))
        keep(f"training step T={tokens}", record["training"][-1])
    layer_rows = {
        "forward": lambda: cuda_layer.forward_rows(progress),
        "kimi_linear": lambda: cuda_layer.kimi_linear_rows(progress),
        "training": cuda_layer.training_rows,
    }
    for name, rows in layer_rows.items():
        record["layer"][name] = rows()
        keep(f"layer {name}", record["layer"][name])
    record["complete"] = True
    text = table(record) + "\n\n" + cuda_layer.table(record["layer"])
    (out / "cuda.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "cuda.md").write_text(text + "\n")
    print(text)
    return record
