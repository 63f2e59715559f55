"""Per-key-channel gates (g [B, T, Hv, Dk]) on the Metal chunked stages, run
by the emulator over the plans macOS encodes, against the float64 oracle
under the core op's chunked contracts: the decayed grams are built in
sub-chunks of 16 rows, as products of factors relative to each sub-chunk's
first row left of its diagonal block and pair by pair inside it, and a
channel's wipe is decided by position (docs/numerics.md, "Per-key-channel
gates in the chunked form")."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_gated_delta import reference
from mlx_gated_delta.reference import gated_delta_rule_reference, to_float64
from mlx_gated_delta.testing.contracts import assert_matches
from mlx_gated_delta.testing.strategies import core_cases, make_core_case
from mlx_gated_delta.tests import test_core
from mlx_gated_delta.tests.test_per_key import PER_KEY_VS_SCALAR

import metal_emulated

OUTPUT_CONTRACTS = test_core.ORACLE_OUTPUT_CONTRACTS
STATE_CONTRACTS = test_core.ORACLE_STATE_CONTRACTS
CHUNKED_STAGES = ("gate_cumsum", "kkt_inverse", "recompute_w_u", "chunk_qk", "chunk_carry")


def dtype_of(case):
    return str(case.v.dtype).rsplit(".", 1)[-1]


def run_chunked(case, **overrides):
    options = {**case.options, **overrides}
    y, state, info = metal_emulated.run(*case.args(), algorithm="chunked", **options)
    assert info["algorithm"] == "chunked"
    assert all(any(stage in name for name in info["kernels"]) for stage in CHUNKED_STAGES)
    return y, state


def assert_matches_oracle(case, y, state):
    assert np.isfinite(y).all() and np.isfinite(state).all()
    test_core.assert_matches_oracle(case, y, state, "chunked")


# Chunk edges (63, 64, 65, 128, 130 tokens), masks, both mappings, the three
# activation dtypes, normalize_qk, Dk past one staging tile and the widest
# chunked key dim, channel wipes at chunk edges and in runs, strong decays.
CASES = [
    dict(batch=1, tokens=63, key_heads=1, value_heads=2, key_dim=32, value_dim=16),
    dict(
        batch=2,
        tokens=64,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
        mask_kind="random",
        head_mapping="interleaved",
        wipes="chunk_edges",
    ),
    dict(
        batch=1,
        tokens=65,
        key_heads=1,
        value_heads=2,
        key_dim=24,
        value_dim=8,
        dtype="float16",
        normalize_qk=True,
        decay="severe",
        wipes="random",
    ),
    dict(
        batch=1,
        tokens=128,
        key_heads=2,
        value_heads=4,
        key_dim=128,
        value_dim=8,
        dtype="bfloat16",
        mask_kind="left_padding",
        head_mapping="interleaved",
        decay="mixed",
        wipes="chunk_edges",
    ),
    dict(
        batch=2,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=17,
        value_dim=16,
        mask_kind="right_padding",
        normalize_qk=True,
        decay="strong",
        wipes="runs",
        with_state=False,
    ),
    dict(
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=1,
        key_dim=256,
        value_dim=4,
        decay="mixed",
        wipes="chunk_edges",
    ),
]


@pytest.mark.parametrize("recipe", CASES, ids=[f"T{r['tokens']}-Dk{r['key_dim']}" for r in CASES])
def test_per_key_chunked_plan_matches_the_oracle(recipe):
    case = make_core_case(recipe["tokens"] + recipe["key_dim"], per_key_gates=True, **recipe)
    assert_matches_oracle(case, *run_chunked(case))


@settings(max_examples=10, deadline=None)
@given(
    case=core_cases(
        tokens=st.sampled_from((1, 5, 63, 64, 65, 100, 128, 130)),
        per_key_gates=True,
        several_chunks=False,
    )
)
def test_per_key_chunked_plan_matches_the_oracle_on_drawn_cases(case):
    assert_matches_oracle(case, *run_chunked(case))


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_channel_wipes_at_chunk_edges_match_the_oracle(data):
    # g = -inf on single channels, at chunk edges and in runs: that column of
    # the state is wiped exactly, the others decay on; from unit and huge
    # entry states.
    case = make_core_case(
        data.draw(st.integers(0, 2**32 - 1)),
        batch=data.draw(st.integers(1, 2)),
        tokens=data.draw(st.sampled_from(test_core.EDGE_TOKENS)),
        key_heads=1,
        value_heads=data.draw(st.sampled_from((1, 2))),
        key_dim=data.draw(st.sampled_from((16, 32))),
        value_dim=data.draw(st.sampled_from((8, 16))),
        dtype=data.draw(st.sampled_from(("float32", "bfloat16"))),
        decay=data.draw(st.sampled_from(("model", "severe", "mixed", "none"))),
        mask_kind=data.draw(st.sampled_from(("none", "random", "left_padding"))),
        head_mapping=data.draw(st.sampled_from(("grouped", "interleaved"))),
        wipes=data.draw(st.sampled_from(("chunk_edges", "runs", "random"))),
        state_scale=data.draw(st.sampled_from(("unit", "huge"))),
        per_key_gates=True,
    )
    assert_matches_oracle(case, *run_chunked(case))


def run_chunked_in_calls(case, bounds):
    """The tokens of a case in consecutive chunked calls [bounds[i],
    bounds[i+1]), each passing its state to the next: (y, final state)."""
    q, k, v, g, beta, state = case.args()
    mask = case.options["mask"]
    pieces = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        y, state, info = metal_emulated.run(
            *(x[:, start:stop] for x in (q, k, v, g, beta)),
            state,
            algorithm="chunked",
            **{**case.options, "mask": None if mask is None else mask[:, start:stop]},
        )
        assert info["algorithm"] == "chunked"
        pieces.append(y)
    return np.concatenate(pieces, axis=1), state


@settings(max_examples=8, deadline=None)
@given(
    case=core_cases(
        dtypes=("float32",),
        tokens=st.sampled_from((65, 100, 128, 130, 150)),
        per_key_gates=True,
        several_chunks=False,
    ),
    data=st.data(),
)
def test_per_key_chunked_plan_in_calls_matches_one_call(case, data):
    # Split points anywhere (chunk- and sub-chunk-unaligned): each call's
    # chunks and sub-chunks start at its own first token.
    tokens = case.q.shape[1]
    points = data.draw(st.lists(st.integers(1, tokens - 1), min_size=1, max_size=3, unique=True))
    bounds = [0, *sorted(points), tokens]
    full_y, full_state = run_chunked(case)
    split_y, split_state = run_chunked_in_calls(case, bounds)
    output_terms, state_terms = test_core.split_terms(case, bounds)
    output_contract, state_contract = test_core.SPLIT_CONTRACTS["chunked"]
    assert_matches("y", split_y, full_y, output_contract, terms=output_terms)
    assert_matches("state", split_state, full_state, state_contract, terms=state_terms)


@pytest.mark.parametrize("strong_g", (-60.0, -200.0, -300.0))
def test_strong_channel_decays_next_to_weak_ones_stay_exact(strong_g):
    # Half the channels decay by exp(strong_g) per token, the others barely.
    # At -60 (a decay of 9e-27, not a wipe) a strong channel's cumulative log
    # decay reaches -3840 over a chunk, so a form that factored each decay as
    # exp(G_i) / exp(G_j) from the chunk's start would form exp(+3840) = inf
    # and NaN, and one with factors relative to a row past j's, exp(+60) per
    # step between them. At -200 and -300 every step's decay underflows
    # float32: a wipe per step.
    case = make_core_case(
        3,
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=16,
        decay="mild",
        per_key_gates=True,
    )
    strong = np.arange(32) % 2 == 0
    g = np.where(strong, strong_g, to_float64(case.g)).astype(np.float32)
    case = dataclasses.replace(case, g=mx.array(g))
    assert_matches_oracle(case, *run_chunked(case))


@settings(max_examples=8, deadline=None)
@given(
    case=core_cases(
        dtypes=("float32",), tokens=st.sampled_from((63, 64, 65, 128, 130)), several_chunks=False
    )
)
def test_equal_channels_give_the_scalar_gate_result(case):
    # A g whose Dk channels all equal the scalar g is the same recurrence: the
    # per-key chunked stages agree with the scalar ones within
    # core.per_key_vs_scalar (two float32 errors; they round differently).
    scalar_y, scalar_state, _ = metal_emulated.run(
        *case.args(), algorithm="chunked", **case.options
    )
    per_key_g = np.repeat(to_float64(case.g)[..., None], case.q.shape[3], axis=-1)
    per_key_y, per_key_state, info = metal_emulated.run(
        case.q,
        case.k,
        case.v,
        per_key_g.astype(np.float32),
        case.beta,
        case.state,
        algorithm="chunked",
        **case.options,
    )
    assert info["algorithm"] == "chunked"
    output_terms, state_terms = test_core.oracle_terms(case, "chunked")
    assert_matches("y", per_key_y, scalar_y, PER_KEY_VS_SCALAR["output"], terms=output_terms)
    assert_matches(
        "state", per_key_state, scalar_state, PER_KEY_VS_SCALAR["state"], terms=state_terms
    )


def test_the_check_sees_a_kernel_that_reads_one_decay_per_head():
    # Probe: the chunked per-key result differs, beyond the contract, from the
    # oracle of the same call whose gate is channel 0's for every column: a
    # stage reading one decay per head (mlx-lm#1792's bug) would fail the
    # oracle comparisons above.
    case = make_core_case(
        7,
        batch=1,
        tokens=100,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        decay="model",
        per_key_gates=True,
    )
    y, state = run_chunked(case)
    channel_0 = np.repeat(to_float64(case.g)[..., :1], case.q.shape[3], axis=-1)
    wrong_y, wrong_state = gated_delta_rule_reference(
        case.q, case.k, case.v, channel_0, case.beta, case.state, **case.options
    )
    output_terms, state_terms = test_core.oracle_terms(case, "chunked")
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("y", y, wrong_y, OUTPUT_CONTRACTS["chunked", "float32"], terms=output_terms)
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("state", state, wrong_state, STATE_CONTRACTS["chunked"], terms=state_terms)


def test_a_huge_entry_state_beside_severe_channels():
    # The CPU's case (mlx_gated_delta/tests/test_per_key.py) on the Metal chunked stages: the
    # 1e18 entry state passes through terms far larger than the final state,
    # and the chunked contract measures against them (docs/numerics.md).
    case = make_core_case(
        1346239734,
        batch=1,
        tokens=127,
        key_heads=1,
        value_heads=1,
        key_dim=32,
        value_dim=16,
        decay="mixed",
        wipes="chunk_edges",
        state_scale="huge",
        per_key_gates=True,
    )
    assert_matches_oracle(case, *run_chunked(case))


def test_checkpoints_of_the_per_key_chunked_plan_are_the_prefix_states():
    # chunk_carry's checkpoint cut decays each state column by its own channel.
    case = make_core_case(
        11,
        batch=1,
        tokens=130,
        key_heads=1,
        value_heads=2,
        key_dim=32,
        value_dim=8,
        decay="mixed",
        wipes="random",
        per_key_gates=True,
    )
    points = [1, 63, 64, 100, 130]
    _, _, info = metal_emulated.run(
        *case.args(), algorithm="chunked", checkpoints=points, **case.options
    )
    assert info["algorithm"] == "chunked"
    g = to_float64(case.g)
    _, state_terms = case.terms("chunked")
    for n, point in enumerate(points):
        _, expected = gated_delta_rule_reference(
            case.q[:, :point],
            case.k[:, :point],
            case.v[:, :point],
            g[:, :point],
            case.beta[:, :point],
            case.state,
            **case.options,
        )
        assert_matches(
            f"checkpoint {point}",
            info["checkpoint_states"][n],
            expected,
            STATE_CONTRACTS["chunked"],
            terms=state_terms[:, point],
        )


SHAPE = dict(batch=2, tokens=130, key_heads=2, value_heads=4, key_dim=128, value_dim=16)


def test_the_per_key_chunked_plan_has_per_channel_scratch_and_no_shared_gram():
    plan = metal_emulated.plan(**SHAPE, algorithm="chunked", per_key_gates=True)
    assert plan["algorithm"] == "chunked"
    stages = [d["stage"] for d in plan["dispatches"]]
    # Dk = 128 with repeated heads would share K K^T for scalar gates; a decay
    # per channel is applied inside the gram, so there is no k_gram.
    assert "k_gram" not in stages
    assert "k_gram" in [
        d["stage"] for d in metal_emulated.plan_dispatches(**SHAPE, algorithm="chunked")
    ]
    B, Hv, Dk = SHAPE["batch"], SHAPE["value_heads"], SHAPE["key_dim"]
    padded = 3 * 64
    sizes = plan["buffer_bytes"]
    assert sizes["gate_cumsum"] == B * Hv * padded * Dk * 4
    assert sizes["wipe_mask"] == B * Hv * 3 * Dk * 8
    assert sizes["beta_effective"] == B * Hv * padded * 4
    assert sizes["qk"] == B * Hv * 3 * 64 * 64 * 4
    table = metal_emulated.describe_plan(**SHAPE, algorithm="chunked", per_key_gates=True)
    assert "gated_delta_chunk_qk_float32" in table and "k_gram" not in table


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_the_per_key_plan_costs_at_most_1_5x_the_scalar_plan_on_paper(dtype):
    # The cost model's bytes and FLOPs (describe_plan), Kimi-Linear's heads:
    # the per-channel decays are the per-key plan's extra traffic, written
    # once by gate_cumsum and read by four stages; one wipe mask per chunk and
    # channel instead of a wipe position per row keeps them to 4 bytes a row.
    shape = dict(batch=1, tokens=2048, key_heads=32, value_heads=32, key_dim=128, value_dim=128)

    def totals(per_key_gates):
        dispatches = metal_emulated.plan_dispatches(
            **shape, algorithm="chunked", per_key_gates=per_key_gates, dtype=dtype
        )
        return (
            sum(d["bytes_moved"] for d in dispatches),
            sum(d["flops"] for d in dispatches),
        )

    (scalar_bytes, scalar_flops), (key_bytes, key_flops) = totals(False), totals(True)
    assert key_bytes <= 1.5 * scalar_bytes
    assert key_flops <= 1.5 * scalar_flops


# --- Per-stage: the per-key scratch against float64 ----------------------------
# O(1) data as in test_stage_scratch.py, with a channel at g = -300 beside the
# others' g in [-1, 0], and channels wiped inside the second chunk, on the
# first row of a sub-chunk (the row its decays are relative to), on a
# sub-chunk's last row and inside the partial last chunk; normalize_qk, a
# mask and a partial last chunk. The decayed grams are the reference stage
# key_decayed_grams of the same per-channel cumsum (an underflowed decay is a
# wipe, as gate_cumsum keeps it).

STAGE_SHAPE = dict(batch=1, tokens=150, key_heads=1, value_heads=2, key_dim=32, value_dim=8)


@pytest.fixture(scope="module")
def stage_case():
    rng = np.random.default_rng(5)
    B, T, Hk, Hv, Dk, Dv = (STAGE_SHAPE[n] for n in STAGE_SHAPE)
    f32 = np.float32
    q = rng.standard_normal((B, T, Hk, Dk)).astype(f32)
    k = rng.standard_normal((B, T, Hk, Dk)).astype(f32)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(f32)
    g = -rng.uniform(0.0, 1.0, (B, T, Hv, Dk)).astype(f32)
    g[:, :, :, 3] = -300.0
    wipes = ((70, 0, 5), (64 + 32, 1, 7), (64 + 47, 0, 9), (128 + 16, 1, 11))
    for token, head, channel in wipes:
        g[:, token, head, channel] = -np.inf
    beta = rng.uniform(0.0, 1.0, (B, T, Hv)).astype(f32)
    state = (0.5 * rng.standard_normal((B, Hv, Dv, Dk))).astype(f32)
    mask = rng.uniform(size=(B, T)) > 0.2
    mask[:, [token for token, _, _ in wipes]] = True

    # float64: the per-channel cumsum (an underflowed decay is a wipe), the
    # decayed grams and T = (I + A)^-1.
    chunk = metal_emulated.CHUNK_SIZE
    active = mask[:, :, None, None]
    g64 = reference.chunk_rows(np.where(active, g.astype(np.float64), 0.0))  # [B, Hv, C, L, Dk]
    wipe = np.exp(g64.astype(np.float32)) == 0.0
    log_cumsum = np.cumsum(np.where(wipe, 0.0, g64), axis=3)
    index = np.arange(chunk)[None, None, None, :, None]
    last_wipe = np.maximum.accumulate(np.where(wipe, index, -1), axis=3)
    qn = reference.chunk_rows(reference.qk_norm(q.astype(np.float64)))  # [B, Hk, C, L, Dk]
    kn = reference.chunk_rows(reference.qk_norm(k.astype(np.float64)))
    heads = np.arange(Hv) // (Hv // Hk)
    qn, kn = qn[:, heads], kn[:, heads]
    kk, qk = reference.key_decayed_grams(qn, kn, log_cumsum, last_wipe)
    # What a stage reading one decay per head (channel 0's) would build.
    channel_0 = reference.key_decayed_grams(
        qn,
        kn,
        np.repeat(log_cumsum[..., :1], Dk, axis=-1),
        np.repeat(last_wipe[..., :1], Dk, axis=-1),
    )
    qk_one_decay = channel_0[1]
    beta_rows = reference.chunk_rows(np.where(mask[:, :, None], beta, 0.0)[..., None])[..., 0]
    a = beta_rows[..., :, None] * kk  # kk is 0 on and above the diagonal
    kkt_inverse = np.linalg.inv(np.eye(chunk) + a)
    expected = dict(
        log_cumsum=log_cumsum,
        last_wipe=last_wipe,
        qk=qk,
        qk_one_decay=qk_one_decay,
        kkt_inverse=kkt_inverse,
    )
    return (q, k, v, g, beta, state, mask), expected


def run_stage(stage, inputs):
    q, k, v, g, beta, state, mask = inputs
    _, _, info = metal_emulated.run(
        q,
        k,
        v,
        g,
        beta,
        state,
        mask=mask,
        normalize_qk=True,
        algorithm="chunked",
        through_stage=stage,
    )
    return metal_emulated.stage_buffers(info["buffers"], **STAGE_SHAPE, per_key_gates=True)


def real_tokens(actual, expected, tile=False):
    """`actual` with the padding rows (and tile columns) past the last token
    taken from `expected`: no stage defines them."""
    tokens = STAGE_SHAPE["tokens"]
    chunks = actual.shape[2]
    valid = (np.arange(chunks * 64) < tokens).reshape(chunks, 64)
    rows = valid[None, None, :, :, None]
    if tile:
        rows = rows & valid[None, None, :, None, :]
    return np.where(rows, actual, expected)


def test_per_key_gate_cumsum(stage_case):
    inputs, expected = stage_case
    buffers = run_stage("gate_cumsum", inputs)
    for name, contract in (
        ("gate_cumsum", "stage.gate_cumsum.v1.float32.log_cumsum"),
        ("last_wipe", "stage.gate_cumsum.v1.int32.last_wipe"),
    ):
        key = "log_cumsum" if name == "gate_cumsum" else name
        assert_matches(name, buffers[name], expected[key], contract)


@pytest.mark.parametrize(
    "stage, buffer, contract",
    (
        ("chunk_qk", "qk", "stage.key_decayed_grams.v1.float32.tile"),
        ("kkt_inverse", "kkt_inverse", "stage.kkt_inverse.v1.float32.tile"),
    ),
)
def test_per_key_decayed_tiles(stage_case, stage, buffer, contract):
    inputs, expected = stage_case
    buffers = run_stage(stage, inputs)
    actual = real_tokens(buffers[buffer], expected[buffer], tile=True)
    assert_matches(buffer, actual, expected[buffer], contract)


def test_the_per_key_tile_check_sees_one_decay_per_head(stage_case):
    # Probe: chunk_qk's tile, had it taken channel 0's decay for every
    # channel, is outside the stage's contract around the float64 tile.
    inputs, expected = stage_case
    buffers = run_stage("chunk_qk", inputs)
    actual = real_tokens(buffers["qk"], expected["qk"], tile=True)
    contract = "stage.key_decayed_grams.v1.float32.tile"
    assert_matches("qk", actual, expected["qk"], contract)
    with pytest.raises(AssertionError, match="stage.key_decayed_grams"):
        assert_matches("qk", actual, expected["qk_one_decay"], contract)
