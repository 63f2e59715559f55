"""Property tests of the fused layer segment `gated_delta_segment` (docs/contract.md):
agreement with the float64 oracle over both decay
parameterizations, both head mappings, the activation dtypes, masks and the
gate variants (per-key gates, lower_bound, allow_neg_eigval, the sigmoid
output gate); split continuity of out,
conv state and state; the skip semantics of masks; T == 0.

Ordinary pytest functions, run both by the repository's `pytest` (whose
`tests/test_segment.py` keeps the bad-input errors and the checks tied to the
CPU stream) and by `python -m mlx_gated_delta selftest`, on the default
device. The budget comes from the Hypothesis profile chosen by
MLX_GATED_DELTA_HYPOTHESIS_PROFILE (see `strategies`).
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_segment
from mlx_gated_delta.reference import gated_delta_segment_reference, to_float64
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.segment_cases import (
    gate_variant_options,
    make_segment_case,
    segment_cases,
)


def run(case, **overrides):
    options = dict(case.options)
    options.update(overrides)
    return gated_delta_segment(*case.args(), **options)


def dtype_name(array):
    return str(array.dtype).split(".")[-1]


@given(case=segment_cases(), algorithm=st.sampled_from(("recurrent", "chunked", "auto")))
def test_segment_matches_oracle(case, algorithm):
    out, conv_state, state = run(case, algorithm=algorithm)
    expected_out, expected_conv_state, expected_state = case.reference()
    assert out.dtype == case.mixed.dtype
    assert conv_state.dtype == case.mixed.dtype
    assert state.dtype == mx.float32
    out_terms, state_terms = case.terms(algorithm)
    assert_matches(
        "out", out, expected_out, f"segment.oracle.v3.{dtype_name(out)}.output", out_terms
    )
    assert_matches("state", state, expected_state, "segment.oracle.v3.float32.state", state_terms)
    assert_matches(
        "conv_state", conv_state, expected_conv_state, "segment.oracle.v1.any.conv_state"
    )


def split_runs(case, split_points, algorithm):
    """The case's tokens in consecutive calls passing both states along."""
    bounds = [0, *split_points, case.mixed.shape[1]]
    conv_state, state = case.conv_state, case.state
    outs = []
    mask = case.options["mask"]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        options = dict(case.options, mask=None if mask is None else mask[:, start:stop])
        out, conv_state, state = gated_delta_segment(
            case.mixed[:, start:stop],
            case.conv_weight,
            case.decay_parameter,
            case.dt_bias,
            case.norm_weight,
            conv_state,
            state,
            algorithm=algorithm,
            **options,
        )
        outs.append(out)
    return mx.concatenate(outs, axis=1), conv_state, state


@st.composite
def split_cases(draw, dtypes=("float32",)):
    case = draw(segment_cases(dtypes=dtypes, tokens=st.integers(1, 150)))
    tokens = case.mixed.shape[1]
    points = draw(st.lists(st.integers(0, tokens), min_size=1, max_size=3))
    return case, sorted(points)


@given(split=split_cases(dtypes=("float32", "float16", "bfloat16")))
def test_split_continuity_any_split_points_recurrent(split):
    case, points = split
    full = run(case, algorithm="recurrent")
    parts = split_runs(case, points, "recurrent")
    assert_matches("out", parts[0], full[0], "segment.recurrent_split.v1.any.output")
    assert_matches("conv_state", parts[1], full[1], "segment.recurrent_split.v1.any.conv_state")
    assert_matches("state", parts[2], full[2], "segment.recurrent_split.v1.float32.state")


@given(split=split_cases())
def test_split_continuity_any_split_points_chunked(split):
    case, points = split
    full = run(case, algorithm="chunked")
    parts = split_runs(case, points, "chunked")
    bounds = [0, *points, case.mixed.shape[1]]
    out_terms, state_terms = (
        np.maximum(a, b) for a, b in zip(case.terms("chunked"), case.terms("chunked", bounds[:-1]))
    )
    assert_matches("out", parts[0], full[0], "segment.chunked_split.v3.float32.output", out_terms)
    assert_matches("conv_state", parts[1], full[1], "segment.recurrent_split.v1.any.conv_state")
    assert_matches(
        "state", parts[2], full[2], "segment.chunked_split.v3.float32.state", state_terms
    )


