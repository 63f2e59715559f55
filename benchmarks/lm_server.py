"""mlx-lm's server with our layers, with and without a draft model, over HTTP.

    python benchmarks/lm_server.py --dir DIR [--requests 4] [--max-tokens 64]

Writes to DIR the demo's speculative pair (`mlx_gated_delta.models.
speculative_models`: a 12-layer Qwen3-Next-shaped target whose layers from the
fifth on are damped, and a 4-layer draft made of its first layers, so that the
draft agrees with it often; random weights, no download) as mlx-lm
checkpoints with an offline word-level tokenizer, and LoRA data
(`DIR/data`). Then it starts `python -m mlx_gated_delta lm server` on the
target alone and on the target with the draft, sends the same chat requests
(greedy, one at a time) to each, and prints per request the completion
tokens, the seconds and tokens/s (wall time of the whole request, its short
prompt's prefill included), whether the two servers' answers are the same,
and the medians.

mlx-lm's prompt cache is off on both (`--prompt-cache-size 0`), so that every
request runs from an empty cache: with a draft model, mlx-lm 0.32's server
stores the cache of a request under a key one token longer than what the
cache holds, which a later request that reuses it would get wrong.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_gated_delta.models import demo_config, speculative_models
from mlx_gated_delta.testing.lm_checkpoints import save_checkpoint, vocabulary, write_lora_data
from mlx_gated_delta.testing.lm_server import LmServer, chat_of


def write_models(root: Path) -> tuple[Path, Path]:
    target, draft = speculative_models(0, target_layers=12, draft_layers=4, damping=0.05)
    return save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft")


def prompts(count: int) -> list[str]:
    words = [w for w in vocabulary(demo_config().vocab_size) if w.startswith("w")]
    draw = mx.random.randint(0, len(words), (count, 16), key=mx.random.key(7)).tolist()
    return [" ".join(words[i] for i in row) for row in draw]


def serve(args: list, requests: list[str], max_tokens: int) -> list[tuple[str, int, float]]:
    server = LmServer(*args, "--prompt-cache-size", 0, max_tokens=max_tokens)
    try:
        server.chat(chat_of("w1 w2 w3"))  # warm-up: the first call compiles and allocates
        results = []
        for prompt in requests:
            start = time.perf_counter()
            response = server.chat(chat_of(prompt))
            seconds = time.perf_counter() - start
            text = response["choices"][0]["message"]["content"]
            results.append((text, response["usage"]["completion_tokens"], seconds))
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the models are written")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    args = parser.parse_args()

    target, draft = write_models(args.dir)
    write_lora_data(args.dir / "data", demo_config().vocab_size, examples=64)
    requests = prompts(args.requests)
    alone = serve(["--model", target], requests, args.max_tokens)
    drafted = serve(
        ["--model", target, "--draft-model", draft, "--num-draft-tokens", args.num_draft_tokens],
        requests,
        args.max_tokens,
    )
    print(
        f"{'request':>7} {'tokens':>6} {'alone s':>8} {'tok/s':>7} {'draft s':>8} {'tok/s':>7}  same"
    )
    for i, ((text_a, n_a, s_a), (text_d, n_d, s_d)) in enumerate(zip(alone, drafted)):
        same = "yes" if text_a == text_d else "NO"
        print(
            f"{i:>7} {n_a:>6} {s_a:>8.2f} {n_a / s_a:>7.1f} {s_d:>8.2f} {n_d / s_d:>7.1f}  {same}"
        )
    rate_alone = statistics.median(n / s for _, n, s in alone)
    rate_draft = statistics.median(n / s for _, n, s in drafted)
    print(
        f"median tok/s: target alone {rate_alone:.1f}, target + draft {rate_draft:.1f} "
        f"({rate_draft / rate_alone:.2f}x); answers identical: "
        f"{sum(a[0] == d[0] for a, d in zip(alone, drafted))} of {len(alone)}"
    )
    print(f"first answer: {alone[0][0][:120]}")


if __name__ == "__main__":
    main()
