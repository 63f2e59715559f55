"""Quick agreement check of the CUDA kernels against the CPU kernels and the
float64 oracle, on shapes the property tests do not draw (the Qwen3-Next
shape, long calls), of the fused segment's kernels against the CPU's segment
and the float64 segment oracle (the gate variants, masks, checkpoints, both
core forms), and of the CUDA backward's gradients against the CPU
backward's (every input's gradient, norm-wise per tensor, within twice the
gradient contract that each meets against the float64 reference, as
core_grad.algorithms compares two float32 computations), with the exact zeros
the gradients owe (dg at a wipe, g = -inf; every gradient of a masked token)
and, for the float32 cases marked "oracle", the CUDA gradients against the
float64 reference under that contract. Prints one line per case; exits 1 if
any case is off.

    python tools/cuda/check.py
"""

import sys

import mlx.core as mx
import numpy as np

from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.reference import (
    gated_delta_rule_reference,
    gated_delta_rule_reference_vjp,
    to_float64,
)
from mlx_gated_delta.testing.segment_cases import make_segment_case


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
        # Per-key gates through the chunked kernels: decays per key column,
        # strong ones (g down to -20), wipes (-inf and finite) among them.
        (2, 90, 2, 4, 64, 64, mx.float32, "chunked", {"per_key": True}),
        (1, 1000, 16, 32, 128, 128, mx.bfloat16, "chunked", {"per_key": True}),
        (2, 200, 4, 8, 128, 128, mx.float32, "chunked", {"per_key": True, "strong": True}),
        (
            2,
            130,
            2,
            4,
            48,
            40,
            mx.float32,
            "chunked",
            {"per_key": True, "mask": True, "head_mapping": "interleaved", "wipes": True},
        ),
        (2, 150, 2, 4, 64, 96, mx.float16, "auto", {"per_key": True, "wipes": True}),
        (2, 90, 2, 4, 64, 64, mx.float32, "chunked", {"mask": True}),
        (2, 90, 2, 4, 64, 64, mx.float32, "recurrent", {"mask": True}),
    ]
    failures = 0
    for n, (B, T, Hk, Hv, Dk, Dv, dtype, algorithm, options) in enumerate(cases):
        per_key = options.get("per_key", False)
        q, k, v, g, beta, state = draw(B, T, Hk, Hv, Dk, Dv, dtype, per_key, n)
        if options.get("strong"):
            g = 40.0 * g
        if options.get("wipes"):
            # Decays of 0, as -inf and as a finite gate whose exp is 0.
            gates = np.array(g)
            draws = np.random.default_rng(300 + n).uniform(size=gates.shape)
            gates[draws < 0.03] = -np.inf
            gates[draws > 0.97] = -1e4
            g = mx.array(gates)
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
            **{
                key: (np.asarray(x) if key == "mask" else x)
                for key, x in kwargs.items()
                if key != "algorithm"
            },
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
    gradient_cases = [
        # B, T, Hk, Hv, Dk, Dv, dtype, options ("auto" runs the chunked backward from 64
        # tokens on where the call has 64 (batch row, value head, chunk) blocks, 128 with
        # per-key gates; these small calls ask for it)
        (1, 300, 16, 32, 128, 128, mx.bfloat16, {}),
        (2, 200, 4, 8, 128, 128, mx.float32, {}),
        (2, 200, 4, 8, 128, 128, mx.float32, {"algorithm": "recurrent"}),
        (1, 1, 2, 4, 128, 128, mx.float32, {"algorithm": "chunked", "oracle": True}),
        (3, 37, 2, 4, 64, 64, mx.bfloat16, {"algorithm": "chunked"}),
        (2, 64, 1, 3, 128, 128, mx.float32, {"algorithm": "chunked", "oracle": True}),
        (2, 129, 2, 6, 128, 128, mx.bfloat16, {}),
        (
            1,
            190,
            2,
            2,
            32,
            100,
            mx.float32,
            {"normalize_qk": False, "algorithm": "chunked", "oracle": True},
        ),
        (2, 100, 1, 2, 16, 16, mx.float16, {"algorithm": "chunked", "mask": True}),
        (2, 130, 2, 4, 48, 40, mx.float32, {"mask": True, "algorithm": "chunked"}),
        (2, 150, 2, 4, 64, 96, mx.float16, {"head_mapping": "interleaved", "algorithm": "chunked"}),
        (1, 70, 1, 2, 128, 128, mx.float32, {"normalize_qk": False}),
        # Per-key gates: a decay per key channel.
        (
            2,
            90,
            2,
            4,
            64,
            64,
            mx.float32,
            {"per_key": True, "algorithm": "chunked", "oracle": True},
        ),
        (2, 90, 2, 4, 64, 64, mx.float32, {"per_key": True, "algorithm": "recurrent"}),
        (
            1,
            64,
            2,
            2,
            128,
            128,
            mx.float32,
            {"per_key": True, "algorithm": "chunked", "oracle": True},
        ),
        (
            2,
            200,
            4,
            8,
            128,
            128,
            mx.float32,
            {"per_key": True, "algorithm": "chunked", "strong": True, "oracle": True},
        ),
        (1, 1000, 32, 32, 128, 128, mx.bfloat16, {"per_key": True}),
        (
            2,
            150,
            2,
            4,
            64,
            96,
            mx.float16,
            {"per_key": True, "head_mapping": "interleaved", "algorithm": "chunked"},
        ),
        (1, 300, 16, 32, 128, 128, mx.bfloat16, {"per_key": True, "mask": True}),
        (
            2,
            130,
            2,
            4,
            48,
            40,
            mx.float32,
            {
                "per_key": True,
                "mask": True,
                "head_mapping": "interleaved",
                "wipes": True,
                "algorithm": "chunked",
                "oracle": True,
            },
        ),
        (
            1,
            200,
            1,
            3,
            32,
            100,
            mx.float32,
            {"wipes": True, "algorithm": "chunked", "oracle": True},
        ),
    ]
    for n, (B, T, Hk, Hv, Dk, Dv, dtype, options) in enumerate(gradient_cases):
        failures += not check_gradients(n, B, T, Hk, Hv, Dk, Dv, dtype, options)
    for n, (algorithm, checkpoints, shape) in enumerate(SEGMENT_CASES):
        failures += not check_segment(n, algorithm, checkpoints, shape)
    total = len(cases) + len(gradient_cases) + len(SEGMENT_CASES)
    print(f"check: {total - failures} ok, {failures} failed")
    return 1 if failures else 0


