"""The fused layer segment's Metal plan (its own stages prepare_conv,
prepare_gates, collect_conv_state and gated_norm around the core's recurrent
or chunked stages), run by the emulator, against the float64 oracle under the
segment's contracts: both decay parameterizations, both head mappings, the
three activation dtypes, masks (skip semantics), conv kernels of 1, 2 and 4
taps, the gate variants (per-key gates, lower_bound, allow_neg_eigval, the
sigmoid output gate), split continuity of out, conv state and state, and the
plan's guards.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_gated_delta.reference import gated_delta_segment_reference, to_float64
from mlx_gated_delta.testing.contracts import assert_matches as check
from mlx_gated_delta.testing.segment_cases import (
    make_segment_case,
    segment_cases,
    segment_terms,
)

import metal_emulated

SEGMENT_STAGES = ("prepare_conv", "prepare_gates", "collect_conv_state", "gated_norm")


def emulate(case, algorithm, **overrides):
    options = {**case.options, **overrides}
    return metal_emulated.run_segment(*case.args(), algorithm=algorithm, **options)


def check_against_oracle(case, out, conv_state, state, algorithm):
    expected_out, expected_conv_state, expected_state = case.reference()
    dtype = case.recipe["dtype"]
    out_terms, state_terms = case.terms(algorithm)
    check("out", out, expected_out, f"segment.oracle.v3.{dtype}.output", out_terms)
    check("conv_state", conv_state, expected_conv_state, "segment.oracle.v1.any.conv_state")
    check("state", state, expected_state, "segment.oracle.v3.float32.state", state_terms)


# make_segment_case arguments; each runs through both core algorithms.
ORACLE_CASES = [
    dict(batch=1, tokens=5, key_heads=1, value_heads=2, key_dim=32, value_dim=16),
    dict(
        batch=2,
        tokens=9,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
        dtype="bfloat16",
        mask_kind="random",
        head_mapping="interleaved",
        decay_parameterization="negative_rate",
    ),
    dict(
        batch=2,
        tokens=70,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        dtype="float16",
        mask_kind="left_padding",
        conv1d_layout=True,
        with_conv_state=False,
    ),
    dict(
        batch=1,
        tokens=66,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=24,
        conv_kernel=2,
        mask_kind="random",
        decay_parameterization="negative_rate",
        with_state=False,
    ),
    dict(
        batch=1,
        tokens=3,
        key_heads=1,
        value_heads=1,
        key_dim=8,
        value_dim=8,
        conv_kernel=1,
        head_mapping="interleaved",
    ),
    # The Kimi Delta Attention layout: per-key gates, lower-bounded, and the
    # sigmoid output gate; then OLMo-Hybrid's beta in [0, 2].
    dict(
        batch=2,
        tokens=67,
        key_heads=2,
        value_heads=2,
        key_dim=16,
        value_dim=16,
        dtype="bfloat16",
        mask_kind="random",
        decay="mixed",
        per_key_gates=True,
        lower_bound=-5.0,
        output_gate="sigmoid",
    ),
    dict(
        batch=1,
        tokens=9,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        per_key_gates=True,
        output_gate="sigmoid",
    ),
    dict(
        batch=2,
        tokens=65,
        key_heads=1,
        value_heads=2,
        key_dim=8,
        value_dim=8,
        dtype="float16",
        mask_kind="left_padding",
        allow_neg_eigval=True,
    ),
]


@pytest.mark.parametrize("algorithm", ("recurrent", "chunked"))
@pytest.mark.parametrize("recipe", ORACLE_CASES, ids=[f"case{i}" for i in range(len(ORACLE_CASES))])
def test_segment_matches_the_float64_oracle(recipe, algorithm):
    case = make_segment_case(len(recipe) * 5 + recipe["tokens"], **recipe)
    out, conv_state, state, info = emulate(case, algorithm)
    assert info["algorithm"] == algorithm
    stages_run = [kernel for kernel in info["kernels"] if "segment_" in kernel]
    # collect_conv_state has nothing to do (no rows) with a one-tap conv.
    expected_stages = [
        s for s in SEGMENT_STAGES if s != "collect_conv_state" or recipe.get("conv_kernel", 4) > 1
    ]
    assert [k.split("segment_")[1].rsplit("_", 1)[0] for k in stages_run] == expected_stages
    assert all(k.endswith(recipe.get("dtype", "float32")) for k in stages_run)
    # The core runs on the conv's float32 output with q, k normalized.
    core_kernels = [k for k in info["kernels"] if "segment_" not in k]
    assert all(k.endswith("float32") for k in core_kernels if "gate_cumsum" not in k)
    check_against_oracle(case, out, conv_state, state, algorithm)


# The CPU op's Hypothesis strategy over the emulated kernels, on a small
# budget: every emulated call runs one OS thread per GPU thread.
@settings(max_examples=4)
@given(
    case=segment_cases(tokens=st.sampled_from((0, 1, 3, 64, 65)), variants=True),
    algorithm=st.sampled_from(("recurrent", "chunked")),
)
def test_drawn_cases_match_the_float64_oracle(case, algorithm):
    out, conv_state, state, _ = emulate(case, algorithm)
    check_against_oracle(case, out, conv_state, state, algorithm)


def split_runs(case, points, algorithm):
    """The case's tokens in consecutive emulated calls passing both states along."""
    tokens = case.mixed.shape[1]
    bounds = [0, *points, tokens]
    mask = case.options["mask"]
    conv_state, state, outs = case.conv_state, case.state, []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        options = dict(case.options, mask=None if mask is None else np.array(mask)[:, start:stop])
        out, conv_state, state = metal_emulated.gated_delta_segment(
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
    return np.concatenate(outs, axis=1), conv_state, state


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_recurrent_split_continuity_is_exact(dtype):
    # The split at 3 of 4 tokens, and more split points over
    # a masked sequence: every token sees the same numbers in the same order.
    for tokens, points, mask_kind in ((4, (3,), "none"), (12, (0, 2, 2, 7), "random")):
        case = make_segment_case(
            7,
            batch=2,
            tokens=tokens,
            key_heads=2,
            value_heads=4,
            key_dim=32,
            value_dim=16,
            dtype=dtype,
            mask_kind=mask_kind,
        )
        whole = metal_emulated.gated_delta_segment(
            *case.args(), algorithm="recurrent", dtype=dtype, **case.options
        )
        parts = split_runs(case, points, "recurrent")
        check("out", parts[0], whole[0], "segment.recurrent_split.v1.any.output")
        check("conv_state", parts[1], whole[1], "segment.recurrent_split.v1.any.conv_state")
        check("state", parts[2], whole[2], "segment.recurrent_split.v1.float32.state")


def test_chunked_split_continuity():
    case = make_segment_case(
        9,
        batch=1,
        tokens=100,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=16,
        mask_kind="random",
        head_mapping="interleaved",
    )
    whole = metal_emulated.gated_delta_segment(*case.args(), algorithm="chunked", **case.options)
    parts = split_runs(case, (30, 64), "chunked")
    out_terms, state_terms = (
        np.maximum(a, b) for a, b in zip(case.terms("chunked"), case.terms("chunked", (0, 30, 64)))
    )
    check("out", parts[0], whole[0], "segment.chunked_split.v3.float32.output", out_terms)
    check("conv_state", parts[1], whole[1], "segment.recurrent_split.v1.any.conv_state")
    check("state", parts[2], whole[2], "segment.chunked_split.v3.float32.state", state_terms)


def test_a_masked_token_is_an_omitted_token():
    # Skip semantics, checked without the oracle's own mask handling: the
    # oracle on the sequence with the masked tokens removed, including a hole
    # in the middle right after the carried conv state.
    case = make_segment_case(
        21, batch=2, tokens=10, key_heads=1, value_heads=2, key_dim=16, value_dim=8
    )
    mask = np.ones((2, 10), bool)
    mask[0, [0, 1, 5]] = False
    mask[1, 3:9] = False
    out, conv_state, state = metal_emulated.gated_delta_segment(
        *case.args(), algorithm="recurrent", **dict(case.options, mask=mask)
    )
    assert np.all(out[~mask] == 0.0)
    for b in range(2):
        kept = mask[b]
        row = lambda a: to_float64(a)[b : b + 1]  # noqa: E731
        expected = gated_delta_segment_reference(
            row(case.mixed)[:, kept],
            case.conv_weight,
            case.decay_parameter,
            case.dt_bias,
            case.norm_weight,
            row(case.conv_state),
            row(case.state),
            **dict(case.options, mask=None),
        )
        out_terms, state_terms = segment_terms(
            row(case.mixed),
            *case.args()[1:5],
            row(case.conv_state),
            row(case.state),
            algorithm="recurrent",
            **dict(case.options, mask=mask[b : b + 1]),
        )
        check(
            "kept out",
            out[b : b + 1, kept],
            expected[0],
            "segment.oracle.v3.float32.output",
            out_terms[:, kept],
        )
        check("conv_state", conv_state[b : b + 1], expected[1], "segment.oracle.v1.any.conv_state")
        check(
            "state", state[b : b + 1], expected[2], "segment.oracle.v3.float32.state", state_terms
        )


def test_zero_tokens_return_empty_out_and_unchanged_states():
    case = make_segment_case(
        1, batch=2, tokens=0, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    for algorithm in ("recurrent", "chunked"):
        out, conv_state, state, info = emulate(case, algorithm)
        assert out.shape == (2, 0, 2, 8)
        assert np.array_equal(conv_state, to_float64(case.conv_state))
        assert np.array_equal(state, to_float64(case.state))
        assert "gated_delta_segment_collect_conv_state_float32" in info["kernels"]


@pytest.mark.parametrize(
    "algorithm, mask, conv_kernel",
    [("recurrent", False, 4), ("chunked", True, 4), ("chunked", False, 1)],
)
def test_every_buffer_is_written_before_it_is_read(algorithm, mask, conv_kernel):
    # The segment plan's data flow: each dispatch reads only the call's inputs
    # or what an earlier dispatch wrote, writes no input, and the outputs are
    # all written.
    plan = metal_emulated.segment_plan(
        1, 70, 2, 4, 32, 16, conv_kernel, algorithm=algorithm, mask=mask
    )
    roles = plan["buffer_roles"]
    ready = {name for name, role in roles.items() if role == "input"}
    for dispatch in plan["dispatches"]:
        for _, buffer, written in dispatch["buffers"]:
            if written:
                assert roles[buffer] != "input", (dispatch["kernel"], buffer)
            elif buffer not in ready and plan["buffer_bytes"][buffer] > 0:
                raise AssertionError(f"{dispatch['kernel']} reads {buffer} before any write")
        ready |= {buffer for _, buffer, written in dispatch["buffers"] if written}
    outputs = {name for name, role in roles.items() if role == "output"}
    written_outputs = {name for name in outputs if plan["buffer_bytes"][name] > 0}
    assert written_outputs <= ready
    assert plan["dispatches"][0]["stage"] == "prepare_conv"
    assert plan["dispatches"][-1]["stage"] == "gated_norm"


@pytest.mark.parametrize(
    "tokens, tensor", [(1 << 20, "QKV activation elements"), (524287, "QKVZBA activation elements")]
)
def test_32_bit_extents_are_refused_before_any_launch(tokens, tensor):
    # Qwen3-Next's heads: C = 8192 conv channels, F = 12352 packed columns.
    # 524287 * 8192 fits 32 bits, 524287 * 12352 does not.
    with pytest.raises(ValueError, match=tensor):
        metal_emulated.segment_plan(1, tokens, 16, 32, 128, 128, 4, dtype="bfloat16")


def test_the_emulator_rejects_inputs_of_the_wrong_size():
    case = make_segment_case(
        2, batch=1, tokens=3, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    with pytest.raises(ValueError, match="norm_weight"):
        metal_emulated.gated_delta_segment(
            case.mixed,
            case.conv_weight,
            case.decay_parameter,
            case.dt_bias,
            np.ones(7, np.float32),
            **case.options,
        )
