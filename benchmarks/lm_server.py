"""mlx-lm's server with our layers, with and without a draft model, over HTTP.

    python benchmarks/lm_server.py --dir DIR [--requests 4] [--max-tokens 64]
        [--num-draft-tokens 3] [--system-words 64]

Writes to DIR the demo's speculative pair (`mlx_gated_delta.models.
speculative_models`: a 12-layer Qwen3-Next-shaped target whose layers from the
fifth on are damped, and a 4-layer draft made of its first layers, so that the
draft agrees with it often; random weights, no download) as mlx-lm
checkpoints with an offline word-level tokenizer, and LoRA data
(`DIR/data`). Then it starts `python -m mlx_gated_delta lm server` on the
target alone and on the target with the draft, sends the same chat requests
(greedy, one at a time; each a shared system prompt of `--system-words` words
and its own 16-word user turn) to each, and prints per request the
completion tokens, the prompt tokens the server took from its prompt cache
(mlx-lm's default cache, on), the seconds and tokens/s (wall time of the
whole request, its prefill included), whether the two servers' answers are
the same, and the medians.
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


def chats(count: int, system_words: int) -> list[list]:
    """`count` chats: one shared system prompt, each its own user turn."""
    words = [w for w in vocabulary(demo_config().vocab_size) if w.startswith("w")]
    draw = mx.random.randint(
        0, len(words), (count + 1, max(16, system_words)), key=mx.random.key(7)
    )
    system = " ".join(words[i] for i in draw[0, :system_words].tolist()) or None
    return [chat_of(" ".join(words[i] for i in row[:16]), system) for row in draw[1:].tolist()]


def serve(args: list, requests: list, max_tokens: int) -> list[tuple[str, int, int, float]]:
    """Each request's answer, completion tokens, cached prompt tokens and seconds."""
    server = LmServer(*args, max_tokens=max_tokens)
    try:
        server.chat(chat_of("w1 w2 w3"))  # warm-up: the first call compiles and allocates
        results = []
        for messages in requests:
            start = time.perf_counter()
            response = server.chat(messages)
            seconds = time.perf_counter() - start
            text = response["choices"][0]["message"]["content"]
            usage = response["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            results.append((text, usage["completion_tokens"], cached, seconds))
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the models are written")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=64, help="0: no system prompt")
    args = parser.parse_args()

    target, draft = write_models(args.dir)
    write_lora_data(args.dir / "data", demo_config().vocab_size, examples=64)
    requests = chats(args.requests, args.system_words)
    alone = serve(["--model", target], requests, args.max_tokens)
    drafted = serve(
        ["--model", target, "--draft-model", draft, "--num-draft-tokens", args.num_draft_tokens],
        requests,
        args.max_tokens,
    )
    print(
        f"{'request':>7} {'tokens':>6} {'cached':>6} {'alone s':>8} {'tok/s':>7} "
        f"{'cached':>6} {'draft s':>8} {'tok/s':>7}  same"
    )
    for i, (a, d) in enumerate(zip(alone, drafted)):
        (text_a, n_a, cached_a, s_a), (text_d, n_d, cached_d, s_d) = a, d
        print(
            f"{i:>7} {n_a:>6} {cached_a:>6} {s_a:>8.2f} {n_a / s_a:>7.1f} "
            f"{cached_d:>6} {s_d:>8.2f} {n_d / s_d:>7.1f}  {'yes' if text_a == text_d else 'NO'}"
        )
    rate_alone = statistics.median(n / s for _, n, _, s in alone)
    rate_draft = statistics.median(n / s for _, n, _, s in drafted)
    print(
        f"median tok/s: target alone {rate_alone:.1f}, target + draft {rate_draft:.1f} "
        f"({rate_draft / rate_alone:.2f}x); answers identical: "
        f"{sum(a[0] == d[0] for a, d in zip(alone, drafted))} of {len(alone)}"
    )
    print(f"first answer: {alone[0][0][:120]}")


if __name__ == "__main__":
    main()
