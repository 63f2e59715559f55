"""Where the chunked forward's time goes on the GPU: the time of each of our
kernels (chunk_prepare, chunk_carry, chunk_output) as CUPTI records it through
PyTorch's profiler, and the wall time of one call with MLX's buffer cache warm
against one after ``mx.clear_cache()`` (fresh managed memory for the outputs
and the scratch). Qwen3-Next shape, B=1, bf16, float32 gates.

    python tools/cuda/stage_times.py [T ...]      (default 2048 8192 32768)
"""

import statistics
import sys
import time

import mlx.core as mx
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from mlx_gated_delta import gated_delta_rule

HK, HV, D = 16, 32, 128
REPEATS = 10


def inputs(tokens):
    rng = np.random.default_rng(0)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q = normal(1, tokens, HK, D).astype(mx.bfloat16)
    k = normal(1, tokens, HK, D).astype(mx.bfloat16)
    v = normal(1, tokens, HV, D).astype(mx.bfloat16)
    g = mx.array(-rng.uniform(0.01, 0.3, (1, tokens, HV)).astype(np.float32))
    beta = mx.array(rng.uniform(0.0, 1.0, (1, tokens, HV)).astype(np.float32))
    state = 0.1 * normal(1, HV, D, D)
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


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


def kernel_ms(call):
    """Median GPU time per call of each gd_ kernel, from CUPTI's records."""
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(REPEATS):
            mx.eval(call())
            mx.synchronize()
    times = {}
    for event in trace.events():
        if event.name.startswith("gd_"):
            times.setdefault(event.name, []).append(event.device_time / 1e3)
    return {name: statistics.median(t) for name, t in sorted(times.items())}


def main():
    for tokens in [int(t) for t in sys.argv[1:]] or [2048, 8192, 32768]:
        q, k, v, g, beta, state = inputs(tokens)

        def call(q=q, k=k, v=v, g=g, beta=beta, state=state):
            return gated_delta_rule(q, k, v, g, beta, state, normalize_qk=True)

        mx.eval(call())
        mx.synchronize()
        warm = wall_ms(call, clear=False)
        cleared = wall_ms(call, clear=True)
        kernels = kernel_ms(call)
        split = ", ".join(f"{name} {ms:.3f}" for name, ms in kernels.items())
        print(
            f"T={tokens}: one call {warm:.3f} ms (cache warm), {cleared:.3f} ms "
            f"(after clear_cache); kernels (ms, median of {REPEATS}): {split or 'none seen'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
