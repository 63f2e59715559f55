"""Property tests of the fused segment's gradients (docs/contract.md, gradients).

Ordinary pytest functions, run by the repository's `pytest` and by
`python -m mlx_gated_delta selftest`. The backward runs on the CPU only so
far, so every gradient here is taken on the CPU stream. The loss is
<out, W_out> + <conv_state, W_conv> + <state, W_state> (each term optional):
its gradient is the segment's vjp for those cotangents. The reference is the
central finite difference of the float64 segment oracle, so shapes stay small.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_segment
from mlx_gated_delta.reference import gated_delta_segment_reference, to_float64
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.segment_cases import gate_variant_options, make_segment_case
from mlx_gated_delta.testing.strategies import budget

INPUTS = (
    "mixed",
    "conv_weight",
    "decay_parameter",
    "dt_bias",
    "norm_weight",
    "conv_state",
    "state",
)
KIND = {
    "mixed": "input_grad",
    "conv_state": "input_grad",
    "conv_weight": "parameter_grad",
    "decay_parameter": "parameter_grad",
    "dt_bias": "parameter_grad",
    "norm_weight": "parameter_grad",
    "state": "state_grad",
}

# Each finite-difference example runs the Python-loop oracle twice per input
# element: small shapes and few examples.
FD_BUDGET = budget(12)
SMALL_BUDGET = budget(10)
FD_STEP = 1e-6


def contract(prefix, name, grad):
    dtype = str(grad.dtype).rsplit(".", 1)[-1]
    if KIND[name] != "input_grad":
        dtype = "float32"  # parameters and the state: float32 gradients
    return f"{prefix}.{dtype}.{KIND[name]}"


def cotangents(case, seed=0):
    """W_out, W_conv, W_state in the dtypes of the outputs they weigh, so the
    segment and the oracle see the same numbers."""
    o = case.options
    batch, tokens = case.mixed.shape[:2]
    kernel = case.conv_weight.shape[1]
    channels = case.conv_weight.shape[0]
    dtype = case.mixed.dtype
    rng = np.random.default_rng(seed)

    def draw(shape, dtype=mx.float32):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    return (
        draw((batch, tokens, o["value_heads"], o["value_dim"]), dtype),
        draw((batch, kernel - 1, channels), dtype),
        draw((batch, o["value_heads"], o["value_dim"], o["key_dim"])),
    )


def _weighted(outputs, weights, use):
    total = mx.array(0.0)
    for output, weight, used in zip(outputs, weights, use):
        if used:
            total = total + (output.astype(mx.float32) * weight.astype(mx.float32)).sum()
    return total


def segment_gradients(
    case, weights, use=(True, True, True), *, algorithm="auto", transform=None, stream=mx.cpu
):
    """The gradients of the weighted loss wrt every input the case has."""
    names = [name for name in INPUTS if getattr(case, name) is not None]
    options = dict(case.options)

    def loss(*arrays):
        given_ = dict(zip(names, arrays))
        args = [given_.get(name) for name in INPUTS]
        outputs = gated_delta_segment(*args, **options, algorithm=algorithm, stream=stream)
        return _weighted(outputs, weights, use)

    grad = mx.grad(loss, argnums=tuple(range(len(names))))
    if transform is not None:
        grad = transform(grad)
    grads = grad(*[getattr(case, name) for name in names])
    mx.eval(grads)
    return dict(zip(names, grads))


def finite_difference_gradients(case, weights, use=(True, True, True)):
    """Central differences of the float64 oracle's weighted loss, per element."""
    names = [name for name in INPUTS if getattr(case, name) is not None]
    arrays = {name: to_float64(getattr(case, name)) for name in names}
    w = [to_float64(x) for x in weights]

    def loss():
        args = [arrays.get(name) for name in INPUTS]
        outputs = gated_delta_segment_reference(*args, **case.options)
        return sum(float(np.sum(o * x)) for o, x, u in zip(outputs, w, use) if u)

    grads = {}
    for name in names:
        values = arrays[name]
        grad = np.zeros_like(values)
        for index in np.ndindex(values.shape):
            original = values[index]
            values[index] = original + FD_STEP
            up = loss()
            values[index] = original - FD_STEP
            down = loss()
            values[index] = original
            grad[index] = (up - down) / (2 * FD_STEP)
        grads[name] = grad
    return grads