@pytest.mark.parametrize(
    "decay_parameterization, head_mapping",
    [("log_rate", "grouped"), ("negative_rate", "interleaved")],
)
def test_split_at_three_of_four_tokens_float16(decay_parameterization, head_mapping):
    # The conformance case: half-precision activations, a
    # carried conv state and recurrent state, decode split after token 3 of 4.
    case = make_segment_case(
        7,
        batch=1,
        tokens=4,
        key_heads=2,
        value_heads=4,
        key_dim=32,
        value_dim=32,
        dtype="float16",
        decay_parameterization=decay_parameterization,
        head_mapping=head_mapping,
    )
    expected = case.reference()
    for algorithm in ("recurrent", "chunked"):
        full = run(case, algorithm=algorithm)
        out_terms, state_terms = case.terms(algorithm)
        assert_matches(
            "full out", full[0], expected[0], "segment.oracle.v3.float16.output", out_terms
        )
        assert_matches("full conv_state", full[1], expected[1], "segment.oracle.v1.any.conv_state")
        assert_matches(
            "full state", full[2], expected[2], "segment.oracle.v3.float32.state", state_terms
        )
    full = run(case, algorithm="recurrent")
    parts = split_runs(case, [3], "recurrent")
    assert_matches("split out", parts[0], full[0], "segment.recurrent_split.v1.any.output")
    assert_matches(
        "split conv_state", parts[1], full[1], "segment.recurrent_split.v1.any.conv_state"
    )
    assert_matches("split state", parts[2], full[2], "segment.recurrent_split.v1.float32.state")


@given(case=segment_cases(dtypes=("float32",), mask_kinds=("random",)))
def test_masked_token_is_an_omitted_token(case):
    # Skip semantics, checked without the oracle's own mask handling: the
    # oracle on the sequence with the masked tokens removed.
    mask = np.asarray(case.options["mask"])
    out, conv_state, state = run(case)
    out = to_float64(out)
    assert np.all(out[~mask] == 0.0)
    # A masked token changes neither state: the kept tokens' terms are those
    # of the call with the mask.
    out_terms, state_terms = case.terms("auto")
    for b in range(mask.shape[0]):
        kept = mask[b]
        row = lambda a: None if a is None else a[b : b + 1]  # noqa: E731
        options = dict(case.options, mask=None)
        expected = gated_delta_segment_reference(
            to_float64(case.mixed)[b : b + 1, kept],
            case.conv_weight,
            case.decay_parameter,
            case.dt_bias,
            case.norm_weight,
            row(case.conv_state),
            row(case.state),
            **options,
        )
        assert_matches(
            "kept out",
            out[b : b + 1, kept],
            expected[0],
            "segment.oracle.v3.float32.output",
            out_terms[b : b + 1, kept],
        )
        assert_matches(
            "conv_state", conv_state[b : b + 1], expected[1], "segment.oracle.v1.any.conv_state"
        )
        assert_matches(
            "state",
            state[b : b + 1],
            expected[2],
            "segment.oracle.v3.float32.state",
            state_terms[b : b + 1],
        )


def test_conv_state_comes_from_the_carried_state_when_few_tokens_are_kept():
    case = make_segment_case(
        3,
        batch=1,
        tokens=2,
        key_heads=1,
        value_heads=2,
        key_dim=8,
        value_dim=8,
        conv_kernel=4,
    )
    _, conv_state, _ = run(case)
    channels = case.conv_state.shape[-1]
    expected = np.concatenate(
        [to_float64(case.conv_state)[0, 2:], to_float64(case.mixed)[0, :, :channels]]
    )
    assert np.array_equal(to_float64(conv_state)[0], expected)


