"""The fused layer segment (docs/contract.md): the errors for bad input and
the checks tied to the CPU stream. Its property tests (oracle agreement, split
continuity, masks, T == 0) are shipped in mlx_gated_delta/tests/test_segment.py,
so that `python -m mlx_gated_delta selftest` runs them too."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import _ext, gated_delta_segment, thread_count
from mlx_gated_delta.testing.segment_cases import (
    MASK_KINDS,
    WIPE_KINDS,
    gate_variant_options,
    make_segment_case,
)
from mlx_gated_delta.testing.strategies import budget
from mlx_gated_delta.tests.test_checkpoints import checkpoint_positions
from mlx_gated_delta.tests.test_core import assert_bitwise_equal
from mlx_gated_delta.tests.test_segment import run
from mlx_gated_delta.tests.test_segment_gradients import cotangents, segment_gradients

# ---------------------------------------------------------------------------
# Bad input: a clear error naming the argument, at graph construction.
# ---------------------------------------------------------------------------

HEADS = dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8)
# C = 2*2*8 + 4*8 = 64 conv channels, F = 64 + 32 + 8 = 104.


def good_args(batch=1, tokens=3, kernel=4, dtype=mx.float32):
    return dict(
        mixed_qkvzba=mx.zeros((batch, tokens, 104), dtype=dtype),
        conv_weight=mx.zeros((64, kernel)),
        decay_parameter=mx.zeros((4,)),
        dt_bias=mx.zeros((4,)),
        norm_weight=mx.ones((8,)),
    )


def test_good_arguments_pass():
    out, conv_state, state = gated_delta_segment(**good_args(), **HEADS)
    assert out.shape == (1, 3, 4, 8)
    assert conv_state.shape == (1, 3, 64)
    assert state.shape == (1, 4, 8, 8)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(mixed_qkvzba=mx.zeros((3, 104))), ValueError, ["mixed_qkvzba", "rank 3"]),
        (
            dict(mixed_qkvzba=mx.zeros((1, 3, 100))),
            ValueError,
            ["mixed_qkvzba", "104", "(1, 3, 100)"],
        ),
        (
            dict(mixed_qkvzba=mx.zeros((1, 3, 104), dtype=mx.int32)),
            TypeError,
            ["mixed_qkvzba", "int32"],
        ),
        (dict(conv_weight=mx.zeros((63, 4))), ValueError, ["conv_weight", "(63, 4)"]),
        (dict(conv_weight=mx.zeros((64, 4, 2))), ValueError, ["conv_weight", "(64, 4, 2)"]),
        (dict(decay_parameter=mx.zeros((3,))), ValueError, ["decay_parameter", "(3,)"]),
        (dict(dt_bias=mx.zeros((4, 1))), ValueError, ["dt_bias", "(4, 1)"]),
        (dict(norm_weight=mx.zeros((4,))), ValueError, ["norm_weight", "(8,)"]),
        (
            dict(conv_state=mx.zeros((1, 2, 64))),
            ValueError,
            ["conv_state", "(1, 3, 64)", "(1, 2, 64)"],
        ),
        (
            dict(conv_state=mx.zeros((1, 3, 64), dtype=mx.float16)),
            TypeError,
            ["conv_state", "float16"],
        ),
        (dict(state=mx.zeros((1, 4, 8, 4))), ValueError, ["state", "(1, 4, 8, 8)"]),
        (
            dict(state=mx.zeros((1, 4, 8, 8), dtype=mx.bfloat16)),
            TypeError,
            ["state", "float32", "bfloat16"],
        ),
        (dict(mask=mx.ones((1, 4), dtype=mx.bool_)), ValueError, ["mask", "(1, 3)"]),
        (dict(mask=mx.ones((1, 3))), TypeError, ["mask", "bool"]),
        (dict(head_mapping="tiled"), ValueError, ["head_mapping", "tiled"]),
        (dict(algorithm="fast"), ValueError, ["algorithm", "fast"]),
        (dict(decay_parameterization="rate"), ValueError, ["decay_parameterization", "rate"]),
        (dict(key_heads=3), ValueError, ["value_heads", "key_heads"]),
        (dict(key_dim=0), ValueError, ["key_dim"]),
        (dict(norm_eps=-1.0), ValueError, ["norm_eps"]),
        (dict(mixed_qkvzba=np.zeros((1, 3, 104))), TypeError, ["mixed_qkvzba"]),
        # Per-key gates: dt_bias [Hv, Dk] makes a Hv*Dk wide, F = 104 - 4 + 32.
        (dict(dt_bias=mx.zeros((4, 8))), ValueError, ["mixed_qkvzba", "132", "Hv*Dk"]),
        (dict(dt_bias=mx.zeros((4, 8, 1))), ValueError, ["dt_bias", "(4, 8, 1)"]),
        (dict(lower_bound=0.5), ValueError, ["lower_bound", "0.5"]),
        (dict(lower_bound=float("nan")), ValueError, ["lower_bound"]),
        (dict(output_gate="relu"), ValueError, ["output_gate", "relu"]),
        (dict(output_gate=1), TypeError, ["output_gate"]),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(change, error, words):
    arguments = dict(good_args(), **HEADS)
    arguments.update(change)
    with pytest.raises(error) as raised:
        gated_delta_segment(**arguments)
    message = str(raised.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_huge_lazy_input_is_rejected_before_allocation():
    # 2^20 tokens of a 4608-wide packed row: over 2^32 elements. mx.zeros is
    # lazy, so nothing is allocated unless the op evaluates it.
    heads = dict(key_heads=16, value_heads=32, key_dim=64, value_dim=64)
    width = 2 * 16 * 64 + 2 * 32 * 64 + 2 * 32
    with pytest.raises(ValueError, match="elements"):
        gated_delta_segment(
            mx.zeros((1, 2**20, width)),
            mx.zeros((2 * 16 * 64 + 32 * 64, 4)),
            mx.zeros((32,)),
            mx.zeros((32,)),
            mx.ones((64,)),
            **heads,
        )


def test_segment_under_compile_and_on_another_stream_gives_the_same_result():
    case = make_segment_case(
        5,
        batch=2,
        tokens=9,
        key_heads=2,
        value_heads=4,
        key_dim=8,
        value_dim=8,
        mask_kind="random",
    )
    expected = run(case)

    def segment(*args):
        return gated_delta_segment(*args, **case.options)

    compiled = mx.compile(segment)(*case.args())
    streamed = run(case, stream=mx.new_stream(mx.cpu))
    for a, b, c in zip(expected, compiled, streamed):
        assert mx.array_equal(a, b) and mx.array_equal(a, c)


def test_per_key_gates_take_a_per_key_packed_row():
    # F = 64 + 32 + 4 + 4*8: dt_bias [Hv, Dk] and a per key channel.
    arguments = dict(good_args(), **HEADS)
    arguments.update(mixed_qkvzba=mx.zeros((1, 3, 132)), dt_bias=mx.zeros((4, 8)))
    out, conv_state, state = gated_delta_segment(**arguments, lower_bound=-5.0)
    assert out.shape == (1, 3, 4, 8) and state.shape == (1, 4, 8, 8)


# ---------------------------------------------------------------------------
# The CPU segment in waves of key heads (csrc/cpu/segment.h): its stages run
# for a few key heads and the value heads that read them at a time, so that
# the float32 scratch is one wave's. Every stage is per head or per channel,
# so a call in several waves gives one wave's bits. A wave holds up to 32 MiB
# of scratch, so only long calls run in several; the test hook shrinks that
# budget so that small drawn calls do.
# ---------------------------------------------------------------------------


def segment_with_gradients(case, positions, algorithm):
    """The forward with checkpoints, then every input's gradient, on the CPU."""
    forward = gated_delta_segment(
        *case.args(), algorithm=algorithm, checkpoints=positions, stream=mx.cpu, **case.options
    )
    gradients = segment_gradients(case, cotangents(case), algorithm=algorithm)
    mx.eval(forward, gradients)
    return forward, gradients


