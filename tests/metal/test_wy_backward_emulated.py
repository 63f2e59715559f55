"""The Metal chunked (WY) backward, run by the emulator over the plan macOS
encodes (`make_backward_plan` with the chunked form: the forward's chunked
stages through chunk_carry, boundary_states, chunk_output_backward, per chunk
from the last chunk_states and recurrent_chunk_backward (chunks with a wipe) and
chunk_carry_backward (the others), then recompute_w_u_backward,
kkt_inverse_backward, gate_cumsum_backward and qk_grad_reduce), against the
float64 reference vjp under the core gradient contracts and against the CPU's
chunked backward. docs/metal.md, backward; docs/numerics.md, "The chunked
backward"."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import gated_delta_rule
from mlx_gated_delta.reference import (
    gated_delta_rule_reference_vjp,
    gated_delta_update_reference_vjp,
    to_float64,
)
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import make_core_case, tiny_decay_gamma
from mlx_gated_delta.tests.test_core_gradients import KIND, cotangents

import metal_emulated

GRADIENTS = ("q", "k", "v", "g", "beta", "state", "gamma")
CHUNK = 64

# Scalar gates (per-key gates: test_per_key_wy_backward_emulated.py): every dtype,
# masks, both head mappings, normalize_qk, wipes (chunks that go to the
# recurrent reverse beside chunks that do not; subnormal decays), huge and
# absent states, key
# dims that are not multiples of 32, T across the chunk edges.
CASES = [
    dict(batch=1, tokens=1, key_heads=1, value_heads=2, key_dim=16, value_dim=16),
    dict(
        batch=2,
        tokens=63,
        key_heads=2,
        value_heads=4,
        key_dim=40,
        value_dim=5,
        dtype="float16",
        normalize_qk=True,
        head_mapping="interleaved",
        mask_kind="random",
    ),
    dict(
        batch=1,
        tokens=64,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        dtype="bfloat16",
        mask_kind="left_padding",
        decay="strong",
    ),
    dict(
        batch=1,
        tokens=65,
        key_heads=1,
        value_heads=1,
        key_dim=24,
        value_dim=3,
        normalize_qk=True,
        state_scale="huge",
    ),
    dict(
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        mask_kind="random",
        wipes="chunk_edges",
    ),
    dict(
        batch=1,
        tokens=130,
        key_heads=2,
        value_heads=4,
        key_dim=17,
        value_dim=6,
        head_mapping="interleaved",
        decay="strong",
        mask_kind="right_padding",
        with_state=False,
    ),
    dict(
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=4,
        dtype="float16",
        wipes="runs",
        beta_max=2.0,
    ),
    # Severe decays between near-1 ones: subnormal decays send chunks to the
    # recurrent reverse without a wipe.
    dict(
        batch=1,
        tokens=70,
        key_heads=1,
        value_heads=2,
        key_dim=8,
        value_dim=4,
        decay="mixed",
        normalize_qk=True,
    ),
]


def dtype_of(case):
    return str(case.v.dtype).rsplit(".", 1)[-1]


def contract(name, dtype, family="oracle"):
    kind = KIND["g" if name == "gamma" else name]
    precision = dtype if kind == "activation_grad" else "float32"
    contract_id = f"core_grad.{family}.v1.{precision}.{kind}"
    return contract_id


def chunked_gradients(case, wy, ws):
    return metal_emulated.gated_delta_rule_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, algorithm="chunked", **case.options
    )


def wiped_chunks(case):
    """Per (batch, chunk, value head): whether some active token's decay is
    not a normal float32 (the chunks the recurrent reverse takes)."""
    g = to_float64(case.g)
    mask = case.options["mask"]
    batch, tokens, heads = g.shape
    active = np.ones((batch, tokens), bool) if mask is None else np.asarray(mask)
    not_normal = ~(np.exp(g.astype(np.float32)) >= np.finfo(np.float32).tiny)
    flagged = not_normal & active[:, :, None]
    chunks = -(-tokens // CHUNK)
    padded = np.zeros((batch, chunks * CHUNK, heads), bool)
    padded[:, :tokens] = flagged
    return padded.reshape(batch, chunks, CHUNK, heads).any(axis=2)


@pytest.mark.parametrize("recipe", CASES, ids=range(len(CASES)))
def test_chunked_backward_matches_the_float64_reference_vjp(recipe):
    case = make_core_case(recipe["tokens"] + recipe["key_dim"], **recipe)
    wy, ws = cotangents(case, 0)
    grads = chunked_gradients(case, wy, ws)
    expected = gated_delta_rule_reference_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, **case.options
    )
    for name in GRADIENTS:
        assert not np.isnan(grads[name]).any(), name
        assert_matches(f"d{name}", grads[name], expected[name], contract(name, dtype_of(case)))
    mask = case.options["mask"]
    if mask is not None:
        skipped = ~np.asarray(mask)
        for name in ("q", "k", "v", "g", "beta", "gamma"):
            assert np.all(grads[name][skipped] == 0.0), name
    assert np.all(grads["g"][np.isneginf(to_float64(case.g))] == 0.0)

    chunks = -(-recipe["tokens"] // CHUNK)
    stages = [name.removeprefix("gated_delta_") for name in grads["kernels"]]
    stages = [name.rsplit("_", 1)[0] if name.endswith(("32", "16")) else name for name in stages]
    forward = ["qk_norm"] if recipe.get("normalize_qk") else []
    forward += ["gate_cumsum", "kkt_inverse", "recompute_w_u", "chunk_qk", "chunk_carry"]
    assert stages == (
        forward
        + ["boundary_states", "chunk_output_backward"]
        + ["chunk_states", "recurrent_chunk_backward", "chunk_carry_backward"] * chunks
        + ["recompute_w_u_backward", "kkt_inverse_backward", "gate_cumsum_backward"]
        + ["qk_grad_reduce"]
    )


def test_the_wipe_cases_mix_both_reverses():
    # The wipe recipes above must put some chunks on each path, or they would
    # not test the per-chunk choice.
    for recipe in (CASES[4], CASES[6]):
        case = make_core_case(recipe["tokens"] + recipe["key_dim"], **recipe)
        flags = wiped_chunks(case)
        assert flags.any() and not flags.all(), flags


@pytest.mark.parametrize(
    "recipe", [r for r in CASES if r.get("dtype", "float32") == "float32"], ids=str
)
def test_chunked_backward_matches_the_cpu_chunked_backward(recipe):
    check_against_the_cpu_chunked_backward(
        make_core_case(recipe["tokens"] + recipe["key_dim"], **recipe)
    )


def check_against_the_cpu_chunked_backward(case):
    # Two float32 computations of one gradient in the same form: the Metal
    # plan and the CPU's chunked backward, scalar or per-key gates as the
    # case has them (mx.vjp of the op on the CPU stream).
    wy, ws = cotangents(case)
    grads = chunked_gradients(case, wy, ws)
    state = case.state
    if state is None:
        state = mx.zeros((case.v.shape[0], case.v.shape[2], case.v.shape[3], case.q.shape[3]))
    inputs = [case.q, case.k, case.v, case.g, case.beta, state]

    def forward(*arrays):
        return list(gated_delta_rule(*arrays, **case.options, algorithm="chunked", stream=mx.cpu))

    _, cpu = mx.vjp(forward, inputs, [wy, ws])
    for name, grad in zip(("q", "k", "v", "g", "beta", "state"), cpu):
        assert_matches(
            f"d{name}", grads[name], np.array(grad), contract(name, "float32", "algorithms")
        )


def test_the_linear_decay_gradient_matches_the_reference():
    # gated_delta_update's gamma = exp(g): dgamma from gate_cumsum_backward's
    # scan of the decay terms on the chunks the WY stages take, exact from
    # the recurrent reverse where gamma == 0.
    recipe = dict(
        batch=1, tokens=130, key_heads=1, value_heads=2, key_dim=16, value_dim=4, wipes="runs"
    )
    case = make_core_case(7, **recipe)
    wy, ws = cotangents(case, 3)
    grads = chunked_gradients(case, wy, ws)
    expected = gated_delta_rule_reference_vjp(
        *case.args(), y_cotangent=wy, state_cotangent=ws, **case.options
    )
    assert np.isneginf(to_float64(case.g)).any()
    assert np.isfinite(grads["gamma"]).all()
    assert_matches("dgamma", grads["gamma"], expected["gamma"], contract("gamma", "float32"))


# (tokens, dtype, the fraction of tiny decays, seed): the draws of
# test_tiny_decays_give_gamma_its_gradient_through_the_chunked_backward
# (mlx_gated_delta/tests/test_core_gradients.py), fixed, for the emulator.
TINY_DECAY_CASES = [
    (64, "float32", 1.0, 0),
    (130, "float32", 0.5, 1),
    (150, "bfloat16", 0.1, 2),
    (65, "float32", 0.1, 3),
]


@pytest.mark.parametrize("per_key_gates", [False, True], ids=["scalar", "per_key"])
@pytest.mark.parametrize("tokens, dtype, tiny_fraction, seed", TINY_DECAY_CASES)
def test_tiny_decays_give_gamma_its_gradient(tokens, dtype, tiny_fraction, seed, per_key_gates):
    # gated_delta_update's gamma (one per key channel with per-key gates)
    # where it is a normal float but tiny, exp(-87) to exp(-8): every chunk
    # runs the WY stages, and gamma's gradient is the sum of the decay terms
    # that pass the token, each without gamma itself (gate_cumsum_backward's
    # scan, or channel_pairs_backward's per channel). As dg / gamma it would
    # be dg's rounding (that of terms far larger than dg) divided by a tiny
    # gamma.
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
    gamma32 = np.asarray(gamma.astype(mx.float32))
    wy, ws = cotangents(case)
    expected = gated_delta_update_reference_vjp(
        case.q, case.k, case.v, gamma, case.beta, case.state, y_cotangent=wy, state_cotangent=ws
    )
    # The op's g: log(gamma) in float32 (mlx_gated_delta/ops.py).
    grads = metal_emulated.gated_delta_rule_vjp(
        case.q,
        case.k,
        case.v,
        np.log(gamma32),
        case.beta,
        case.state,
        y_cotangent=wy,
        state_cotangent=ws,
        scale=1.0,
        algorithm="chunked",
    )
    # The scan that gives gamma its gradient (gate_cumsum_backward reads
    # float32 terms alone, so it has no dtype in its name).
    scan = (
        f"gated_delta_channel_pairs_backward_{dtype}"
        if per_key_gates
        else "gated_delta_gate_cumsum_backward"
    )
    assert scan in grads["kernels"]
    for name in ("q", "k", "v", "gamma", "beta", "state"):
        assert_matches(f"d{name}", grads[name], expected[name], contract(name, dtype))


def test_auto_takes_the_chunked_form_from_8_tokens_with_either_gates():
    def form(tokens, per_key_gates=False, algorithm="auto"):
        plan = metal_emulated.backward_plan(
            1, tokens, 1, 2, 32, 8, per_key_gates=per_key_gates, algorithm=algorithm
        )
        return plan["algorithm"]

    assert form(7) == "recurrent"
    assert form(8) == "chunked"
    assert form(8192) == "chunked"
    assert form(7, per_key_gates=True) == "recurrent"
    assert form(8, per_key_gates=True) == "chunked"
    assert form(8192, per_key_gates=True) == "chunked"
    assert form(1, per_key_gates=True, algorithm="chunked") == "chunked"
    assert form(8192, per_key_gates=True, algorithm="recurrent") == "recurrent"
    assert form(1, algorithm="chunked") == "chunked"
    assert form(8192, algorithm="recurrent") == "recurrent"


def test_no_tokens_pass_the_state_cotangent_through_the_chunked_plan():
    rng = np.random.default_rng(2)
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
        algorithm="chunked",
    )
    assert grads["kernels"] == [
        "gated_delta_chunk_carry_float32",
        "gated_delta_boundary_states_float32",
    ]
    assert np.array_equal(grads["state"], ws)