def check_gradients(n, B, T, Hk, Hv, Dk, Dv, dtype, options):
    per_key = options.get("per_key", False)
    inputs = draw(B, T, Hk, Hv, Dk, Dv, dtype, per_key, 100 + n)
    rng = np.random.default_rng(200 + n)
    dy = mx.array(rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)).astype(dtype)
    dstate = mx.array(rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32))
    kwargs = {
        "head_mapping": options.get("head_mapping", "grouped"),
        "normalize_qk": options.get("normalize_qk", True),
        "algorithm": options.get("algorithm", "auto"),
    }
    if options.get("mask"):
        kwargs["mask"] = mx.array(rng.uniform(size=(B, T)) < 0.8)
    if options.get("strong"):
        inputs[3] = 40.0 * inputs[3]
    if options.get("wipes"):
        # g = -inf (a decay of 0) on some entries: their dg must be exactly 0.
        g = np.array(inputs[3])
        wiped = rng.uniform(size=g.shape) < 0.05
        g[wiped] = -np.inf
        inputs[3] = mx.array(g)

    def gradients(stream):
        def forward(*x):
            return list(gated_delta_rule(*x, stream=stream, **kwargs))

        _, grads = mx.vjp(forward, inputs, [dy, dstate])
        mx.eval(grads)
        return grads

    gpu, cpu = gradients(mx.gpu), gradients(mx.cpu)
    # q, k, v: the activation dtype's contract; g, beta, state: float32's.
    activation = {mx.float32: 1e-3, mx.float16: 1.5e-3, mx.bfloat16: 5e-3}[dtype]
    names = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
    errors = [
        relative(a, np.asarray(b.astype(mx.float32), dtype=np.float64)) for a, b in zip(gpu, cpu)
    ]
    limits = [2 * activation] * 3 + [2e-3] * 3
    ok = all(np.isfinite(errors)) and all(e < t for e, t in zip(errors, limits))
    details = ", ".join(f"{name} {e:.1e}" for name, e in zip(names, errors))
    # Exact zeros where they are owed: dg at a wipe, every gradient of a masked token.
    g = np.asarray(inputs[3])
    dg = np.asarray(gpu[3])
    zeros = [dg[np.isneginf(g)]]
    if "mask" in kwargs:
        skipped = ~np.asarray(kwargs["mask"])
        zeros += [np.asarray(x.astype(mx.float32))[skipped] for x in gpu[:5]]
    exact = all(np.all(z == 0.0) for z in zeros)
    ok = ok and exact
    if options.get("oracle"):
        # The float64 reference, under the float32 gradient contract (core_grad.oracle.v1).
        expected = gated_delta_rule_reference_vjp(
            *[to_float64(x) for x in inputs],
            y_cotangent=to_float64(dy),
            state_cotangent=to_float64(dstate),
            **{
                key: (np.asarray(x) if key == "mask" else x)
                for key, x in kwargs.items()
                if key != "algorithm"
            },
        )
        oracle = [
            relative(a, expected[name])
            for a, name in zip(gpu, ("q", "k", "v", "g", "beta", "state"))
        ]
        ok = ok and all(np.isfinite(oracle)) and max(oracle) < 1e-3
        details += f"; against float64 at most {max(oracle):.1e}"
    print(
        f"{'ok  ' if ok else 'FAIL'} gradients B={B} T={T} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} "
        f"{dtype} {options}: against the CPU {details}; exact zeros {'kept' if exact else 'LOST'}",
        flush=True,
    )
    return ok


