"""End-to-end demo: a small Qwen3-Next-shaped mlx-lm model with random weights
generates greedily with mlx-lm's own Gated DeltaNet layers and again after
`patch_mlx_lm`; the tokens must be identical, and the prefill and decode speed
of each are shown. No download: the model is built from a config.

    python -m mlx_gated_delta demo [--prompt-tokens N] [--new-tokens N]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx


def demo_config(layers: int = 4):
    """Qwen3-Next's layer pattern (3 linear-attention layers, then one full
    attention) and head ratios (Hv = 2 Hk, MoE with a shared expert), scaled
    down so that a CPU runs it in seconds."""
    from mlx_lm.models import qwen3_next

    return qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=512,
        num_hidden_layers=layers,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=512,
        mlp_only_layers=[],
        moe_intermediate_size=256,
        rms_norm_eps=1e-6,
        vocab_size=4096,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        full_attention_interval=4,
    )


def build_model(seed: int, layers: int = 4):
    from mlx_lm.models import qwen3_next

    mx.random.seed(seed)
    model = qwen3_next.Model(demo_config(layers))
    mx.eval(model.parameters())
    return model


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
        return 0
    first = next(i for i, (a, b) in enumerate(zip(stock["tokens"], ours["tokens"])) if a != b)
    print(f"tokens identical: NO, first difference at token {first}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
