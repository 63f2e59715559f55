"""Soak: many decode steps of the patched demo model, with memory sampled.

    python benchmarks/soak.py [--steps 100000] [--sample-every 1000]

The demo's Qwen3-Next-shaped model (`mlx_gated_delta.models`: three gated-delta
layers, then one full-attention layer), patched with `patch_mlx_lm`, decodes
one token per call through its cache, for `--steps` steps, from a fixed random
token stream. MLX's active memory is sampled every `--sample-every` steps,
with the bytes of the attention layer's KV cache, which grows with every token
by design: active memory less the KV cache must stay flat (the gated-delta
layers keep a fixed-size state).

At the end a fresh model (same seed) runs the same tokens as a chunked prefill
in blocks of `--prefill-block` tokens; the last step's logits of the soak must
equal the fresh run's within the layer's self-consistency contract (the same
layers, float32 sums in another order) and give the same greedy token.

The block is small because of the full-attention layer, not the gated-delta
ones: on the CPU its scores for one block are block x KV length x heads
float32 values, several copies at once. At 100,000 tokens a block of 2,048
makes each copy 6.5 GB, which nearly fills a 24 GB machine; 256 keeps each
under 1 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

from mlx_gated_delta.models import demo_config, patched_model
from mlx_gated_delta.testing.contracts import assert_matches

SELF_CONSISTENCY = "layer.self_consistency.v2.float32.logits"


def soak(steps, sample_every, layers, seed, prefill_block):
    vocab = demo_config(layers).vocab_size
    stream = mx.random.randint(0, vocab, (steps,), key=mx.random.key(seed + 1))
    mx.eval(stream)

    model = patched_model(seed, layers)
    cache = model.make_cache()
    samples = []  # (step, active bytes, KV cache bytes)
    start = time.perf_counter()
    logits = None
    for step in range(steps):
        logits = model(stream[None, step : step + 1], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        if (step + 1) % sample_every == 0 or step + 1 == steps:
            kv_bytes = sum(
                c.keys.nbytes + c.values.nbytes
                for c in cache
                if getattr(c, "keys", None) is not None
            )
            samples.append((step + 1, mx.get_active_memory(), kv_bytes))
            elapsed = time.perf_counter() - start
            print(
                f"soak: step {step + 1}/{steps}, active memory "
                f"{samples[-1][1] / 2**20:.2f} MiB (KV cache {kv_bytes / 2**20:.2f} MiB), "
                f"{(step + 1) / elapsed:.0f} steps/s",
                file=sys.stderr,
                flush=True,
            )
    decode_s = time.perf_counter() - start
    last = logits[:, -1]

    fresh = patched_model(seed, layers)
    fresh_cache = fresh.make_cache()
    for begin in range(0, steps, prefill_block):
        fresh_logits = fresh(stream[None, begin : begin + prefill_block], cache=fresh_cache)
        mx.eval(fresh_logits, [c.state for c in fresh_cache])
    fresh_last = fresh_logits[:, -1]

    ratio = assert_matches("last logits", last[:, None], fresh_last[:, None], SELF_CONSISTENCY)
    same_token = mx.argmax(last, -1).item() == mx.argmax(fresh_last, -1).item()
    memory = [active - kv for _, active, kv in samples]
    return {
        "steps": steps,
        "layers": layers,
        "device": str(mx.default_device()),
        "decode_seconds": round(decode_s, 1),
        "steps_per_second": round(steps / decode_s, 1),
        "samples_step_active_kv_bytes": samples,
        "active_less_kv_min_max": [min(memory), max(memory)],
        "last_logits_norm_ratio_vs_fresh": ratio,
        "last_logits_bitwise_equal_to_fresh": bool(mx.array_equal(last, fresh_last).item()),
        "same_greedy_token": same_token,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-block", type=int, default=256)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    result = soak(args.steps, args.sample_every, args.layers, args.seed, args.prefill_block)
    memory = result["active_less_kv_min_max"]
    print(
        f"soak: {result['steps']} decode steps of the patched demo model "
        f"({result['layers']} layers, {result['device']}), "
        f"{result['steps_per_second']} steps/s"
    )
    samples = result["samples_step_active_kv_bytes"]
    print(
        f"active memory less the attention KV cache, over {len(samples)} samples: "
        f"min {memory[0]} B, max {memory[1]} B (spread {memory[1] - memory[0]} B); "
        f"active memory {samples[0][1]} B at step {samples[0][0]}, {samples[-1][1]} B at "
        f"step {samples[-1][0]} (KV cache {samples[-1][2]} B)"
    )
    print(
        f"last step's logits vs a fresh chunked prefill of the same tokens: norm ratio "
        f"{result['last_logits_norm_ratio_vs_fresh']:.3e} (contract "
        f"{SELF_CONSISTENCY}), bitwise equal: "
        f"{result['last_logits_bitwise_equal_to_fresh']}, same greedy token: "
        f"{result['same_greedy_token']}"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0 if result["same_greedy_token"] else 1


if __name__ == "__main__":
    sys.exit(main())
