"""The fused segment as MLX ops around the core op: the path it takes on MLX's
CUDA backend for a call whose core has no CUDA kernels (key dims over 256;
`csrc/segment/segment_ops.cpp`).

A test hook runs every `gated_delta_segment` call of this module that way on
the CPU, and the module reruns the segment's property tests under it: the
oracle (both algorithms, masks, wipes, both decay parameterizations and head
mappings), split continuity, the skip semantics of masks, checkpoints with
their conv states, empty calls, and the gradients against finite differences of
the float64 oracle, each under the contract it has for the primitive. The
tests that count or refuse the primitive's own calls (vmap per slice, jvp) are
not rerun: the ops have MLX's rules for those, checked at the end.
"""

import io

import mlx.core as mx
import pytest

from mlx_gated_delta import _ext, gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.tests.test_checkpoints import (  # noqa: F401 (rerun here)
    test_segment_checkpoints_equal_prefix_calls,
)
from mlx_gated_delta.tests.test_segment import (  # noqa: F401 (rerun here)
    test_conv_state_comes_from_the_carried_state_when_few_tokens_are_kept,
    test_default_states_are_zeros,
    test_inputs_are_not_written,
    test_masked_token_is_an_omitted_token,
    test_segment_matches_oracle,
    test_segment_wipes_match_oracle,
    test_split_at_three_of_four_tokens_float16,
    test_split_continuity_any_split_points_chunked,
    test_split_continuity_any_split_points_recurrent,
    test_zero_tokens_return_empty_out_and_unchanged_states,
)
from mlx_gated_delta.tests.test_segment_gradients import (  # noqa: F401 (rerun here)
    test_gradients_agree_between_the_algorithms,
    test_gradients_come_back_in_each_parameters_dtype,
    test_gradients_of_an_empty_call_are_zeros_of_each_input,
    test_segment_gradients_match_finite_differences_of_the_oracle,
    test_split_gradients_equal_the_gradient_of_one_call,
)


@pytest.fixture(autouse=True)
def segment_as_ops():
    _ext.set_segment_as_ops_on_every_stream(True)
    yield
    _ext.set_segment_as_ops_on_every_stream(False)


def graph_text(*arrays):
    text = io.StringIO()
    mx.export_to_dot(text, *arrays)
    return text.getvalue()


def test_the_hook_switches_the_segment_to_ops():
    """What makes the reruns above a test of the ops: with the hook, the
    segment's graph has no segment primitive; without it, it has one."""
    case = make_segment_case(
        0, batch=1, tokens=5, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    as_ops = graph_text(*gated_delta_segment(*case.args(), **case.options))
    _ext.set_segment_as_ops_on_every_stream(False)
    primitive = graph_text(*gated_delta_segment(*case.args(), **case.options))
    assert "GatedDeltaSegment" in primitive
    assert "GatedDeltaSegment" not in as_ops
    assert "GatedDeltaRule" in as_ops


def test_vmap_over_the_weights_equals_the_calls_per_slice():
    # The primitive refuses a mapped conv weight; as ops the weight maps like
    # the activations.
    case = make_segment_case(
        6, batch=1, tokens=5, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    mixed, weight, decay, dt_bias, norm, conv_state, state = case.args()
    weights = mx.stack([weight, 0.5 * weight])

    def call(weight):
        return gated_delta_segment(
            mixed, weight, decay, dt_bias, norm, conv_state, state, **case.options
        )

    mapped = mx.vmap(call)(weights)
    for i in range(2):
        for got, expected in zip(mapped, call(weights[i])):
            assert mx.array_equal(got[i], expected).item()


def test_jvp_through_the_ops_is_refused_by_the_core_op():
    case = make_segment_case(
        7, batch=1, tokens=3, key_heads=1, value_heads=2, key_dim=8, value_dim=8
    )
    mixed, *rest = case.args()

    def out(mixed):
        return gated_delta_segment(mixed, *rest, **case.options)[0]

    with pytest.raises(Exception) as failure:
        mx.eval(mx.jvp(out, [mixed], [mx.ones_like(mixed)]))
    assert "gated_delta_rule" in str(failure.value) and "jvp" in str(failure.value)
