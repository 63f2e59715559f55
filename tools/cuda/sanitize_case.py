"""The calls compute-sanitizer watches (tools/cuda/sanitize.sh): every CUDA kernel of the
core op once, on small shapes (two chunks and a partial one, a mask, checkpoints, per-key
gates in both forms, a tree), the backward with a mask (scalar and per-key gates in both forms), the fused segment's
kernels (a mask, checkpoints, per-key and scalar gates, both core forms), and checks of the
chunked result against the recurrent one, of the backward's gradients and of the segment's
outputs against the CPU's, so that a race that changes the numbers also fails the run."""

import sys

import mlx.core as mx
import numpy as np

from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case


def main():
    rng = np.random.default_rng(0)
    B, T, Hk, Hv, D = 1, 150, 1, 2, 64

    def arr(*shape, dtype=mx.float32):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q, k, v = arr(B, T, Hk, D), arr(B, T, Hk, D), arr(B, T, Hv, D, dtype=mx.bfloat16)
    g = mx.array(-rng.uniform(0, 0.5, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (B, T, Hv)).astype(np.float32))
    mask = mx.array(rng.uniform(size=(B, T)) < 0.9)
    state = arr(B, Hv, D, D)
    results = {}
    for algorithm in ("recurrent", "chunked"):
        y, s = gated_delta_rule(
            q,
            k,
            v.astype(mx.float32),
            g,
            beta,
            state,
            normalize_qk=True,
            mask=mask,
            algorithm=algorithm,
        )
        mx.eval(y, s)
        results[algorithm] = (np.asarray(y), np.asarray(s))
    q16, k16 = q.astype(mx.bfloat16), k.astype(mx.bfloat16)
    for algorithm in ("recurrent", "chunked"):
        outputs = gated_delta_rule(
            q16,
            k16,
            v,
            g,
            beta,
            state,
            normalize_qk=True,
            checkpoints=[3, 64, 100],
            algorithm=algorithm,
        )
        mx.eval(*outputs)
    parents = [-1] + list(range(T - 1))
    parents[5] = 2  # a branch
    mx.eval(*gated_delta_rule(q16, k16, v, g, beta, state, parents=parents))
    # Per-key gates, each key channel its own: both forms, and the chunked one with
    # checkpoints (which the recurrent kernel writes beside the chunked kernels).
    key_gates = g[..., None] * (1.0 + 0.1 * mx.abs(arr(B, T, Hv, D)))
    key_results = {}
    for algorithm in ("recurrent", "chunked"):
        y, s = gated_delta_rule(
            q16, k16, v, key_gates, beta, state, normalize_qk=True, mask=mask, algorithm=algorithm
        )
        mx.eval(y, s)
        key_results[algorithm] = (np.asarray(y.astype(mx.float32)), np.asarray(s))
    mx.eval(
        *gated_delta_rule(
            q16, k16, v, key_gates, beta, state, checkpoints=[3, 64, 100], algorithm="chunked"
        )
    )
    worst = max(
        float(np.abs(a - b).max() / np.abs(b).max())
        for outcome in (results, key_results)
        for a, b in zip(outcome["chunked"], outcome["recurrent"])
    )
    print(f"sanitize_case: chunked against recurrent, max relative difference {worst:.2e}")

    # Scalar and per-key gates through the chunked backward's kernels and through
    # recurrent_backward.
    inputs = [q, k, v.astype(mx.float32), g, beta, state]
    cotangents = [arr(B, T, Hv, D), arr(B, Hv, D, D)]
    worst_grad = backward_difference(
        inputs,
        cotangents,
        mask,
        tuple((gates, form) for gates in (g, key_gates) for form in ("chunked", "recurrent")),
    )
    print(f"sanitize_case: backward against the CPU's, max relative difference {worst_grad:.2e}")
    worst_segment = segment_differences()
    print(f"sanitize_case: segment against the CPU's, max relative difference {worst_segment:.2e}")
    return 0 if worst < 1e-4 and worst_grad < 2e-3 and worst_segment < 1e-4 else 1


def backward_difference(inputs, cotangents, mask, variants):
    """The largest norm-wise difference of the core op's input gradients on the GPU from
    the CPU's, over `variants`: (the gates, the backward's algorithm) pairs."""

    def gradients(stream, gates, algorithm):
        def forward(*x):
            return list(
                gated_delta_rule(
                    *x, normalize_qk=True, mask=mask, algorithm=algorithm, stream=stream
                )
            )

        _, grads = mx.vjp(forward, inputs[:3] + [gates] + inputs[4:], cotangents)
        mx.eval(grads)
        return [np.asarray(x) for x in grads]

    return max(
        float(np.linalg.norm(a - b) / np.linalg.norm(b))
        for gates, algorithm in variants
        for a, b in zip(gradients(mx.gpu, gates, algorithm), gradients(mx.cpu, gates, algorithm))
    )


def recurrent_backward_probe_case():
    """The racecheck of the probe build's recurrent_backward (tools/cuda/sanitize.sh): its
    two calls of the whole case on a short sequence. The planted race makes racecheck
    report a hazard at every token, and over the whole case's 150 tokens that report ran
    past a device run's time limit."""
    rng = np.random.default_rng(1)
    B, T, Hk, Hv, D = 1, 12, 1, 2, 32

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    g = mx.array(-rng.uniform(0, 0.5, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (B, T, Hv)).astype(np.float32))
    inputs = [arr(B, T, Hk, D), arr(B, T, Hk, D), arr(B, T, Hv, D), g, beta, arr(B, Hv, D, D)]
    mask = mx.array(rng.uniform(size=(B, T)) < 0.9)
    per_key = g[..., None] * (1.0 + 0.1 * arr(B, T, Hv, D))
    worst = backward_difference(
        inputs,
        [arr(B, T, Hv, D), arr(B, Hv, D, D)],
        mask,
        ((g, "recurrent"), (per_key, "recurrent")),
    )
    print(
        f"sanitize_case: recurrent backward against the CPU's, max relative difference {worst:.2e}"
    )
    return 0 if worst < 2e-3 else 1


def segment_differences():
    """The segment's kernels: a masked call with checkpoints through the chunked core
    (scalar gates) and through the recurrent one (per-key gates, the gate variants);
    the largest norm-wise difference of any output from the CPU's."""
    worst = 0.0
    for seed, algorithm, options in (
        (0, "chunked", {}),
        (1, "recurrent", {"per_key_gates": True, "lower_bound": -5.0, "output_gate": "sigmoid"}),
    ):
        case = make_segment_case(
            seed,
            batch=2,
            tokens=100,
            key_heads=1,
            value_heads=2,
            key_dim=32,
            value_dim=32,
            mask_kind="random",
            allow_neg_eigval=True,
            **options,
        )
        outputs = {
            stream: gated_delta_segment(
                *case.args(),
                algorithm=algorithm,
                checkpoints=[3, 64],
                stream=stream,
                **case.options,
            )
            for stream in (mx.gpu, mx.cpu)
        }
        mx.eval(outputs[mx.gpu], outputs[mx.cpu])
        for a, b in zip(outputs[mx.gpu], outputs[mx.cpu]):
            a, b = np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32))
            worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return worst


if __name__ == "__main__":
    sys.exit(
        recurrent_backward_probe_case() if sys.argv[1:] == ["--recurrent-backward"] else main()
    )
