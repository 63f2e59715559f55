"""The CPU path on a busy machine (``bench --contended [N]``): N busy processes (by default
one per usable core) compete for the cores while ours and its peers take turns on the same
work, each figure a median over interleaved rounds, so the load falls on both alike:

- the op's decode step (B=1) and a prefill (B=1, T=512), float32, Qwen3-Next's heads: ours
  (``algorithm="auto"``) against MLX core's ``mx.fast.gated_delta_update``;
- the whole layer's decode step (B=1, bfloat16, Qwen3-Next's shape): ours against mlx-lm's
  stock layer;
- the demo's model (``mlx_gated_delta.models``, 4 layers) decoding greedily: patched with
  ``patch_mlx_lm`` against stock mlx-lm, in blocks of tokens that take turns.

The busy processes are killed whatever happens, an error or Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from .machine import command_line, cpu_model, load_average, usable_cpus
from .timing import Progress, time_rounds

DEMO_LAYERS = 4
DEMO_PROMPT_TOKENS = 64
DEMO_BLOCK_TOKENS = 8  # decode steps per timed block; the models take turns block by block


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes that keep one core each busy until the block ends (they are
    killed on the way out, an exception or Ctrl-C included)."""
    processes = []
    try:
        for _ in range(count):
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def _row(name: str, ours: list[float], peer: list[float], peer_name: str) -> dict:
    ours_ms = statistics.median(ours) * 1e3
    peer_ms = statistics.median(peer) * 1e3
    return {
        "name": name,
        "peer": peer_name,
        "ours_ms": ours_ms,
        "peer_ms": peer_ms,
        "speedup": peer_ms / ours_ms,
        "repeats": min(len(ours), len(peer)),
    }


def op_rows(quick: bool, progress: Progress) -> list[dict]:
    """The op's decode step and prefill, ours against MLX core."""
    from .op import implementation_call, make_inputs
    from .shapes import qwen3_next

    rows = []
    for tokens, repeats in ((1, 30 if quick else 100), (512, 2 if quick else 5)):
        shape = qwen3_next(1, tokens, "float32")
        progress(f"op {shape.short_label}")
        inputs = make_inputs(shape, state_count=8)
        calls = {
            name: (lambda call: lambda: mx.eval(call(inputs, inputs.take_state())))(
                implementation_call(name)
            )
            for name in ("auto", "mlx_core")
        }
        if tokens == 1:
            # Any evaluation on MLX's CPU stream hands the work to the stream's thread and
            # waits for it: with every core busy, each hand-off can wait for the scheduler
            # to run that thread. A 16-float add timed in the same rounds shows that floor.
            tiny = mx.zeros((16,))
            mx.eval(tiny)
            calls["eval floor"] = lambda: mx.eval(tiny + 1)
        times = time_rounds(calls, repeats)
        kind = "decode" if tokens == 1 else "prefill"
        row = _row(f"op {shape.short_label} {kind}", times["auto"], times["mlx_core"], "MLX core")
        if "eval floor" in times:
            row["eval_floor_ms"] = statistics.median(times["eval floor"]) * 1e3
        rows.append(row)
        progress.advance()
    return rows


def layer_rows(quick: bool, progress: Progress) -> list[dict]:
    """The whole layer's decode step, ours against mlx-lm's stock layer."""
    from functools import partial

    from .layer import layer_inputs, qwen3_next_layers

    progress("layer bf16 B=1 T=1 decode")
    ours, stock = qwen3_next_layers(mx.bfloat16)
    x, fresh_cache = layer_inputs(mx.bfloat16, 1, 1)

    def call(layer, cache):
        mx.eval(layer(x, cache=cache), cache[0], cache[1])

    times = time_rounds(
        {"ours": partial(call, ours), "mlx-lm": partial(call, stock)},
        10 if quick else 30,
        prepare=lambda: (fresh_cache(),),
    )
    progress.advance()
    return [_row("layer bf16 B=1 T=1 decode", times["ours"], times["mlx-lm"], "mlx-lm")]


