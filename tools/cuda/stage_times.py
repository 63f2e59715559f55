"""Where the forward's time goes on the GPU: the time of each of our kernels as CUPTI
records it through PyTorch's profiler, Qwen3-Next shape, bf16, float32 gates.

- prefill (B=1, T tokens): chunk_prepare, chunk_carry and chunk_output, and the wall time
  of one call with MLX's buffer cache warm against one after ``mx.clear_cache()`` (fresh
  managed memory for the outputs and the scratch);
- decode (T=1, B batch rows): the recurrent kernel, and the rate at which it moves the
  state (read once, written once) against a device-to-device copy through PyTorch
  measured in the same run.

    python tools/cuda/stage_times.py [T ...] [--decode B ...] [--per-key] [--backward]
    (defaults: T = 2048 8192 32768, B = 1 8 64; --decode with no B skips decode;
    --per-key: the prefill with a gate per key channel, g [B, T, Hv, Dk], as Kimi
    Delta Attention's; --backward: the prefill's gradient instead, the vjp of y and the
    final state for given cotangents, which runs the backward's kernels alone)
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from mlx_gated_delta import gated_delta_rule
from mlx_gated_delta.bench.cuda import copy_bandwidth

HK, HV, D = 16, 32, 128
REPEATS = 10
DECODE_REPEATS = 50


def inputs(batch, tokens, per_key=False):
    rng = np.random.default_rng(0)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q = normal(batch, tokens, HK, D).astype(mx.bfloat16)
    k = normal(batch, tokens, HK, D).astype(mx.bfloat16)
    v = normal(batch, tokens, HV, D).astype(mx.bfloat16)
    gate_shape = (batch, tokens, HV, D) if per_key else (batch, tokens, HV)
    g = mx.array(-rng.uniform(0.01, 0.3, gate_shape).astype(np.float32))
    beta = mx.array(rng.uniform(0.0, 1.0, (batch, tokens, HV)).astype(np.float32))
    state = 0.1 * normal(batch, HV, D, D)
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def op(batch, tokens, per_key=False, backward=False):
    q, k, v, g, beta, state = inputs(batch, tokens, per_key)
    rng = np.random.default_rng(1)
    dy = mx.array(rng.standard_normal(q.shape[:2] + (HV, D)).astype(np.float32))
    dstate = mx.array(rng.standard_normal(state.shape).astype(np.float32))
    cotangents = [dy.astype(mx.bfloat16), dstate]

    def forward(*x):
        return list(gated_delta_rule(*x, normalize_qk=True))

    def call():
        if backward:
            return mx.vjp(forward, [q, k, v, g, beta, state], cotangents)[1]
        return forward(q, k, v, g, beta, state)

    mx.eval(call())
    mx.synchronize()
    return call


def wall_ms(call, clear):
    samples = []
    for _ in range(REPEATS):
        if clear:
            mx.clear_cache()
        start = time.perf_counter()
        mx.eval(call())
        mx.synchronize()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def kernel_ms(call, repeats=REPEATS):
    """Median GPU time per call of each gd_ kernel, from CUPTI's records."""
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(repeats):
            mx.eval(call())
            mx.synchronize()
    times = {}
    for event in trace.events():
        if event.name.startswith("gd_"):
            times.setdefault(event.name, []).append(event.device_time / 1e3)
    return {name: statistics.median(t) for name, t in sorted(times.items())}


def prefill(tokens, per_key, backward):
    call = op(1, tokens, per_key, backward)
    warm = wall_ms(call, clear=False)
    cleared = wall_ms(call, clear=True)
    kernels = kernel_ms(call)
    split = ", ".join(f"{name} {ms:.3f}" for name, ms in kernels.items())
    print(
        f"T={tokens}{' per-key gates' if per_key else ''}{' backward' if backward else ''}: one call {warm:.3f} ms (cache warm), {cleared:.3f} ms "
        f"(after clear_cache); kernels (ms, median of {REPEATS}): {split or 'none seen'}",
        flush=True,
    )


def decode(batch, copy_rate):
    kernels = kernel_ms(op(batch, 1), DECODE_REPEATS)
    state_bytes = 2 * batch * HV * D * D * 4
    split = ", ".join(
        f"{name} {1e3 * ms:.1f} us ({state_bytes / (ms / 1e3) / 1e12:.2f} TB/s, "
        f"{100 * state_bytes / (ms / 1e3) / copy_rate:.0f}% of copy)"
        for name, ms in kernels.items()
    )
    print(f"decode B={batch}: kernels (median of {DECODE_REPEATS}): {split or 'none seen'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokens", type=int, nargs="*", default=[2048, 8192, 32768])
    parser.add_argument("--decode", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--per-key", action="store_true", help="a gate per key channel")
    parser.add_argument("--backward", action="store_true", help="the prefill's gradient")
    args = parser.parse_args()
    if args.decode:
        copy_rate = copy_bandwidth()
        print(f"copy: {copy_rate / 1e12:.2f} TB/s (read + write)", flush=True)
        for batch in args.decode:
            decode(batch, copy_rate)
    for tokens in args.tokens:
        prefill(tokens, args.per_key, args.backward)


if __name__ == "__main__":
    main()
