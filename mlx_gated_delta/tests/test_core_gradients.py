"""Property tests of the gradients of the core op (docs/contract.md, gradients).

Ordinary pytest functions, run by the repository's `pytest` and by
`python -m mlx_gated_delta selftest` like the other property modules. The
gradients are taken on the CPU stream, and against the float64 reference on
the GPU too where MLX has one; the Metal backward is also held to the same
contracts in the emulator (`tests/metal/test_backward_emulated.py`,
`test_wy_backward_emulated.py`, `test_per_key_wy_backward_emulated.py`).
The loss is <y, Wy> + <S_final, WS>: its gradient is the vjp with the
cotangents Wy (in y's dtype, so the op and the reference see the same
numbers) and WS.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import _ext, gated_delta_rule, gated_delta_update
from mlx_gated_delta.reference import (
    gated_delta_rule_reference_vjp,
    gated_delta_update_reference_vjp,
)
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.guarded import SENTINEL, run_core_backward_guarded
from mlx_gated_delta.testing.strategies import (
    BOUNDARY_TOKENS,
    budget,
    core_cases,
    make_core_case,
    tiny_decay_gamma,
)

INPUTS = ("q", "k", "v", "g", "beta", "state")
KIND = {
    "q": "activation_grad",
    "k": "activation_grad",
    "v": "activation_grad",
    "g": "gate_grad",
    "gamma": "gate_grad",
    "beta": "gate_grad",
    "state": "state_grad",
}

# Fewer examples than the forward's properties: each one runs the float64
# reference backward, a Python loop over tokens.
BUDGET = budget(40)
SMALL_BUDGET = budget(15)
# An explicit algorithm runs that form's backward too; "auto" picks by T.
ALGORITHMS = ("auto", "recurrent", "chunked")
SHORT_TOKENS = st.one_of(st.sampled_from(BOUNDARY_TOKENS[:7]), st.integers(1, 140))


def contract(prefix, name, grad):
    return f"{prefix}.{str(grad.dtype).rsplit('.', 1)[-1]}.{KIND[name]}"


def cotangents(case, seed=0):
    rng = np.random.default_rng(seed)
    wy = mx.array(rng.standard_normal(case.v.shape).astype(np.float32)).astype(case.v.dtype)
    shape = (case.v.shape[0], case.v.shape[2], case.v.shape[3], case.q.shape[3])
    ws = mx.array(rng.standard_normal(shape).astype(np.float32))
    return wy, ws


def case_gradients(
    case, wy, ws, *, algorithm="auto", use_y=True, use_state=True, transform=None, stream=mx.cpu
):
    """The gradients of the loss wrt every input the case has, as a dict."""
    names = [name for name in INPUTS if getattr(case, name) is not None]

    def loss(*arrays):
        y, state = gated_delta_rule(
            **dict(zip(names, arrays)), **case.options, algorithm=algorithm, stream=stream
        )
        total = mx.array(0.0)
        if use_y:
            total = total + (y * wy).astype(mx.float32).sum()
        if use_state:
            total = total + (state * ws).sum()
        return total

    grad = mx.grad(loss, argnums=tuple(range(len(names))))
    if transform is not None:
        grad = transform(grad)
    grads = grad(*[getattr(case, name) for name in names])
    mx.eval(grads)
    return dict(zip(names, grads))


def assert_gradients_match(prefix, grads, expected):
    for name, grad in grads.items():
        assert_matches(f"d{name}", grad, expected[name], contract(prefix, name, grad))


# The backward's devices: the CPU, and the GPU where there is one (the Metal
# backward takes `algorithm` as the CPU's does, "auto" chunked from 8 tokens,
# scalar and per-key gates alike; the CUDA backward too, "auto" chunked from
# 64 tokens).
DEVICES = ("cpu", "gpu") if mx.metal.is_available() or mx.cuda.is_available() else ("cpu",)


@pytest.mark.parametrize("device", DEVICES)
@BUDGET
@given(
    case=core_cases(tokens=SHORT_TOKENS, contracting=False),
    which=st.sampled_from(("both", "y", "state")),
    algorithm=st.sampled_from(ALGORITHMS),
)
def test_gradients_match_the_float64_reference(device, case, which, algorithm):
    wy, ws = cotangents(case)
    use_y, use_state = which in ("both", "y"), which in ("both", "state")
    grads = case_gradients(
        case,
        wy,
        ws,
        algorithm=algorithm,
        use_y=use_y,
        use_state=use_state,
        stream=getattr(mx, device),
    )
    expected = gated_delta_rule_reference_vjp(
        *case.args(),
        y_cotangent=wy if use_y else None,
        state_cotangent=ws if use_state else None,
        **case.options,
    )
    for name, grad in grads.items():
        assert grad.dtype == getattr(case, name).dtype, name
    assert_gradients_match("core_grad.oracle.v1", grads, expected)

    # Masked steps: their inputs get exactly zero gradient.
    mask = case.options["mask"]
    if mask is not None:
        skipped = ~np.asarray(mask)
        for name in ("q", "k", "v", "g", "beta"):
            values = np.asarray(grads[name].astype(mx.float32))
            assert np.all(values[skipped] == 0.0), name


@SMALL_BUDGET
@given(case=core_cases(dtypes=("float32",), tokens=SHORT_TOKENS, contracting=False), data=st.data())
def test_split_gradients_equal_the_gradient_of_one_call(case, data):
    tokens = case.q.shape[1]
    cut = data.draw(st.integers(0, tokens), label="cut")
    wy, ws = cotangents(case)
    whole = case_gradients(case, wy, ws)
    if case.state is None:
        # The split needs a state input to differentiate: zeros are the default.
        shape = (case.v.shape[0], case.v.shape[2], case.v.shape[3], case.q.shape[3])
        case.state = mx.zeros(shape)
    mask = case.options["mask"]
    options = {key: value for key, value in case.options.items() if key != "mask"}

    def loss(q, k, v, g, beta, state):
        ys = []
        for start, end in ((0, cut), (cut, tokens)):
            y, state = gated_delta_rule(
                q[:, start:end],
                k[:, start:end],
                v[:, start:end],
                g[:, start:end],
                beta[:, start:end],
                state,
                **options,
                mask=None if mask is None else mask[:, start:end],
                stream=mx.cpu,
            )
            ys.append(y)
        y = mx.concatenate(ys, axis=1)
        return (y * wy).sum() + (state * ws).sum()

    split = mx.grad(loss, argnums=tuple(range(6)))(*case.args())
    split = dict(zip(INPUTS, split))
    for name, grad in whole.items():
        assert_matches(f"d{name}", split[name], grad, contract("core_grad.split.v1", name, grad))


@SMALL_BUDGET
@given(case=core_cases(dtypes=("float32",), tokens=SHORT_TOKENS, contracting=False))
def test_gradients_agree_between_the_algorithms(case):
    """The recurrent form's backward against the chunked WY form's."""
    wy, ws = cotangents(case)
    recurrent = case_gradients(case, wy, ws, algorithm="recurrent")
    chunked = case_gradients(case, wy, ws, algorithm="chunked")
    for name, grad in chunked.items():
        assert_matches(
            f"d{name}", grad, recurrent[name], contract("core_grad.algorithms.v1", name, grad)
        )


def test_the_algorithms_run_different_backwards():
    """Probe of the property above: an explicit algorithm reaches the
    backward, so the two forms' gradients differ in their rounding (one
    backward run twice would agree bit for bit and the property would compare
    nothing), while each agrees with the float64 reference."""
    case = make_core_case(
        3, batch=1, tokens=150, key_heads=1, value_heads=2, key_dim=16, value_dim=8
    )
    wy, ws = cotangents(case)
    recurrent = case_gradients(case, wy, ws, algorithm="recurrent")
    chunked = case_gradients(case, wy, ws, algorithm="chunked")
    differing = [
        name
        for name in recurrent
        if not np.array_equal(np.asarray(recurrent[name]), np.asarray(chunked[name]))
    ]
    assert set(differing) == set(recurrent), differing
    expected = gated_delta_rule_reference_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, **case.options
    )
    assert_gradients_match("core_grad.oracle.v1", recurrent, expected)
    assert_gradients_match("core_grad.oracle.v1", chunked, expected)


@pytest.mark.parametrize("per_key_gates", (False, True))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SMALL_BUDGET
@given(data=st.data())
def test_backward_guard_no_write_past_the_gradients(algorithm, per_key_gates, data):
    """The CPU backward run on gradient buffers with sentinel words past each
    end leaves the sentinels as they were, and gives the gradients that
    `mx.grad` gives, bit for bit (the same kernel)."""
    case = data.draw(
        core_cases(with_state=st.just(True), per_key_gates=per_key_gates), label="case"
    )
    wy, ws = cotangents(case)
    gradients, tails = run_core_backward_guarded(
        *case.args(), wy, ws, **case.options, algorithm=algorithm, sentinel=SENTINEL
    )
    # dq, dk and dv hold the sentinel in the activation dtype (73.25 is 73.0
    # in bfloat16).
    in_activation_dtype = mx.array(SENTINEL, dtype=case.v.dtype).astype(mx.float32).item()
    for name, tail in tails.items():
        sentinel = in_activation_dtype if name in ("dq", "dk", "dv") else SENTINEL
        assert tail.size == 16 and np.all(tail == sentinel), f"{name} written past its end: {tail}"
    for name, grad in case_gradients(case, wy, ws, algorithm=algorithm).items():
        guarded = mx.array(gradients[f"d{name}"]).astype(grad.dtype)
        assert mx.array_equal(guarded, grad).item(), f"d{name}"


def test_auto_backward_resolves_by_length():
    """The backward's "auto" on the CPU: recurrent below its crossover length,
    chunked from it on, per-key gates as scalar ones (core/dispatch.cpp)."""
    shape = dict(batch=1, key_heads=16, value_heads=32, key_dim=128, value_dim=128)
    crossover = _ext.CHUNKED_BACKWARD_MIN_TOKENS
    for per_key_gates in (False, True):
        resolve = _ext.resolve_cpu_backward_algorithm
        assert resolve(tokens=crossover - 1, per_key_gates=per_key_gates, **shape) == "recurrent"
        assert resolve(tokens=crossover, per_key_gates=per_key_gates, **shape) == "chunked"


@pytest.mark.parametrize("transform", ("compile", "vmap_of_grad", "grad_of_vmap"))
def test_gradients_under_compile_and_vmap(transform):
    cases = [
        make_core_case(
            seed,
            batch=2,
            tokens=70,
            key_heads=2,
            value_heads=4,
            key_dim=16,
            value_dim=8,
            mask_kind="random",
            normalize_qk=True,
            head_mapping="interleaved",
        )
        for seed in (1, 2)
    ]
    wy, ws = cotangents(cases[0])
    expected = [case_gradients(case, wy, ws) for case in cases]
    if transform == "compile":
        grads = [case_gradients(case, wy, ws, transform=mx.compile) for case in cases]
    else:
        # Two independent problems stacked on a new leading axis.
        stacked = make_core_case(
            1,
            batch=2,
            tokens=70,
            key_heads=2,
            value_heads=4,
            key_dim=16,
            value_dim=8,
            mask_kind="random",
            normalize_qk=True,
            head_mapping="interleaved",
        )
        for name in INPUTS:
            setattr(stacked, name, mx.stack([getattr(case, name) for case in cases]))
        stacked.options = {**stacked.options, "mask": mx.stack([c.options["mask"] for c in cases])}
        mask = stacked.options.pop("mask")
        options = stacked.options

        def per_problem_loss(q, k, v, g, beta, state, mask):
            y, state = gated_delta_rule(
                q, k, v, g, beta, state, **options, mask=mask, stream=mx.cpu
            )
            return (y * wy).sum() + (state * ws).sum()

        arrays = [getattr(stacked, name) for name in INPUTS] + [mask]
        if transform == "vmap_of_grad":
            grad = mx.vmap(mx.grad(per_problem_loss, argnums=tuple(range(6))))
        else:

            def total(*arrays):
                return mx.vmap(per_problem_loss)(*arrays).sum()

            grad = mx.grad(total, argnums=tuple(range(6)))
        result = grad(*arrays)
        grads = [{name: value[i] for name, value in zip(INPUTS, result)} for i in range(len(cases))]
    for got, want in zip(grads, expected):
        for name, grad in want.items():
            assert_matches(
                f"d{name}", got[name], grad, contract("core_grad.transforms.v1", name, grad)
            )


def update_with_algorithm(q, k, v, gamma, beta, state, algorithm):
    """gated_delta_update (which always runs "auto") with an explicit
    algorithm: the same core call, gamma passed as the linear decay."""
    if algorithm == "auto":
        return gated_delta_update(q, k, v, gamma, beta, state, stream=mx.cpu)
    g = mx.log(mx.stop_gradient(gamma).astype(mx.float32))
    return _ext.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        state,
        1.0,
        "grouped",
        None,
        False,
        algorithm,
        mx.cpu,
        g_name="gamma",
        state_name="initial_state",
        gamma=gamma,
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("tokens", (5, 130))
def test_wipes_give_finite_exact_gradients(tokens, algorithm):
    case = make_core_case(
        4,
        batch=2,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
    )
    wipes = np.zeros(case.g.shape, dtype=bool)
    wipes[0, 2, 0] = wipes[1, tokens - 2, :] = wipes[:, tokens // 2, 1] = True
    gamma = mx.where(mx.array(wipes), 0.0, mx.exp(case.g))
    wy, ws = cotangents(case)
    expected = gated_delta_update_reference_vjp(
        case.q, case.k, case.v, gamma, case.beta, case.state, y_cotangent=wy, state_cotangent=ws
    )

    def loss(q, k, v, gamma, beta, state):
        y, state = update_with_algorithm(q, k, v, gamma, beta, state, algorithm)
        return (y * wy).sum() + (state * ws).sum()

    grads = mx.grad(loss, argnums=tuple(range(6)))(
        case.q, case.k, case.v, gamma, case.beta, case.state
    )
    grads = dict(zip(("q", "k", "v", "gamma", "beta", "state"), grads))
    for name, grad in grads.items():
        assert np.all(np.isfinite(np.asarray(grad))), name
    assert np.all(np.asarray(grads["gamma"])[wipes] != 0.0)  # a wipe still has a gradient
    assert_gradients_match("core_grad.oracle.v1", grads, expected)

    # Through the log-space op: g = -inf at the wipes; dg is exactly 0 there.
    case.g = mx.where(mx.array(wipes), -mx.inf, case.g)
    case.options["scale"] = 1.0
    rule = case_gradients(case, wy, ws, algorithm=algorithm)
    for name, grad in rule.items():
        assert np.all(np.isfinite(np.asarray(grad))), name
    assert np.all(np.asarray(rule["g"])[wipes] == 0.0)


@pytest.mark.parametrize("per_key_gates", (False, True))
@SMALL_BUDGET
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.sampled_from((64, 65, 130, 150)),
    dtype=st.sampled_from(("float32", "bfloat16")),
    tiny_fraction=st.sampled_from((0.1, 0.5, 1.0)),
)
def test_tiny_decays_give_gamma_its_gradient_through_the_chunked_backward(
    per_key_gates, seed, tokens, dtype, tiny_fraction
):
    """Decays that are normal floats but tiny, exp(-87) to exp(-8), run the
    chunked backward (only a decay below float32's smallest normal sends a
    chunk to the recurrent reverse). gamma's gradient there is the sum of the
    decay terms that pass the token, each without the token's own decay: as
    dg / gamma it would be dg's rounding, that of terms far larger than dg,
    divided by a tiny gamma."""
    case = make_core_case(
        seed,
        batch=1,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        dtype=dtype,
        per_key_gates=per_key_gates,
    )
    gamma = tiny_decay_gamma(case, seed, tiny_fraction, dtype)
    wy, ws = cotangents(case)
    expected = gated_delta_update_reference_vjp(
        case.q, case.k, case.v, gamma, case.beta, case.state, y_cotangent=wy, state_cotangent=ws
    )

    def loss(q, k, v, gamma, beta, state):
        y, state = update_with_algorithm(q, k, v, gamma, beta, state, "chunked")
        return (y * wy).astype(mx.float32).sum() + (state * ws).sum()

    grads = mx.grad(loss, argnums=tuple(range(6)))(
        case.q, case.k, case.v, gamma, case.beta, case.state
    )
    grads = dict(zip(("q", "k", "v", "gamma", "beta", "state"), grads))
    assert_gradients_match("core_grad.oracle.v1", grads, expected)


# MLX's CUDA backend: recurrent_backward at its widest key dims (256 with
# scalar gates, 224 with per-key gates, where its staged chunk fills a block's
# shared memory; the drawn cases stop at 130), held to the float64 reference
# with a value dim over 128.
def widest_cuda_case(per_key_gates, key_dim):
    return make_core_case(
        3,
        batch=1,
        tokens=70,
        key_heads=1,
        value_heads=2,
        key_dim=key_dim,
        value_dim=160,
        per_key_gates=per_key_gates,
    )


@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend only")
@pytest.mark.parametrize("per_key_gates, key_dim", [(False, 256), (True, 224)])
def test_cuda_backward_at_its_widest_key_dims(per_key_gates, key_dim):
    case = widest_cuda_case(per_key_gates, key_dim)
    wy, ws = cotangents(case)
    grads = case_gradients(case, wy, ws, stream=mx.gpu)
    expected = gated_delta_rule_reference_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, **case.options
    )
    assert_gradients_match("core_grad.oracle.v1", grads, expected)


# Per-key gates one key dim past the CUDA backward (the forward runs it):
# taking the gradient raises, naming the call and the CPU, which takes it.
@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend only")
def test_cuda_backward_past_its_key_dims_raises_and_names_the_cpu():
    case = widest_cuda_case(True, 225)
    wy, ws = cotangents(case)
    with pytest.raises(
        ValueError,
        match=r"the gradient of gated_delta_rule on the GPU .* key dim 225 with per-key gates"
        r".*stream=mx\.cpu",
    ):
        case_gradients(case, wy, ws, stream=mx.gpu)
    case_gradients(case, wy, ws, stream=mx.cpu)
