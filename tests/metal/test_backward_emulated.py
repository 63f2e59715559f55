"""The Metal backward's recurrent form (vjp of the core op), run by the
emulator over the plan macOS encodes (`make_backward_plan`: boundary_states, chunk_states and
recurrent_chunk_backward per chunk from the last, qk_grad_reduce), against the float64
reference vjp under the core gradient contracts and against the CPU backward.
docs/metal.md, backward; docs/numerics.md, the backward."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_rule
from mlx_gated_delta.reference import (
    gated_delta_rule_reference,
    gated_delta_rule_reference_vjp,
    to_float64,
)
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import core_cases, make_core_case
from mlx_gated_delta.tests import test_core
from mlx_gated_delta.tests.test_core_gradients import KIND, cotangents

import metal_emulated

GRADIENTS = ("q", "k", "v", "g", "beta", "state", "gamma")
CHUNK = 64

# make_core_case recipes: every dtype, scalar and per-key gates, masks, both
# head mappings, normalize_qk, wipes, huge and absent states, key dims that
# are not multiples of 32 (and 1, and the largest the plan takes, 256), fewer
# state rows than SIMD-groups, and T past one and two chunks.
CASES = [
    dict(
        batch=1,
        tokens=70,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        mask_kind="random",
        wipes="chunk_edges",
        decay="mixed",
    ),
    dict(
        batch=2,
        tokens=20,
        key_heads=2,
        value_heads=4,
        key_dim=40,
        value_dim=5,
        dtype="float16",
        normalize_qk=True,
        head_mapping="interleaved",
        wipes="random",
    ),
    dict(
        batch=1,
        tokens=65,
        key_heads=1,
        value_heads=1,
        key_dim=256,
        value_dim=3,
        dtype="bfloat16",
        normalize_qk=True,
        mask_kind="left_padding",
    ),
    dict(
        batch=1,
        tokens=67,
        key_heads=1,
        value_heads=2,
        key_dim=64,
        value_dim=9,
        per_key_gates=True,
        decay="severe",
        state_scale="huge",
        wipes="runs",
    ),
    dict(
        batch=1,
        tokens=12,
        key_heads=2,
        value_heads=4,
        key_dim=17,
        value_dim=8,
        dtype="float16",
        per_key_gates=True,
        head_mapping="interleaved",
        mask_kind="random",
        with_state=False,
    ),
    dict(
        batch=1,
        tokens=20,
        key_heads=1,
        value_heads=1,
        key_dim=1,
        value_dim=3,
        normalize_qk=True,
        beta_max=2.0,
    ),
    dict(batch=1, tokens=1, key_heads=1, value_heads=2, key_dim=16, value_dim=16),
    dict(
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=1,
        key_dim=16,
        value_dim=2,
        decay="strong",
        mask_kind="right_padding",
    ),
]


def dtype_of(case):
    return str(case.v.dtype).rsplit(".", 1)[-1]


def contract(name, dtype):
    # q, k and v come back in the activation dtype; the gates' and the
    # state's gradients are float32 (the kernels read g and beta as float32).
    kind = KIND["g" if name == "gamma" else name]
    contract_id = f"core_grad.oracle.v1.{dtype if kind == 'activation_grad' else 'float32'}.{kind}"
    return contract_id


def metal_gradients(case, wy, ws):
    # The recurrent form (auto takes the chunked one past a chunk:
    # test_wy_backward_emulated.py).
    return metal_emulated.gated_delta_rule_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, algorithm="recurrent", **case.options
    )


def check_against_the_reference(case, seed=0):
    wy, ws = cotangents(case, seed)
    grads = metal_gradients(case, wy, ws)
    expected = gated_delta_rule_reference_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, **case.options
    )
    for name in GRADIENTS:
        assert not np.isnan(grads[name]).any(), name
        assert_matches(f"d{name}", grads[name], expected[name], contract(name, dtype_of(case)))
    # Masked steps give their inputs exactly zero gradient; a wipe's dg is
    # exactly 0.
    mask = case.options["mask"]
    if mask is not None:
        skipped = ~np.asarray(mask)
        for name in ("q", "k", "v", "g", "beta", "gamma"):
            assert np.all(grads[name][skipped] == 0.0), name
    wiped = np.isneginf(to_float64(case.g))
    assert np.all(grads["g"][wiped] == 0.0)
    return grads, wy, ws


@pytest.mark.parametrize("recipe", CASES, ids=range(len(CASES)))
def test_backward_matches_the_float64_reference_vjp(recipe):
    case = make_core_case(recipe["tokens"] + recipe["key_dim"], **recipe)
    grads, _, _ = check_against_the_reference(case)
    chunks = -(-recipe["tokens"] // CHUNK)
    stages = [name.rsplit("_", 1)[0].removeprefix("gated_delta_") for name in grads["kernels"]]
    assert stages == (
        ["boundary_states"]
        + ["chunk_states", "recurrent_chunk_backward"] * chunks
        + ["qk_grad_reduce"]
    )


@pytest.mark.parametrize("recipe", [r for r in CASES if r.get("dtype", "float32") == "float32"])
def test_backward_matches_the_cpu_backward(recipe):
    # Two float32 computations of one gradient: the Metal plan and the CPU's
    # kernels (mx.vjp of the op on the CPU stream).
    case = make_core_case(recipe["tokens"] + recipe["key_dim"], **recipe)
    wy, ws = cotangents(case)
    grads = metal_gradients(case, wy, ws)
    state = case.state
    if state is None:
        state = mx.zeros((case.v.shape[0], case.v.shape[2], case.v.shape[3], case.q.shape[3]))
    inputs = [case.q, case.k, case.v, case.g, case.beta, state]

    def forward(*arrays):
        return list(gated_delta_rule(*arrays, **case.options, stream=mx.cpu))

    _, cpu = mx.vjp(forward, inputs, [wy, ws])
    for name, grad in zip(("q", "k", "v", "g", "beta", "state"), cpu):
        kind = KIND[name]
        contract_id = f"core_grad.algorithms.v1.float32.{kind}"
        assert_matches(f"d{name}", grads[name], np.array(grad), contract_id)


@settings(max_examples=6, deadline=None)
@given(
    case=st.booleans().flatmap(
        lambda per_key: core_cases(
            max_batch=1, tokens=st.integers(1, 70), per_key_gates=per_key, several_chunks=False
        )
    )
)
def test_backward_matches_the_reference_on_drawn_cases(case):
    check_against_the_reference(case)


def test_no_tokens_pass_the_state_cotangent_through():
    rng = np.random.default_rng(1)
    ws = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    zero = np.zeros((1, 0, 1, 8), np.float32)
    grads = metal_emulated.gated_delta_rule_vjp(
        zero,
        zero,
        np.zeros((1, 0, 2, 4), np.float32),
        np.zeros((1, 0, 2), np.float32),
        np.zeros((1, 0, 2), np.float32),
        rng.standard_normal((1, 2, 4, 8)).astype(np.float32),
        state_cotangent=ws,
    )
    assert grads["kernels"] == ["gated_delta_boundary_states_float32"]
    assert np.array_equal(grads["state"], ws)


def test_boundary_states_are_the_states_entering_each_chunk():
    case = make_core_case(
        5,
        batch=1,
        tokens=150,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=4,
        mask_kind="random",
        wipes="chunk_edges",
    )
    wy, ws = cotangents(case)
    result = metal_emulated.gated_delta_rule_vjp(
        *case.args(),
        y_cotangent=wy,
        state_cotangent=ws,
        through_stage="boundary_states",
        **case.options,
    )
    boundaries = np.frombuffer(result["buffers"]["boundary_states"], np.float32).reshape(
        1, 2, 3, 4, 32
    )
    _, state_terms = case.terms("recurrent")
    for chunk in range(3):
        cut = chunk * CHUNK
        mask = case.options["mask"]
        _, expected = gated_delta_rule_reference(
            case.q[:, :cut],
            case.k[:, :cut],
            case.v[:, :cut],
            case.g[:, :cut],
            case.beta[:, :cut],
            case.state,
            **{**case.options, "mask": None if mask is None else mask[:, :cut]},
        )
        assert_matches(
            f"boundary state {chunk}",
            boundaries[:, :, chunk],
            expected,
            test_core.ORACLE_STATE_CONTRACTS["recurrent"],
            terms=state_terms[:, cut],
        )


def test_the_check_sees_a_backward_that_drops_the_state_cotangent():
    # Probe: the gradients of a call whose final state's cotangent is dropped
    # (the reference vjp without it) differ from the Metal gradients beyond
    # the contracts: a backward that lost dS's seed would fail the tests above.
    # (dq does not depend on dS, and 70 tokens of decay leave the initial
    # state's gradient almost untouched by it.)
    case = make_core_case(
        2, batch=1, tokens=70, key_heads=1, value_heads=2, key_dim=32, value_dim=8
    )
    wy, ws = cotangents(case)
    grads = metal_gradients(case, wy, ws)
    wrong = gated_delta_rule_reference_vjp(*case.args(), y_cotangent=wy, **case.options)
    for name in ("k", "v", "g", "beta"):
        with pytest.raises(AssertionError, match="violated"):
            assert_matches(f"d{name}", grads[name], wrong[name], contract(name, "float32"))


def naive_norm_backward(x, c):
    """(c n^2 - x (x . c)) / n^3 in float32: the L2 norm's backward written
    directly, whose two terms cancel along x."""
    x, c = np.float32(x), np.float32(c)
    squares = np.sum(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(1e-6)
    projection = np.sum(x * c, axis=-1, keepdims=True, dtype=np.float32)
    return (c * squares - x * projection) / (squares * np.sqrt(squares))


def test_qk_grad_reduce_keeps_the_norm_gradient_along_x_in_float32():
    # Dk = 1: all of q's gradient lies along q, where (c n^2 - x (x . c))
    # keeps only c eps. With |q| about 0.3 that is 1e-5 of each term, and the
    # float32 difference loses about 5e-3 of it. qk_grad_reduce's split (the
    # part across x, and the part along x as a product) meets the float32
    # contract; the naive float32 formula does not. Large cotangents keep the
    # gradients above the contracts' absolute floor.
    case = make_core_case(
        9,
        batch=1,
        tokens=40,
        key_heads=1,
        value_heads=2,
        key_dim=1,
        value_dim=4,
        normalize_qk=True,
    )
    q = np.full((1, 40, 1, 1), 0.3, np.float32) * np.where(np.arange(40) % 2, 1, -1)[
        None, :, None, None
    ].astype(np.float32)
    wy, ws = cotangents(case)
    wy = wy * 1e3
    args = (q,) + tuple(case.args()[1:])
    through = metal_emulated.gated_delta_rule_vjp(
        *args, y_cotangent=wy, state_cotangent=ws, through_stage="qk_grad_reduce", **case.options
    )
    grads = metal_emulated.gated_delta_rule_vjp(
        *args, y_cotangent=wy, state_cotangent=ws, **case.options
    )
    expected = gated_delta_rule_reference_vjp(
        *args, y_cotangent=wy, state_cotangent=ws, **case.options
    )
    assert_matches("dq", grads["q"], expected["q"], contract("q", "float32"))
    # The same per-value-head gradients through the naive formula.
    head_grads = np.frombuffer(through["buffers"]["query_head_grad"], np.float32).reshape(
        1, 40, 2, 1
    )
    naive = naive_norm_backward(q, head_grads.sum(axis=2, keepdims=True, dtype=np.float32))
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("dq", naive, expected["q"], contract("q", "float32"))