@budget(15)
@given(data=st.data(), algorithm=st.sampled_from(("recurrent", "chunked")))
def test_segment_in_several_waves_equals_one_wave(data, algorithm):
    ratio = data.draw(st.sampled_from((1, 2)), label="ratio")
    batch = data.draw(st.integers(1, 2), label="batch")
    # The fewest key heads a wave takes (one (batch row, key head) pair per
    # thread), three times over: three waves when the budget fits nothing.
    per_thread = -(-thread_count() // batch)
    key_heads = 3 * per_thread
    tokens = data.draw(st.integers(1, 70), label="tokens")
    case = make_segment_case(
        data.draw(st.integers(0, 2**32 - 1), label="seed"),
        batch=batch,
        tokens=tokens,
        key_heads=key_heads,
        value_heads=key_heads * ratio,
        key_dim=8,
        value_dim=8,
        dtype=data.draw(st.sampled_from(("float32", "float16", "bfloat16")), label="dtype"),
        mask_kind=data.draw(st.sampled_from(MASK_KINDS), label="mask"),
        wipes=data.draw(st.sampled_from(WIPE_KINDS), label="wipes"),
        with_state=data.draw(st.booleans(), label="with_state"),
        **data.draw(gate_variant_options(), label="gates"),
    )
    positions = data.draw(checkpoint_positions(tokens), label="checkpoints")
    shape = (batch, tokens, key_heads, key_heads * ratio, 8, 8)

    assert _ext.segment_wave_key_heads(*shape) == key_heads
    one_wave = segment_with_gradients(case, positions, algorithm)
    before = _ext.exchange_segment_wave_bytes(1)
    try:
        assert _ext.segment_wave_key_heads(*shape) == per_thread
        waves = segment_with_gradients(case, positions, algorithm)
    finally:
        _ext.exchange_segment_wave_bytes(before)

    names = ("out", "conv_state", "state", "conv_checkpoints", "checkpoints")
    for name, actual, expected in zip(names, waves[0], one_wave[0]):
        assert_bitwise_equal(name, actual, expected)
    for name, expected in one_wave[1].items():
        actual = waves[1][name]
        if name != "norm_weight":
            assert_bitwise_equal(f"d {name}", actual, expected)
        elif batch == 1:
            # d norm_weight sums each thread's terms in float64, wave by wave
            # instead of token by token: the same terms in another order, so
            # the float32 result may round to the next float32 on either side.
            expected = np.array(expected)
            steps = np.abs(np.nextafter(expected, np.inf, dtype=np.float32) - expected)
            assert np.all(np.abs(np.array(actual) - expected) <= steps), "d norm_weight"
        # With batch 2 the rows' float32 values are added after rounding: a
        # step in one row moves the sum by a step of the row, which a step of
        # the sum does not bound, so only the other gradients are compared.
