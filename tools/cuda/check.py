"""Quick agreement check of the CUDA kernels against the CPU kernels and the
float64 oracle, on shapes the property tests do not draw (the Qwen3-Next
shape, long calls). Prints one line per case; exits 1 if any case is off.

    python tools/cuda/check.py
"""

import sys

import mlx.core as mx
import numpy as np

from mlx_gated_delta import gated_delta_rule
from mlx_gated_delta.reference import gated_delta_rule_reference, to_float64


def draw(B, T, Hk, Hv, Dk, Dv, dtype, per_key, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    g_shape = (B, T, Hv, Dk) if per_key else (B, T, Hv)
    g = -rng.uniform(0.0, 0.5, g_shape).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (B, T, Hv)).astype(np.float32)
    state = (0.1 * rng.standard_normal((B, Hv, Dv, Dk))).astype(np.float32)
    arrays = [mx.array(x) for x in (q, k, v)]
    arrays = [x.astype(dtype) for x in arrays]
    return arrays + [mx.array(g), mx.array(beta), mx.array(state)]


def relative(actual, expected):
    actual = np.asarray(actual.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def main():
    cases = [
        # B, T, Hk, Hv, Dk, Dv, dtype, algorithm, options
        (1, 1, 16, 32, 128, 128, mx.bfloat16, "auto", {}),
        (8, 1, 16, 32, 128, 128, mx.bfloat16, "auto", {}),
        (2, 200, 4, 8, 128, 128, mx.float32, "recurrent", {}),
        (2, 200, 4, 8, 128, 128, mx.float32, "chunked", {}),
        (1, 1000, 16, 32, 128, 128, mx.bfloat16, "chunked", {}),
        (2, 150, 2, 4, 64, 96, mx.float16, "chunked", {"head_mapping": "interleaved"}),
        (2, 130, 2, 4, 48, 40, mx.float32, "chunked", {}),
        (2, 70, 2, 4, 200, 24, mx.float32, "recurrent", {}),
        (2, 90, 2, 4, 64, 64, mx.float32, "recurrent", {"per_key": True}),
        (2, 90, 2, 4, 64, 64, mx.float32, "chunked", {"mask": True}),
        (2, 90, 2, 4, 64, 64, mx.float32, "recurrent", {"mask": True}),
    ]
    failures = 0
    for n, (B, T, Hk, Hv, Dk, Dv, dtype, algorithm, options) in enumerate(cases):
        per_key = options.get("per_key", False)
        q, k, v, g, beta, state = draw(B, T, Hk, Hv, Dk, Dv, dtype, per_key, n)
        kwargs = {"head_mapping": options.get("head_mapping", "grouped"), "normalize_qk": True}
        if options.get("mask"):
            kwargs["mask"] = mx.array(np.random.default_rng(n).uniform(size=(B, T)) < 0.8)
        y, s = gated_delta_rule(
            q, k, v, g, beta, state, algorithm=algorithm, stream=mx.gpu, **kwargs
        )
        mx.eval(y, s)
        y_cpu, s_cpu = gated_delta_rule(
            q, k, v, g, beta, state, algorithm=algorithm, stream=mx.cpu, **kwargs
        )
        ref_y, ref_s = gated_delta_rule_reference(
            *[to_float64(x) for x in (q, k, v, g, beta, state)],
            **{key: (np.asarray(x) if key == "mask" else x) for key, x in kwargs.items()},
        )
        errors = (
            relative(y, ref_y),
            relative(s, ref_s),
            relative(y_cpu, ref_y),
            relative(s_cpu, ref_s),
        )
        tolerance = 1e-2 if dtype == mx.bfloat16 else (2e-3 if dtype == mx.float16 else 1e-4)
        ok = errors[0] < tolerance and errors[1] < 1e-4 and all(np.isfinite(errors))
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} B={B} T={T} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} "
            f"{dtype} {algorithm} {options}: y {errors[0]:.2e} (cpu {errors[2]:.2e}), "
            f"state {errors[1]:.2e} (cpu {errors[3]:.2e})",
            flush=True,
        )
    print(f"check: {len(cases) - failures} ok, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
