"""The fused layer segment (docs/contract.md): the errors for bad input and
the checks tied to the CPU stream. Its property tests (oracle agreement, split
continuity, masks, T == 0) are shipped in mlx_gated_delta/tests/test_segment.py,
so that `python -m mlx_gated_delta selftest` runs them too."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.tests.test_segment import run

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