def test_zero_tokens_return_empty_out_and_unchanged_states():
    case = make_segment_case(
        1, batch=2, tokens=0, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    out, conv_state, state = run(case)
    assert out.shape == (2, 0, 2, 8)
    assert np.array_equal(to_float64(conv_state), to_float64(case.conv_state))
    assert np.array_equal(to_float64(state), to_float64(case.state))


@pytest.mark.parametrize("algorithm", ("recurrent", "chunked"))
@pytest.mark.parametrize("tokens", (0, 5, 70))
def test_an_empty_batch_returns_empty_outputs(algorithm, tokens):
    # Found by the fuzz: the CPU segment's wave size divided by the batch.
    case = make_segment_case(
        1, batch=0, tokens=tokens, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    out, conv_state, state = run(case, algorithm=algorithm)
    mx.eval(out, conv_state, state)
    assert out.shape == (0, tokens, 2, 8)
    assert conv_state.shape == case.conv_state.shape and state.shape == case.state.shape


def test_default_states_are_zeros():
    case = make_segment_case(
        2,
        batch=1,
        tokens=5,
        key_heads=1,
        value_heads=2,
        key_dim=8,
        value_dim=8,
        with_conv_state=False,
        with_state=False,
    )
    zeros = make_segment_case(
        2,
        batch=1,
        tokens=5,
        key_heads=1,
        value_heads=2,
        key_dim=8,
        value_dim=8,
    )
    zeros.conv_state = mx.zeros_like(zeros.conv_state)
    zeros.state = mx.zeros_like(zeros.state)
    for a, b in zip(run(case), run(zeros)):
        assert np.array_equal(to_float64(a), to_float64(b))


def test_inputs_are_not_written():
    case = make_segment_case(
        4,
        batch=2,
        tokens=9,
        key_heads=2,
        value_heads=4,
        key_dim=8,
        value_dim=8,
        mask_kind="random",
    )
    before = [to_float64(a) for a in case.args()]
    mx.eval(run(case))
    for name, a, b in zip(
        ["mixed", "w", "decay", "dt", "norm", "conv", "state"], before, case.args()
    ):
        assert np.array_equal(a, to_float64(b)), name


@pytest.mark.parametrize("wipes", ("random", "chunk_edges", "runs"))
@given(data=st.data(), algorithm=st.sampled_from(("recurrent", "chunked")))
def test_segment_wipes_match_oracle(wipes, data, algorithm):
    # A wipe in the segment is a gate input a = +inf (g = rate * softplus(inf)
    # = -inf); drawn on purpose at chunk edges and in runs.
    case = make_segment_case(
        data.draw(st.integers(0, 2**32 - 1), label="seed"),
        batch=2,
        tokens=data.draw(st.sampled_from((63, 64, 65, 127, 128)), label="tokens"),
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        dtype=data.draw(st.sampled_from(("float32", "bfloat16")), label="dtype"),
        decay=data.draw(st.sampled_from(("model", "severe", "mixed")), label="decay"),
        mask_kind=data.draw(
            st.sampled_from(("none", "random", "left_padding", "right_padding")), label="mask"
        ),
        wipes=wipes,
        **data.draw(gate_variant_options(), label="gates"),
    )
    out, conv_state, state = run(case, algorithm=algorithm)
    expected_out, expected_conv_state, expected_state = case.reference()
    out_terms, state_terms = case.terms(algorithm)
    assert_matches(
        "out", out, expected_out, f"segment.oracle.v3.{dtype_name(out)}.output", out_terms
    )
    assert_matches("state", state, expected_state, "segment.oracle.v3.float32.state", state_terms)
    assert_matches(
        "conv_state", conv_state, expected_conv_state, "segment.oracle.v1.any.conv_state"
    )


@pytest.mark.parametrize("algorithm", ("recurrent", "chunked"))
def test_vmap_is_one_call_per_mapped_slice(algorithm):
    # Three slices of the activations and states (scaled copies), the weights
    # shared: the mapped call folds the slices into the batch.
    case = make_segment_case(
        5,
        batch=2,
        tokens=7,
        key_heads=1,
        value_heads=2,
        key_dim=8,
        value_dim=8,
        mask_kind="random",
    )
    mixed, weight, decay, dt_bias, norm, conv_state, state = case.args()
    options = {name: value for name, value in case.options.items() if name != "mask"}
    mask = case.options["mask"]
    stacked = [mx.stack([x, 0.5 * x, 0.25 * x]) for x in (mixed, conv_state, state)]
    stacked.append(mx.stack([mask, ~mask, mask]))

    def call(mixed, conv_state, state, mask):
        return gated_delta_segment(
            mixed,
            weight,
            decay,
            dt_bias,
            norm,
            conv_state,
            state,
            mask=mask,
            algorithm=algorithm,
            **options,
        )

    mapped = mx.vmap(call)(*stacked)
    for i in range(3):
        for name, got, expected in zip(
            ("out", "conv_state", "state"), mapped, call(*(x[i] for x in stacked))
        ):
            assert np.array_equal(to_float64(got[i]), to_float64(expected)), (name, i)


def test_vmap_over_the_weights_is_refused_clearly():
    case = make_segment_case(
        6, batch=1, tokens=3, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    mixed, weight, decay, dt_bias, norm, conv_state, state = case.args()

    def call(weight):
        return gated_delta_segment(
            mixed, weight, decay, dt_bias, norm, conv_state, state, **case.options
        )

    with pytest.raises(Exception) as failure:
        mx.eval(mx.vmap(call)(mx.stack([weight, weight])))
    assert "vmap" in str(failure.value) and "conv_weight" in str(failure.value)


def test_jvp_through_the_segment_raises_a_clear_error():
    # No forward mode yet: refused, never silently wrong (or zero). The
    # gradient (reverse mode) is tested in test_segment_gradients.
    case = make_segment_case(
        7, batch=1, tokens=3, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    mixed, *rest = case.args()

    def out(mixed):
        return gated_delta_segment(mixed, *rest, **case.options)[0]

    with pytest.raises(Exception) as failure:
        mx.eval(mx.jvp(out, [mixed], [mx.ones_like(mixed)]))
    assert "gated_delta_segment" in str(failure.value) and "jvp" in str(failure.value)


@given(case=segment_cases(dtypes=("float32",), variants=False), data=st.data())
def test_per_key_gates_with_equal_channels_meet_the_per_head_oracle(case, data):
    # a and dt_bias repeated over the key channels (a's columns head-major:
    # head h's Dk channels together): every channel's g is the head's, so the
    # per-key call meets the per-head call's oracle; a wrong column order of
    # a or dt_bias shows as a different decay per channel.
    o = case.options
    heads, key_dim = o["value_heads"], o["key_dim"]
    lower_bound = data.draw(st.sampled_from((None, -3.0)), label="lower_bound")
    algorithm = data.draw(st.sampled_from(("recurrent", "chunked")), label="algorithm")
    case.options = dict(o, lower_bound=lower_bound)
    mixed = case.mixed
    per_key_mixed = mx.concatenate(
        [mixed[..., :-heads], mx.repeat(mixed[..., -heads:], key_dim, axis=-1)], axis=-1
    )
    per_key_dt_bias = mx.repeat(case.dt_bias[:, None], key_dim, axis=1)
    out, conv_state, state = gated_delta_segment(
        per_key_mixed,
        case.conv_weight,
        case.decay_parameter,
        per_key_dt_bias,
        case.norm_weight,
        case.conv_state,
        case.state,
        algorithm=algorithm,
        **case.options,
    )
    expected_out, expected_conv_state, expected_state = case.reference()
    out_terms, state_terms = case.terms(algorithm)
    assert_matches("out", out, expected_out, "segment.oracle.v3.float32.output", out_terms)
    assert_matches("state", state, expected_state, "segment.oracle.v3.float32.state", state_terms)
    assert np.array_equal(to_float64(conv_state), expected_conv_state)


# MLX's CUDA backend: a key dim past the core's kernels (256) raises when the
# segment is called, naming it and the CPU; the CPU runs it.
@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend only")
def test_cuda_segment_past_the_kernels_raises_and_names_the_cpu():
    case = make_segment_case(
        2, batch=1, tokens=3, key_heads=1, value_heads=1, key_dim=257, value_dim=8
    )
    with pytest.raises(
        ValueError, match=r"gated_delta_segment on the GPU .* key dim 257 .*stream=mx\.cpu"
    ):
        run(case, stream=mx.gpu)
    mx.eval(run(case, stream=mx.cpu))
