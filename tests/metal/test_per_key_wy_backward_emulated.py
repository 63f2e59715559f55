"""The Metal chunked (WY) backward with per-key-channel gates (g [B, T, Hv,
Dk]), run by the emulator over the plan macOS encodes: the forward's chunked
stages through chunk_carry, boundary_states, chunk_output_backward (dV' and
the tile dM), per chunk from the last the recurrent reverse (chunks with a
decay that is not a normal float in some channel) and chunk_carry_backward
(the others), recompute_w_u_backward, kkt_inverse_backward (the tile dA),
channel_pairs_backward (every product decayed per channel, and the gate
scan per channel) and qk_grad_reduce; against the float64 reference vjp
under the core gradient contracts and against the CPU's per-key chunked
backward (csrc/cpu/key_chunked_backward.cpp), under the same contracts as
the scalar gates' tests (test_wy_backward_emulated.py). docs/metal.md,
backward; docs/numerics.md, "The chunked backward"."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_wy_backward_emulated import (
    CHUNK,
    GRADIENTS,
    check_against_the_cpu_chunked_backward,
    chunked_gradients,
    contract,
    dtype_of,
)

from mlx_gated_delta.reference import (
    gated_delta_rule_reference_vjp,
    to_float64,
)
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import core_cases, make_core_case
from mlx_gated_delta.tests.test_core_gradients import cotangents

import metal_emulated

# Decays that are not normal floats, set in single channels of single tokens
# (batch, token, value head, channel, g): a wipe (g = -inf, gamma = 0) or a
# subnormal decay (exp(-95)) sends that chunk of that head to the recurrent
# reverse, and the other chunks and heads stay on the WY stages. (Drawn
# wipes, one run or chunk edge per channel, would put every chunk on the
# recurrent reverse.)
WIPES = [(0, 3, 0, 5, -np.inf), (0, 70, 1, 0, -np.inf), (0, 71, 1, 9, -95.0)]
SUBNORMAL = [(0, 100, 0, 2, -95.0)]

# Every dtype, masks, both head mappings, normalize_qk, strong decays, huge
# and absent states, key dims that are not multiples of 32 (and 128), T
# across the chunk edges, beta up to 2, channel wipes and subnormal decays
# beside chunks without them.
CASES = [
    dict(batch=1, tokens=63, key_heads=1, value_heads=2, key_dim=32, value_dim=16),
    dict(
        batch=2,
        tokens=64,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
        dtype="float16",
        normalize_qk=True,
        head_mapping="interleaved",
        mask_kind="random",
    ),
    dict(
        batch=1,
        tokens=65,
        key_heads=1,
        value_heads=2,
        key_dim=24,
        value_dim=3,
        dtype="bfloat16",
        mask_kind="left_padding",
        decay="strong",
    ),
    dict(
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=17,
        value_dim=6,
        normalize_qk=True,
        state_scale="huge",
        mask_kind="right_padding",
    ),
    dict(
        batch=1,
        tokens=150,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=4,
        head_mapping="interleaved",
        decay="strong",
        with_state=False,
        beta_max=2.0,
    ),
    dict(
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        mask_kind="random",
        channel_decays=WIPES,
    ),
    dict(
        batch=1,
        tokens=150,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=4,
        dtype="float16",
        normalize_qk=True,
        channel_decays=WIPES + SUBNORMAL,
    ),
    dict(batch=1, tokens=70, key_heads=1, value_heads=1, key_dim=128, value_dim=5),
]


def per_key_case(recipe):
    """make_core_case's per-key case for `recipe`, with its `channel_decays`
    set."""
    recipe = dict(recipe)
    decays = recipe.pop("channel_decays", [])
    case = make_core_case(recipe["tokens"] + recipe["key_dim"], per_key_gates=True, **recipe)
    if not decays:
        return case
    g = np.array(case.g.astype(mx.float32))
    for b, t, h, c, value in decays:
        g[b, t, h, c] = value
    return dataclasses.replace(case, g=mx.array(g))


def recurrent_chunks(case):
    """Per (batch, chunk, value head): whether some active token's decay is
    not a normal float32 in some channel (the chunks the recurrent reverse
    takes)."""
    g = to_float64(case.g)
    mask = case.options["mask"]
    batch, tokens, heads, _ = g.shape
    active = np.ones((batch, tokens), bool) if mask is None else np.asarray(mask)
    not_normal = ~(np.exp(g.astype(np.float32)) >= np.finfo(np.float32).tiny)
    flagged = not_normal.any(axis=3) & active[:, :, None]
    chunks = -(-tokens // CHUNK)
    padded = np.zeros((batch, chunks * CHUNK, heads), bool)
    padded[:, :tokens] = flagged
    return padded.reshape(batch, chunks, CHUNK, heads).any(axis=2)


def stages_of(kernels):
    names = [name.removeprefix("gated_delta_") for name in kernels]
    return [name.rsplit("_", 1)[0] if name.endswith(("32", "16")) else name for name in names]


def check_against_the_reference(case):
    """The chunked gradients of `case` against the float64 reference vjp;
    returns them."""
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
    return grads


@pytest.mark.parametrize("recipe", CASES, ids=range(len(CASES)))
def test_per_key_chunked_backward_matches_the_float64_reference_vjp(recipe):
    case = per_key_case(recipe)
    grads = check_against_the_reference(case)
    chunks = -(-recipe["tokens"] // CHUNK)
    forward = ["qk_norm"] if recipe.get("normalize_qk") else []
    forward += ["gate_cumsum", "kkt_inverse", "recompute_w_u", "chunk_qk", "chunk_carry"]
    assert stages_of(grads["kernels"]) == (
        forward
        + ["boundary_states", "chunk_output_backward"]
        + ["chunk_states", "recurrent_chunk_backward", "chunk_carry_backward"] * chunks
        + ["recompute_w_u_backward", "kkt_inverse_backward", "channel_pairs_backward"]
        + ["qk_grad_reduce"]
    )


@settings(max_examples=5, deadline=None)
@given(case=core_cases(tokens=st.integers(8, 140), per_key_gates=True, contracting=False))
def test_per_key_chunked_backward_matches_the_reference_on_drawn_cases(case):
    # The gradients' draws of the core op's property tests (drawn wipes put
    # most chunks on the recurrent reverse).
    check_against_the_reference(case)


def test_the_channel_decay_cases_mix_both_reverses():
    # The recipes with channel wipes and subnormal decays must put some chunks
    # on each path, or they would not test the per-chunk choice.
    for recipe in CASES:
        if "channel_decays" in recipe:
            flags = recurrent_chunks(per_key_case(recipe))
            assert flags.any() and not flags.all(), flags


@pytest.mark.parametrize(
    "recipe", [r for r in CASES if r.get("dtype", "float32") == "float32"], ids=str
)
def test_per_key_chunked_backward_matches_the_cpu_chunked_backward(recipe):
    check_against_the_cpu_chunked_backward(per_key_case(recipe))


def test_chunked_and_recurrent_per_key_backwards_run_different_stages():
    # "chunked" (and auto from 8 tokens) runs the WY stages with
    # channel_pairs_backward in gate_cumsum_backward's place; "recurrent"
    # runs none of them.
    shape = dict(batch=1, tokens=130, key_heads=1, value_heads=2, key_dim=32, value_dim=8)

    def stages(**options):
        plan = metal_emulated.backward_plan(per_key_gates=True, **shape, **options)
        return plan["algorithm"], [d["stage"] for d in plan["dispatches"]]

    form, chunked = stages(algorithm="chunked")
    assert form == "chunked"
    assert chunked.count("channel_pairs_backward") == 1
    assert "gate_cumsum_backward" not in chunked
    assert chunked.count("chunk_carry_backward") == 3
    assert stages() == (form, chunked)
    form, recurrent = stages(algorithm="recurrent")
    assert form == "recurrent"
    assert recurrent == (
        ["boundary_states"] + ["chunk_states", "recurrent_chunk_backward"] * 3 + ["qk_grad_reduce"]
    )