@st.composite
def small_segment_cases(draw, dtypes=("float32", "float16", "bfloat16")):
    key_heads = draw(st.integers(1, 2))
    return make_segment_case(
        draw(st.integers(0, 2**32 - 1)),
        batch=draw(st.integers(1, 2)),
        tokens=draw(st.integers(1, 7)),
        key_heads=key_heads,
        value_heads=key_heads * draw(st.sampled_from((1, 2))),
        key_dim=4,
        value_dim=draw(st.sampled_from((2, 4))),
        conv_kernel=draw(st.sampled_from((1, 2, 4))),
        dtype=draw(st.sampled_from(dtypes)),
        decay_parameterization=draw(st.sampled_from(("log_rate", "negative_rate"))),
        head_mapping=draw(st.sampled_from(("grouped", "interleaved"))),
        with_conv_state=draw(st.booleans()),
        with_state=draw(st.booleans()),
        mask_kind=draw(st.sampled_from(("none", "random", "left_padding"))),
        conv1d_layout=draw(st.booleans()),
        **draw(gate_variant_options()),
    )


USES = {
    "all": (True, True, True),
    "out": (True, False, False),
    "conv_state": (False, True, False),
    "state": (False, False, True),
}


# The CPU, and the GPU where there is one: the segment's vjp runs its stages
# as CPU kernels on the CPU and as MLX ops on the GPU, around the core's
# backward, which has Metal and CUDA kernels.
DEVICES = ("cpu", "gpu") if mx.metal.is_available() or mx.cuda.is_available() else ("cpu",)


@pytest.mark.parametrize("device", DEVICES)
@FD_BUDGET
@given(case=small_segment_cases(), which=st.sampled_from(tuple(USES)))
def test_segment_gradients_match_finite_differences_of_the_oracle(device, case, which):
    weights = cotangents(case)
    grads = segment_gradients(case, weights, USES[which], stream=getattr(mx, device))
    expected = finite_difference_gradients(case, weights, USES[which])
    for name, grad in grads.items():
        assert grad.dtype == getattr(case, name).dtype, name
        assert grad.shape == getattr(case, name).shape, name
        assert_matches(
            f"d{name}", grad, expected[name], contract("segment_grad.oracle.v1", name, grad)
        )

    # Skip semantics: a masked token's packed input gets exactly zero gradient.
    mask = case.options["mask"]
    if mask is not None:
        skipped = ~np.asarray(mask)
        values = np.asarray(grads["mixed"].astype(mx.float32))
        assert np.all(values[skipped] == 0.0)


def test_the_finite_difference_check_sees_a_wrong_mask_semantics():
    """Probe: mlx-lm's semantics (a masked token zeroed but still in the conv
    window) differs from the skip semantics in the gradients too, by far more
    than the contract: the check above would catch a vjp that had it."""
    case = make_segment_case(
        7,
        batch=1,
        tokens=6,
        key_heads=1,
        value_heads=1,
        key_dim=4,
        value_dim=2,
        conv_kernel=4,
        mask_kind="none",
    )
    case.options["mask"] = mx.array([[True, True, False, True, True, True]])
    weights = cotangents(case)
    skip = finite_difference_gradients(case, weights)
    zeroed = dict(case.options, mask=None)
    keep = np.asarray(case.options["mask"])[..., None]
    case.mixed = mx.where(mx.array(keep), case.mixed, 0.0)
    case.options = zeroed
    windowed = finite_difference_gradients(case, weights)
    with pytest.raises(AssertionError, match="violated"):
        assert_matches(
            "dconv_weight",
            windowed["conv_weight"],
            skip["conv_weight"],
            contract("segment_grad.oracle.v1", "conv_weight", case.conv_weight),
        )


