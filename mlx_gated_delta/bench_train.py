"""Training-step benchmark of the core op: forward plus backward.

``python -m mlx_gated_delta.bench_train [--tokens 512 2048] [--repeats 5]``

For the Qwen3-Next shape (Hk = 16, Hv = 32, Dk = Dv = 128, B = 1, bfloat16
activations, float32 gates and state) it times ``mx.grad`` of a loss on both
outputs with respect to q, k, v, the gate, beta and the state, on the CPU, for
our ``gated_delta_update`` and for ``mx.fast.gated_delta_update`` (whose vjp
runs through MLX's op loop), and reports the median time and the peak memory
MLX allocated during one step (``mx.get_peak_memory`` after a reset; it
includes the inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from .ops import gated_delta_update

SHAPE = dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128)
MiB = 1 << 20


def make_inputs(tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    Hk, Hv, Dk, Dv = (SHAPE[n] for n in ("key_heads", "value_heads", "key_dim", "value_dim"))

    def unit_rows(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    def array(x, dtype=mx.bfloat16):
        return mx.array(x.astype(np.float32)).astype(dtype)

    return dict(
        q=array(unit_rows((1, tokens, Hk, Dk))),
        k=array(unit_rows((1, tokens, Hk, Dk))),
        v=array(rng.standard_normal((1, tokens, Hv, Dv))),
        gamma=array(np.exp(rng.uniform(-2.0, 0.0, (1, tokens, Hv))), mx.float32),
        beta=array(rng.uniform(0.0, 1.0, (1, tokens, Hv)), mx.float32),
        state=array(rng.standard_normal((1, Hv, Dv, Dk)) * 0.1, mx.float32),
    )


def training_step(op):
    def loss(q, k, v, gamma, beta, state):
        y, final = op(q, k, v, gamma, beta, state)
        return y.astype(mx.float32).sum() + final.sum()

    return mx.grad(loss, argnums=tuple(range(6)))


def ours(q, k, v, gamma, beta, state):
    return gated_delta_update(q, k, v, gamma, beta, state, stream=mx.cpu)


def mlx_fast(q, k, v, gamma, beta, state):
    return mx.fast.gated_delta_update(q, k, v, gamma, beta, state, stream=mx.cpu)


def measure(op, inputs, repeats: int):
    step = training_step(op)
    args = [inputs[n] for n in ("q", "k", "v", "gamma", "beta", "state")]
    mx.eval(step(*args))  # warm-up
    times, peaks = [], []
    for _ in range(repeats):
        mx.reset_peak_memory()
        start = time.perf_counter()
        mx.eval(step(*args))
        times.append(time.perf_counter() - start)
        peaks.append(mx.get_peak_memory())
    return statistics.median(times), max(peaks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    print("T      impl                    fwd+bwd ms (median)   peak MiB")
    for tokens in args.tokens:
        inputs = make_inputs(tokens)
        mx.eval(inputs)
        for name, op in (("mlx_gated_delta", ours), ("mx.fast (op-loop vjp)", mlx_fast)):
            seconds, peak = measure(op, inputs, args.repeats)
            print(
                f"{tokens:<6} {name:<23} {seconds * 1e3:>12.1f}          {peak / MiB:>9.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
