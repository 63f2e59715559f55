"""End-to-end demo: a small Qwen3-Next-shaped mlx-lm model with random weights
generates greedily with mlx-lm's own Gated DeltaNet layers and again after
`patch_mlx_lm`; the tokens must be identical, and the prefill and decode speed
of each are shown. No download: the model is built from a config.

Then a speculative run: a deeper patched target decodes greedily alone and
with mlx-lm's speculative decoding, drafted by a patched model made of the
target's own first layers (its embedding, first `--draft-layers` layers, norm
and head). Random weights predict nothing, so the target's layers past the
draft's have their output projections scaled by `--damping`: the draft then
agrees with the target often, as a trained draft does. The tokens must be
identical; tokens/s and the drafts accepted are shown.

    python -m mlx_gated_delta demo [--prompt-tokens N] [--new-tokens N] [--no-speculative]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

from .models import build_model, demo_config, speculative_models


def generate(model, prompt: mx.array, new_tokens: int, on_token=None) -> dict:
    """Greedy generation through mlx-lm's `generate_step`; returns the tokens
    and the prefill and decode times."""
    from mlx_lm.generate import generate_step

    tokens = []
    start = time.perf_counter()
    first_token_at = None
    steps = generate_step(prompt, model, max_tokens=new_tokens, sampler=lambda x: mx.argmax(x, -1))
    for token, _ in steps:
        tokens.append(int(token))
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if on_token is not None:
            on_token()
    end = time.perf_counter()
    prefill_s = first_token_at - start
    decode_s = end - first_token_at
    return {
        "tokens": tokens,
        "prefill_tokens_per_s": prompt.size / prefill_s,
        "decode_tokens_per_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else float("nan"),
    }


def speculative_generate(
    target, draft, prompt: mx.array, new_tokens: int, draft_tokens: int, on_token=None
) -> dict:
    """Greedy generation through mlx-lm's `speculative_generate_step`; the
    tokens, how many came from accepted drafts, and the decode rate (after
    the first token, as `generate`)."""
    from mlx_lm.generate import speculative_generate_step

    tokens, accepted = [], 0
    first_token_at = None
    steps = speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=draft_tokens,
        max_tokens=new_tokens,
        sampler=lambda x: mx.argmax(x, -1),
    )
    for token, _, from_draft in steps:
        tokens.append(int(token))
        accepted += int(from_draft)
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if on_token is not None:
            on_token()
    decode_s = time.perf_counter() - first_token_at
    return {
        "tokens": tokens,
        "accepted": accepted,
        "decode_tokens_per_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 else float("nan"),
    }


class _Bar:
    """A progress bar on stderr (tqdm's when installed)."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            self._tqdm, self.total, self.done = None, total, 0
        else:
            self._tqdm = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="tok")

    def label(self, text: str):
        if self._tqdm is not None:
            self._tqdm.set_description_str(text)
        else:
            self.text = text

    def step(self):
        if self._tqdm is not None:
            self._tqdm.update(1)
            return
        self.done += 1
        filled = 30 * self.done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.text:<30}")
        sys.stderr.flush()

    def close(self):
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_gated_delta demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument(
        "--layers",
        type=int,
        default=4,
        help="decoder layers; every fourth is full attention (default 4)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-speculative", action="store_true", help="skip the speculative-decoding run"
    )
    parser.add_argument(
        "--target-layers",
        type=int,
        default=12,
        help="layers of the speculative run's target (default 12)",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=4,
        help="the target's first layers that make the draft (default 4)",
    )
    parser.add_argument(
        "--draft-tokens", type=int, default=3, help="tokens drafted per verify step (default 3)"
    )
    parser.add_argument(
        "--damping",
        type=float,
        default=0.05,
        help="scale of the target's output projections past the draft's layers (default 0.05)",
    )
    args = parser.parse_args(argv)

    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        print('the demo needs mlx-lm: pip install "mlx-gated-delta[mlx-lm]"', file=sys.stderr)
        return 2
    from mlx_gated_delta import patch_mlx_lm

    prompt = mx.random.randint(
        0, demo_config().vocab_size, (args.prompt_tokens,), key=mx.random.key(args.seed)
    )
    warmup_prompt = prompt[:16]
    runs = [("mlx-lm", False), ("mlx-lm + mlx_gated_delta", True)]
    bar = _Bar(total=len(runs) * (args.new_tokens + 2))
    results = {}
    for name, patched in runs:
        model = build_model(args.seed, args.layers)
        replaced = patch_mlx_lm(model) if patched else 0
        bar.label(f"{name}: warm-up")
        generate(model, warmup_prompt, 2, on_token=bar.step)
        bar.label(f"{name}: generating")
        results[name] = generate(model, prompt, args.new_tokens, on_token=bar.step)
        results[name]["replaced"] = replaced
    bar.close()

    stock, ours = (results[name] for name, _ in runs)
    same = stock["tokens"] == ours["tokens"]
    config = demo_config(args.layers)
    print(
        f"Qwen3-Next-shaped mlx-lm model, random weights: {args.layers} layers "
        f"(hidden {config.hidden_size}, linear attention Hk={config.linear_num_key_heads} "
        f"Hv={config.linear_num_value_heads} D={config.linear_key_head_dim}), "
        f"{mx.default_device()}; patch_mlx_lm replaced {ours['replaced']} layers"
    )
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")
    print(f"{'':28}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, _ in runs:
        r = results[name]
        print(f"{name:28}{r['prefill_tokens_per_s']:15.1f}{r['decode_tokens_per_s']:15.1f}")
    print(
        f"{'speed-up':28}{ours['prefill_tokens_per_s'] / stock['prefill_tokens_per_s']:14.2f}x"
        f"{ours['decode_tokens_per_s'] / stock['decode_tokens_per_s']:14.2f}x"
    )
    print(f"first tokens: {ours['tokens'][:12]}")
    if same:
        print(f"tokens identical: yes (all {len(ours['tokens'])})")
    else:
        first = next(i for i, (a, b) in enumerate(zip(stock["tokens"], ours["tokens"])) if a != b)
        print(f"tokens identical: NO, first difference at token {first}")
    if args.no_speculative:
        return 0 if same else 1
    return 0 if same and _speculative_run(args, prompt) else 1


def _speculative_run(args, prompt: mx.array) -> bool:
    """Prints the speculative run; returns whether its tokens are the greedy ones."""
    target, draft = speculative_models(
        args.seed, args.target_layers, args.draft_layers, args.damping
    )
    bar = _Bar(total=2 * (args.new_tokens + 2))
    bar.label("target alone: warm-up")
    generate(target, prompt[:16], 2, on_token=bar.step)
    bar.label("target alone")
    alone = generate(target, prompt, args.new_tokens, on_token=bar.step)
    bar.label("with a draft: warm-up")
    speculative_generate(target, draft, prompt[:16], 2, args.draft_tokens, on_token=bar.step)
    bar.label("with a draft")
    drafted = speculative_generate(
        target, draft, prompt, args.new_tokens, args.draft_tokens, on_token=bar.step
    )
    bar.close()
    same = alone["tokens"] == drafted["tokens"]
    print(
        f"speculative decoding (mlx-lm's speculative_generate_step): target "
        f"{args.target_layers} patched layers (past layer {args.draft_layers} damped by "
        f"{args.damping}), draft its first {args.draft_layers} layers, "
        f"{args.draft_tokens} drafts per step, greedy"
    )
    print(f"{'':28}{'decode tok/s':>15}")
    print(f"{'target alone':28}{alone['decode_tokens_per_s']:15.1f}")
    print(
        f"{'target + draft':28}{drafted['decode_tokens_per_s']:15.1f}   "
        f"({drafted['accepted']} of {len(drafted['tokens'])} tokens from accepted drafts)"
    )
    print(f"{'speed-up':28}{drafted['decode_tokens_per_s'] / alone['decode_tokens_per_s']:14.2f}x")
    print(
        f"speculative tokens identical to greedy: {'yes' if same else 'NO'} "
        f"(all {len(alone['tokens'])})"
        if same
        else "speculative tokens identical to greedy: NO"
    )
    return same


if __name__ == "__main__":
    sys.exit(main())
