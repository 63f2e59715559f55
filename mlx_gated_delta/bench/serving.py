"""Serving benchmark: what a speculative verify step costs.

    python -m mlx_gated_delta.bench.serving [--repeats N] [--dtype bfloat16]

For k = 1..8 draft tokens, on a Qwen3-Next linear-attention layer's shape
(B=1, Hk=16, Hv=32, Dk=Dv=128; `gated_delta_rule` with normalize_qk), the
median time of:
  * one verify call over the k tokens (the op on T = k),
  * the same call with the checkpoints a TrimmableArraysCache asks for
    (positions 1..k-1), so that any of its positions can be restored,
  * k single-token decode calls, each passing the state to the next.
Then the same for a whole patched model (the demo's 12-layer Qwen3-Next-shaped
target): one forward over k tokens through a trimmable cache, then a trim
back by k, against k one-token forwards. Medians of `--repeats` runs, on the
default device.

Then a two-turn chat on the demo's 4-layer patched model: turn 1 prefills a
`--prompt-tokens` prompt and generates 32 tokens; turn 2's prompt shares turn
1's prompt except its last 8 tokens (a chat template re-rendering the end of
the turn), then 64 new tokens. Time to first token of turn 2: a fresh
prefill, against restoring the longest snapshotted prefix of turn 1's cache
(snapshots every 256 tokens) and prefilling only the rest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import mlx.core as mx

from mlx_gated_delta import gated_delta_rule

from .shapes import QWEN3_NEXT
from .timing import median_seconds, time_rounds

DRAFTS = range(1, 9)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    return 1e3 * median_seconds(lambda: mx.eval(run()), repeats)


def op_rows(dtype, repeats: int) -> list:
    B, Hk, Hv, Dk, Dv = 1, QWEN3_NEXT.Hk, QWEN3_NEXT.Hv, QWEN3_NEXT.Dk, QWEN3_NEXT.Dv
    key = mx.random.key(0)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    T = max(DRAFTS)
    q = mx.random.normal((B, T, Hk, Dk), key=k1).astype(dtype)
    k = mx.random.normal((B, T, Hk, Dk), key=k2).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=k3).astype(dtype)
    g = -mx.random.uniform(shape=(B, T, Hv), key=k4)
    beta = mx.random.uniform(shape=(B, T, Hv), key=k5)
    state = mx.zeros((B, Hv, Dv, Dk))
    mx.eval(q, k, v, g, beta, state)

    def call(start, stop, state, checkpoints=None):
        return gated_delta_rule(
            q[:, start:stop],
            k[:, start:stop],
            v[:, start:stop],
            g[:, start:stop],
            beta[:, start:stop],
            state,
            normalize_qk=True,
            checkpoints=checkpoints,
        )

    rows = []
    for drafts in DRAFTS:
        verify = median_ms(lambda: call(0, drafts, state), repeats)
        with_checkpoints = median_ms(
            lambda: call(0, drafts, state, list(range(1, drafts)) if drafts > 1 else None), repeats
        )

        def single_steps():
            s = state
            outputs = []
            for t in range(drafts):
                y, s = call(t, t + 1, s)
                outputs.append(y)
            return outputs, s

        singles = median_ms(single_steps, repeats)
        rows.append((drafts, verify, with_checkpoints, singles))
    return rows


def model_rows(repeats: int) -> list:
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_gated_delta.models import demo_config, speculative_models

    target, _ = speculative_models(0, target_layers=12, draft_layers=4, damping=0.05)
    prompt = mx.random.randint(0, demo_config().vocab_size, (1, 64), key=mx.random.key(0))
    tokens = mx.random.randint(0, demo_config().vocab_size, (1, max(DRAFTS)), key=mx.random.key(1))
    cache = make_prompt_cache(target)
    mx.eval(target(prompt, cache=cache))
    rows = []
    for drafts in DRAFTS:

        def verify():
            logits = target(tokens[:, :drafts], cache=cache)
            mx.eval(logits)
            trim_prompt_cache(cache, drafts)
            return logits

        def single_steps():
            logits = [target(tokens[:, t : t + 1], cache=cache) for t in range(drafts)]
            mx.eval(logits)
            trim_prompt_cache(cache, drafts)
            return logits

        rows.append((drafts, median_ms(verify, repeats), median_ms(single_steps, repeats)))
    return rows


def first_token(model, cache, prompt) -> None:
    logits = model(prompt, cache=cache)
    mx.eval(mx.argmax(logits[:, -1], axis=-1))


def chat_rows(prompt_tokens: int, repeats: int) -> dict:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_gated_delta.cache import enable_prefix_snapshots, restore_prefix, reusable_prefix
    from mlx_gated_delta.models import demo_config, patched_model

    model = patched_model(0, 4)
    vocab = demo_config().vocab_size
    turn1 = mx.random.randint(0, vocab, (prompt_tokens,), key=mx.random.key(2))
    user2 = mx.random.randint(0, vocab, (8 + 64,), key=mx.random.key(3))
    turn2 = mx.concatenate([turn1[:-8], user2])[None]
    common = prompt_tokens - 8

    def turn1_cache(snapshots: bool):
        cache = make_prompt_cache(model)
        if snapshots:
            enable_prefix_snapshots(cache, every=256, max_snapshots=16)
        for _ in generate_step(
            turn1, model, max_tokens=32, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1)
        ):
            pass
        return cache

    prefixes = []

    def fresh(cache):
        first_token(model, cache, turn2)

    def reused(cache):
        prefix = reusable_prefix(cache, common)
        restore_prefix(cache, prefix)
        first_token(model, cache, turn2[:, prefix:])
        prefixes.append(prefix)

    # A short warm-up: a whole one would prefill turn 1 again. Each timed run gets its cache
    # before its clock starts: an empty one, or turn 1's with its snapshots.
    first_token(model, make_prompt_cache(model), turn2[:, :16])
    times = time_rounds(
        {"fresh": fresh, "reused": reused},
        repeats,
        warm_up=False,
        prepare={
            "fresh": lambda: (make_prompt_cache(model),),
            "reused": lambda: (turn1_cache(snapshots=True),),
        },
    )
    snapshot_bytes = sum(c.nbytes for c in turn1_cache(snapshots=True))
    plain_bytes = sum(c.nbytes for c in turn1_cache(snapshots=False))
    return {
        "fresh_ms": 1e3 * statistics.median(times["fresh"]),
        "reused_ms": 1e3 * statistics.median(times["reused"]),
        "prefix": prefixes[0],
        "turn2_tokens": turn2.shape[1],
        "cache_mib": plain_bytes / 2**20,
        "cache_with_snapshots_mib": snapshot_bytes / 2**20,
    }


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_gated_delta.bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--no-model", action="store_true", help="the op rows only")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=1024,
        help="turn 1's prompt in the two-turn chat (default 1024)",
    )
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)

    print(
        f"gated_delta_rule, B=1 {QWEN3_NEXT.text()} normalize_qk, {args.dtype}, "
        f"{mx.default_device()}, medians of {args.repeats} runs (ms)"
    )
    print(
        f"{'k':>3}{'verify (T=k)':>15}{'+checkpoints':>15}{'k decodes':>12}"
        f"{'verify/decodes':>16}{'checkpoint cost':>17}"
    )
    for drafts, verify, with_checkpoints, singles in op_rows(dtype, args.repeats):
        print(
            f"{drafts:3d}{verify:15.3f}{with_checkpoints:15.3f}{singles:12.3f}"
            f"{verify / singles:16.2f}{with_checkpoints / verify:16.2f}x"
        )
    if args.no_model:
        return 0
    print(
        f"\npatched 12-layer Qwen3-Next-shaped model (the demo's target), trimmable cache "
        f"after a 64-token prompt, medians of {args.repeats} runs (ms)"
    )
    print(f"{'k':>3}{'forward k + trim':>18}{'k forwards + trim':>19}{'ratio':>8}")
    for drafts, verify, singles in model_rows(args.repeats):
        print(f"{drafts:3d}{verify:18.2f}{singles:19.2f}{verify / singles:8.2f}")
    chat = chat_rows(args.prompt_tokens, max(3, args.repeats // 4))
    print(
        f"\ntwo-turn chat, demo model (4 patched layers): turn 2 prompt "
        f"{chat['turn2_tokens']} tokens, {args.prompt_tokens - 8} shared with turn 1"
    )
    print(f"time to first token, fresh prefill:          {chat['fresh_ms']:9.1f} ms")
    print(
        f"time to first token, reuse (prefix {chat['prefix']:5d}):    "
        f"{chat['reused_ms']:9.1f} ms   ({chat['fresh_ms'] / chat['reused_ms']:.1f}x)"
    )
    print(
        f"prompt cache after turn 1: {chat['cache_mib']:.1f} MiB, with snapshots "
        f"{chat['cache_with_snapshots_mib']:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