QWEN3_NEXT = dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128)
KIMI_LINEAR = dict(key_heads=32, value_heads=32, key_dim=128, value_dim=128, per_key_gates=True)
# The fused segment: (algorithm, checkpoints, make_segment_case's arguments).
SEGMENT_CASES = [
    ("auto", None, dict(batch=1, tokens=1, dtype="bfloat16", **QWEN3_NEXT)),
    ("auto", None, dict(batch=8, tokens=1, dtype="bfloat16", **QWEN3_NEXT)),
    (
        "auto",
        None,
        dict(batch=2, tokens=300, dtype="bfloat16", mask_kind="left_padding", **QWEN3_NEXT),
    ),
    ("auto", [1, 64, 200], dict(batch=1, tokens=200, dtype="float32", **QWEN3_NEXT)),
    (
        "auto",
        None,
        dict(
            batch=1,
            tokens=1,
            dtype="bfloat16",
            lower_bound=-5.0,
            output_gate="sigmoid",
            **KIMI_LINEAR,
        ),
    ),
    (
        "auto",
        [2, 90],
        dict(
            batch=2,
            tokens=90,
            dtype="float32",
            mask_kind="random",
            output_gate="sigmoid",
            **KIMI_LINEAR,
        ),
    ),
    (
        "recurrent",
        [5, 40],
        dict(
            batch=3,
            tokens=40,
            key_heads=2,
            value_heads=4,
            key_dim=64,
            value_dim=48,
            dtype="float16",
            mask_kind="random",
            head_mapping="interleaved",
            decay_parameterization="negative_rate",
            allow_neg_eigval=True,
            per_key_gates=True,
            lower_bound=-1.0,
        ),
    ),
    (
        "chunked",
        [3, 64, 130],
        dict(
            batch=2,
            tokens=130,
            key_heads=2,
            value_heads=4,
            key_dim=48,
            value_dim=40,
            conv_kernel=3,
            dtype="float32",
            mask_kind="right_padding",
            with_conv_state=False,
            allow_neg_eigval=True,
        ),
    ),
    (
        "recurrent",
        None,
        dict(
            batch=2,
            tokens=7,
            key_heads=1,
            value_heads=2,
            key_dim=32,
            value_dim=32,
            conv_kernel=1,
            dtype="float32",
        ),
    ),
    (
        "recurrent",
        [2, 3],
        dict(
            batch=2,
            tokens=3,
            key_heads=1,
            value_heads=2,
            key_dim=32,
            value_dim=32,
            conv_kernel=6,
            dtype="bfloat16",
            mask_kind="random",
        ),
    ),
]


def check_segment(n, algorithm, checkpoints, shape):
    """The segment on the GPU (its kernels around the core's) against the CPU's
    segment and the float64 oracle: out and the state within the tolerances of
    the core's cases above against the oracle, both devices; the conv states
    (and their checkpoints) equal to the CPU's, bit for bit (they are copies);
    the state checkpoints within the state's tolerance of the CPU's; a masked
    token's out exactly 0."""
    case = make_segment_case(300 + n, **shape)

    def call(stream):
        outputs = gated_delta_segment(
            *case.args(),
            algorithm=algorithm,
            checkpoints=checkpoints,
            stream=stream,
            **case.options,
        )
        mx.eval(outputs)
        return [np.asarray(x.astype(mx.float32), dtype=np.float64) for x in outputs]

    gpu, cpu = call(mx.gpu), call(mx.cpu)
    ref_out, ref_conv_state, ref_state = case.reference()
    errors = {
        "out": (relative_to(gpu[0], ref_out), relative_to(cpu[0], ref_out)),
        "state": (relative_to(gpu[2], ref_state), relative_to(cpu[2], ref_state)),
    }
    dtype = shape["dtype"]
    tolerance = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}[dtype]
    ok = errors["out"][0] < tolerance and errors["state"][0] < 1e-4
    ok = ok and all(np.isfinite(e[0]) for e in errors.values())
    conv_states = [(gpu[1], cpu[1])] + ([(gpu[3], cpu[3])] if checkpoints else [])
    exact = all(np.array_equal(a, b) for a, b in conv_states)
    exact = exact and np.array_equal(gpu[1], np.asarray(ref_conv_state, dtype=np.float64))
    mask = case.options.get("mask")
    if mask is not None:
        exact = exact and np.all(gpu[0][~np.asarray(mask)] == 0.0)
    details = ", ".join(f"{k} {g:.2e} (cpu {c:.2e})" for k, (g, c) in errors.items())
    if checkpoints:
        saved = relative_to(gpu[4], cpu[4])
        ok = ok and saved < 1e-4
        details += f", state checkpoints against the CPU {saved:.2e}"
    ok = ok and exact
    options = {k: v for k, v in shape.items() if k not in ("batch", "tokens", "dtype")}
    print(
        f"{'ok  ' if ok else 'FAIL'} segment B={shape['batch']} T={shape['tokens']} {dtype} "
        f"{algorithm} checkpoints={checkpoints} {options}: against float64 {details}; "
        f"conv states and masked zeros {'exact' if exact else 'NOT EXACT'}",
        flush=True,
    )
    return ok


def relative_to(actual, expected):
    """The norm-wise relative error of two float64 arrays."""
    expected = np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


if __name__ == "__main__":
    sys.exit(main())