@SMALL_BUDGET
@given(case_seed=st.integers(0, 2**32 - 1), tokens=st.integers(2, 140), data=st.data())
def test_split_gradients_equal_the_gradient_of_one_call(case_seed, tokens, data):
    case = make_segment_case(
        case_seed,
        batch=2,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        mask_kind=data.draw(st.sampled_from(("none", "random")), label="mask"),
        decay_parameterization=data.draw(
            st.sampled_from(("log_rate", "negative_rate")), label="decay"
        ),
        **data.draw(gate_variant_options(), label="gates"),
    )
    cut = data.draw(st.integers(0, tokens), label="cut")
    weights = cotangents(case)
    whole = segment_gradients(case, weights)
    options = {key: value for key, value in case.options.items() if key != "mask"}
    mask = case.options["mask"]

    def loss(mixed, conv_weight, decay_parameter, dt_bias, norm_weight, conv_state, state):
        outs = []
        for start, end in ((0, cut), (cut, tokens)):
            out, conv_state, state = gated_delta_segment(
                mixed[:, start:end],
                conv_weight,
                decay_parameter,
                dt_bias,
                norm_weight,
                conv_state,
                state,
                **options,
                stream=mx.cpu,
                mask=None if mask is None else mask[:, start:end],
            )
            outs.append(out)
        return _weighted((mx.concatenate(outs, axis=1), conv_state, state), weights, (True,) * 3)

    split = mx.grad(loss, argnums=tuple(range(7)))(*case.args())
    for name, grad in zip(INPUTS, split):
        assert_matches(f"d{name}", grad, whole[name], contract("segment_grad.split.v1", name, grad))


@SMALL_BUDGET
@given(case_seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 140))
def test_gradients_agree_between_the_algorithms(case_seed, tokens):
    case = make_segment_case(
        case_seed,
        batch=2,
        tokens=tokens,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
        mask_kind="random",
        head_mapping="interleaved",
    )
    weights = cotangents(case)
    recurrent = segment_gradients(case, weights, algorithm="recurrent")
    chunked = segment_gradients(case, weights, algorithm="chunked")
    for name, grad in chunked.items():
        assert_matches(
            f"d{name}", grad, recurrent[name], contract("segment_grad.algorithms.v1", name, grad)
        )


def _stacked_case(cases):
    """One case whose batch-carrying inputs stack `cases` on a new leading
    axis (the parameters are the first case's, shared)."""
    stacked = make_segment_case(**cases[0].recipe)
    for name in ("mixed", "conv_state", "state"):
        setattr(stacked, name, mx.stack([getattr(c, name) for c in cases]))
    return stacked, mx.stack([c.options["mask"] for c in cases])