def demo_rows(quick: bool, progress: Progress) -> list[dict]:
    """The demo model's greedy decode, patched against stock mlx-lm: each decodes on from its
    own prompt cache, in blocks that take turns; a figure is the median seconds per token of
    a block."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..models import build_model, demo_config, patched_model

    progress("demo model decode")
    prompt = mx.random.randint(
        0, demo_config(DEMO_LAYERS).vocab_size, (1, DEMO_PROMPT_TOKENS), key=mx.random.key(0)
    )
    models = {"ours": patched_model(0, DEMO_LAYERS), "mlx-lm": build_model(0, DEMO_LAYERS)}
    state = {}
    for name, model in models.items():
        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)
        state[name] = (cache, mx.argmax(logits[:, -1:], axis=-1))
        mx.eval(state[name][1])

    def decode_block(name):
        cache, token = state[name]
        for _ in range(DEMO_BLOCK_TOKENS):
            token = mx.argmax(models[name](token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
        state[name] = (cache, token)

    times = time_rounds(
        {name: (lambda n: lambda: decode_block(n))(name) for name in models},
        10 if quick else 25,
    )
    progress.advance()
    per_token = {name: [t / DEMO_BLOCK_TOKENS for t in ts] for name, ts in times.items()}
    return [
        _row(
            f"demo model ({DEMO_LAYERS} layers) decode, ms per token",
            per_token["ours"],
            per_token["mlx-lm"],
            "mlx-lm",
        )
    ]


def report_text(record: dict) -> str:
    lines = [
        f"{record['machine']['cpu_model']}: {record['usable_cpus']} usable CPUs, our pool "
        f"{record['thread_count']} threads, kernels {record['cpu_kernel_level']}; "
        f"{record['busy_processes']} busy processes; "
        f"1-min load average {record['load_average_1min_before']} before, "
        f"{record['load_average_1min_after']} after.",
        "",
        f"{'':44}{'ours ms':>10}{'peer ms':>10}  {'peer':<10}{'speed-up':>9}",
    ]
    for r in record["rows"]:
        lines.append(
            f"{r['name']:44}{r['ours_ms']:10.3f}{r['peer_ms']:10.3f}  {r['peer']:<10}"
            f"{r['speedup']:8.2f}x"
        )
    lines += [
        "",
        "ms: median per call (per token for the demo model) over rounds in which ours and its "
        "peer take turns. MLX core = mx.fast.gated_delta_update; mlx-lm = its stock layer.",
    ]
    lines += [
        f"{r['name']}: an MLX CPU evaluation of a 16-float add took {r['eval_floor_ms']:.3f} ms "
        "in the same rounds, the least any call on MLX's CPU stream takes under this load."
        for r in record["rows"]
        if "eval_floor_ms" in r
    ]
    lines += [f"note: {note}" for note in record["notes"]]
    return "\n".join(lines)


def run(busy: int | None, quick: bool, out: str) -> dict:
    from .. import _ext, thread_count

    # The CPU path on any machine: on a Mac or with MLX's CUDA build the default device is
    # the GPU.
    mx.set_default_device(mx.cpu)
    busy = usable_cpus() if busy is None else busy
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        have_mlx_lm = False
    else:
        have_mlx_lm = True
    steps = [op_rows] + ([layer_rows, demo_rows] if have_mlx_lm else [])
    progress = Progress(total=2 + (2 if have_mlx_lm else 0))  # op_rows counts two
    notes = [] if have_mlx_lm else ["mlx-lm is not installed: the layer and demo rows are left out"]
    load_before = load_average()
    rows = []
    with busy_processes(busy):
        for step in steps:
            rows += step(quick, progress)
    progress.close()
    record = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count()},
        "usable_cpus": usable_cpus(),
        "thread_count": thread_count(),
        "cpu_kernel_level": _ext.cpu_kernel_level(),
        "busy_processes": busy,
        "load_average_1min_before": load_before,
        "load_average_1min_after": load_average(),
        "rows": rows,
        "notes": notes,
    }
    text = report_text(record)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "contended.json").write_text(json.dumps(record, indent=2) + "\n")
    (path / "contended.txt").write_text(text + "\n")
    print(text)
    print(f"\nwrote {path / 'contended.json'}, {path / 'contended.txt'}")
    return record