@pytest.mark.parametrize("transform", ("compile", "vmap_of_grad", "grad_of_vmap"))
def test_gradients_under_compile_and_vmap(transform):
    recipe = dict(
        batch=2,
        tokens=70,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
        mask_kind="random",
        decay_parameterization="negative_rate",
    )
    first = make_segment_case(1, **recipe)
    second = make_segment_case(2, **recipe)
    # Shared parameters, so per-problem gradients are comparable.
    for name in ("conv_weight", "decay_parameter", "dt_bias", "norm_weight"):
        setattr(second, name, getattr(first, name))
    cases = [first, second]
    weights = cotangents(first)
    expected = [segment_gradients(case, weights) for case in cases]
    if transform == "compile":
        got = [segment_gradients(case, weights, transform=mx.compile) for case in cases]
    else:
        stacked, mask = _stacked_case(cases)
        options = {key: value for key, value in stacked.options.items() if key != "mask"}
        batched = ("mixed", "conv_state", "state")

        def per_problem_loss(
            mixed, conv_state, state, mask, conv_weight, decay, dt_bias, norm_weight
        ):
            outputs = gated_delta_segment(
                mixed,
                conv_weight,
                decay,
                dt_bias,
                norm_weight,
                conv_state,
                state,
                **options,
                mask=mask,
                stream=mx.cpu,
            )
            return _weighted(outputs, weights, (True,) * 3)

        arrays = (
            [getattr(stacked, name) for name in batched]
            + [mask]
            + [
                getattr(stacked, name)
                for name in ("conv_weight", "decay_parameter", "dt_bias", "norm_weight")
            ]
        )
        argnums = (0, 1, 2, 4, 5, 6, 7)
        names = (
            "mixed",
            "conv_state",
            "state",
            "conv_weight",
            "decay_parameter",
            "dt_bias",
            "norm_weight",
        )
        in_axes = (0, 0, 0, 0, None, None, None, None)
        if transform == "vmap_of_grad":
            # Per-problem gradients, the parameters' included.
            grad = mx.vmap(mx.grad(per_problem_loss, argnums=argnums), in_axes=in_axes)
            result = grad(*arrays)
            got = [{n: r[i] for n, r in zip(names, result)} for i in range(2)]
        else:

            def total(*arrays):
                return mx.vmap(per_problem_loss, in_axes=in_axes)(*arrays).sum()

            result = dict(zip(names, mx.grad(total, argnums=argnums)(*arrays)))
            got = [{n: result[n][i] for n in batched} for i in range(2)]
            # The shared parameters get the sum of the per-problem gradients.
            summed = {n: expected[0][n] + expected[1][n] for n in names if n not in batched}
            for name, grad in summed.items():
                assert_matches(
                    f"d{name}",
                    result[name],
                    grad,
                    contract("segment_grad.transforms.v1", name, grad),
                )
    for want, have in zip(expected, got):
        for name, grad in have.items():
            assert_matches(
                f"d{name}", grad, want[name], contract("segment_grad.transforms.v1", name, grad)
            )


def test_gradients_come_back_in_each_parameters_dtype():
    case = make_segment_case(
        3,
        batch=1,
        tokens=5,
        key_heads=1,
        value_heads=2,
        key_dim=4,
        value_dim=4,
        dtype="bfloat16",
        conv1d_layout=True,
    )
    case.conv_weight = case.conv_weight.astype(mx.bfloat16)
    case.decay_parameter = case.decay_parameter.astype(mx.float16)
    grads = segment_gradients(case, cotangents(case))
    for name, grad in grads.items():
        value = getattr(case, name)
        assert (grad.dtype, grad.shape) == (value.dtype, value.shape), name


@pytest.mark.parametrize("batch, tokens", ((0, 5), (0, 0), (2, 0)))
@pytest.mark.parametrize("mask_kind", ("none", "random"))
def test_gradients_of_an_empty_call_are_zeros_of_each_input(batch, tokens, mask_kind):
    # Found by the fuzz: with no batch row the gradient failed inside MLX
    # (a scatter into an empty array) instead of returning zeros.
    case = make_segment_case(
        5,
        batch=batch,
        tokens=tokens,
        key_heads=1,
        value_heads=2,
        key_dim=4,
        value_dim=4,
        mask_kind=mask_kind,
    )
    weights = cotangents(case)
    grads = segment_gradients(case, weights)
    assert set(grads) == {name for name in INPUTS if getattr(case, name) is not None}
    # No token: the conv state and the state pass through unchanged, so their
    # gradients are their outputs' cotangents; nothing else gets a gradient.
    passed_through = {"conv_state": weights[1], "state": weights[2]}
    for name, grad in grads.items():
        value = getattr(case, name)
        assert (grad.dtype, grad.shape) == (value.dtype, value.shape), name
        expected = passed_through.get(name, mx.zeros_like(grad)).astype(grad.dtype)
        assert mx.array_equal(grad, expected).item(), name
