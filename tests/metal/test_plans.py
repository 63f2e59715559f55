"""The Metal dispatch plans (plain C++ shared by the Metal executor and the
emulator): the kernel each shape selects, the limits, and the plan of the
Qwen3-Next prefill the design is sized for."""

import pytest

import metal_emulated

QWEN3_NEXT = dict(batch=1, tokens=8192, key_heads=16, value_heads=32, key_dim=128, value_dim=128)
CHUNKED_STAGES = [
    "gate_cumsum",
    "k_gram",
    "kkt_inverse",
    "recompute_w_u",
    "chunk_qk",
    "chunk_carry",
    "chunk_output",
]


def stages(**shape):
    return [d["stage"] for d in metal_emulated.plan_dispatches(**shape)]


def kernels(**shape):
    return [d["kernel"] for d in metal_emulated.plan_dispatches(**shape)]


@pytest.mark.parametrize(
    "key_dim, simd",
    [(32, True), (64, True), (96, True), (128, True), (16, False), (80, False), (160, False)],
)
def test_the_simd_recurrent_kernel_needs_a_multiple_of_32_up_to_128(key_dim, simd):
    names = kernels(
        batch=1,
        tokens=4,
        key_heads=1,
        value_heads=2,
        key_dim=key_dim,
        value_dim=16,
        algorithm="recurrent",
    )
    assert names == [
        "gated_delta_recurrent_simd_float32" if simd else "gated_delta_recurrent_generic_float32"
    ]


@pytest.mark.parametrize(
    "key_dim, key_heads, value_heads, shared",
    [(128, 1, 2, True), (128, 2, 2, False), (64, 1, 2, False)],
)
def test_the_k_gram_stage_runs_for_dk_128_with_repeated_heads(
    key_dim, key_heads, value_heads, shared
):
    names = kernels(
        batch=1,
        tokens=100,
        key_heads=key_heads,
        value_heads=value_heads,
        key_dim=key_dim,
        value_dim=16,
        algorithm="chunked",
    )
    assert ("gated_delta_k_gram_float32" in names) == shared
    assert ("gated_delta_kkt_inverse_from_k_gram_float32" in names) == shared


def test_auto_is_recurrent_up_to_one_chunk_and_chunked_beyond():
    shape = dict(batch=1, key_heads=1, value_heads=2, key_dim=32, value_dim=16)
    assert stages(tokens=64, **shape) == ["recurrent"]
    assert stages(tokens=65, **shape)[-1] == "chunk_output"
    # Key dims past the chunked stages' threadgroup state stay recurrent.
    assert stages(tokens=1000, **{**shape, "key_dim": 320}) == ["recurrent"]
    with pytest.raises(ValueError, match="chunked kernels support key_dim up to 256"):
        stages(tokens=1000, algorithm="chunked", **{**shape, "key_dim": 320})


def test_normalize_qk_adds_the_qk_norm_stage():
    assert stages(**QWEN3_NEXT, normalize_qk=True) == ["qk_norm"] + CHUNKED_STAGES


def test_the_qwen3_next_prefill_plan_fits_metal():
    dispatches = metal_emulated.plan_dispatches(**QWEN3_NEXT, dtype="bfloat16")
    assert [d["stage"] for d in dispatches] == CHUNKED_STAGES
    for d in dispatches:
        assert 0 < d["threads_per_threadgroup"] <= 1024
        assert d["threadgroup_memory_bytes"] <= 32768
    grids = {d["stage"]: d["threadgroups"] for d in dispatches}
    # The intra-chunk stages run every chunk of every head at once.
    assert grids["kkt_inverse"] == (128, 32, 1)
    assert grids["chunk_qk"] == (128, 16, 1)
    assert grids["chunk_output"] == (128, 32, 1)
    assert grids["chunk_carry"] == (32, 32, 1)
    text = metal_emulated.describe_plan(**QWEN3_NEXT, dtype="bfloat16")
    assert "dispatches: 7" in text
    assert "400 GB/s" in text and "TFLOP/s" in text


def test_activations_past_32_bit_indices_are_rejected_before_launch():
    with pytest.raises(ValueError, match="QK activation elements"):
        metal_emulated.plan_dispatches(
            batch=1, tokens=2**22, key_heads=16, value_heads=32, key_dim=128, value_dim=128
        )


@pytest.mark.parametrize(
    "shape",
    [
        dict(tokens=5, key_dim=32, algorithm="recurrent", mask=True),
        dict(tokens=5, key_dim=80, algorithm="recurrent"),
        dict(tokens=130, key_dim=64, algorithm="chunked", normalize_qk=True, mask=True),
        dict(tokens=130, key_dim=128, algorithm="chunked"),
        dict(tokens=0, key_dim=32, algorithm="chunked"),
    ],
)
def test_every_buffer_a_dispatch_reads_was_written_before(shape):
    # The order an executor must keep: a scratch buffer is written by an
    # earlier dispatch before any dispatch reads it; inputs are never written;
    # both outputs are written.
    dispatches = metal_emulated.plan_dispatches(
        batch=1, key_heads=1, value_heads=2, value_dim=16, **shape
    )
    inputs = {"q", "k", "v", "g", "beta", "mask", "state_in"}
    written = set()
    for d in dispatches:
        for _, name, writes in d["buffers"]:
            if not writes:
                assert name in inputs or name in written, (d["stage"], name)
            else:
                assert name not in inputs, (d["stage"], name)
        written |= {name for _, name, writes in d["buffers"] if writes}
    assert {"state_out"} <= written
    if shape["tokens"] > 0:
        assert "y" in written


# The backward (make_backward_plan), recurrent form: boundary_states, then per
# chunk from the last chunk_states and recurrent_chunk_backward, then qk_grad_reduce.
def backward_stages(algorithm="recurrent", **shape):
    plan = metal_emulated.backward_plan(algorithm=algorithm, **shape)
    return [d["stage"] for d in plan["dispatches"]]


def test_the_backward_walks_the_chunks_from_the_last():
    shape = dict(batch=1, tokens=130, key_heads=1, value_heads=2, key_dim=32, value_dim=16)
    dispatches = metal_emulated.backward_plan(algorithm="recurrent", **shape)["dispatches"]
    assert [d["stage"] for d in dispatches] == (
        ["boundary_states"] + ["chunk_states", "recurrent_chunk_backward"] * 3 + ["qk_grad_reduce"]
    )
    # Each per-chunk dispatch reads its chunk from a scalar of its own, bound
    # past its buffers and its params block.
    chunks = [(d["stage"], d["chunk"]) for d in dispatches if d["chunk"] is not None]
    assert [chunk for _, (_, chunk) in chunks] == [2, 2, 1, 1, 0, 0]
    for d in dispatches:
        if d["chunk"] is None:
            continue
        index = d["chunk"][0]
        assert index != d["params_index"]
        assert index not in {binding[0] for binding in d["buffers"]}
    assert backward_stages(**{**shape, "tokens": 64}) == [
        "boundary_states",
        "chunk_states",
        "recurrent_chunk_backward",
        "qk_grad_reduce",
    ]
    # No tokens: the state's cotangent still becomes dstate.
    assert backward_stages(**{**shape, "tokens": 0}) == ["boundary_states"]


def test_the_chunked_backward_runs_its_wy_stages_around_one_walk_over_the_chunks():
    # The forward's chunked stages, boundary_states and chunk_output_backward
    # over all chunks; per chunk from the last the recurrent reverse (for
    # chunks with a wipe) and chunk_carry_backward; the WY stages that do not
    # need dS over all chunks; qk_grad_reduce.
    shape = dict(batch=1, tokens=130, key_heads=1, value_heads=2, key_dim=32, value_dim=16)
    plan = metal_emulated.backward_plan(algorithm="chunked", normalize_qk=True, **shape)
    assert plan["algorithm"] == "chunked"
    dispatches = plan["dispatches"]
    assert [d["stage"] for d in dispatches] == (
        ["qk_norm", "gate_cumsum", "kkt_inverse", "recompute_w_u", "chunk_qk", "chunk_carry"]
        + ["boundary_states", "chunk_output_backward"]
        + ["chunk_states", "recurrent_chunk_backward", "chunk_carry_backward"] * 3
        + ["recompute_w_u_backward", "kkt_inverse_backward", "gate_cumsum_backward"]
        + ["qk_grad_reduce"]
    )
    walked = [d["chunk"][1] for d in dispatches if d["chunk"] is not None]
    assert walked == [2, 2, 2, 1, 1, 1, 0, 0, 0]
    grids = {d["stage"]: d["threadgroups"] for d in dispatches}
    assert grids["chunk_output_backward"] == (3, 2, 1)
    assert grids["chunk_carry_backward"] == (2, 1, 1)
    assert grids["gate_cumsum_backward"] == (3, 2, 1)
    # Auto: the recurrent form below 8 tokens, with either gates.
    assert metal_emulated.backward_plan(**shape)["algorithm"] == "chunked"
    assert metal_emulated.backward_plan(**{**shape, "tokens": 8})["algorithm"] == "chunked"
    assert metal_emulated.backward_plan(**{**shape, "tokens": 7})["algorithm"] == "recurrent"
    # Per-key gates: channel_pairs_backward in gate_cumsum_backward's place,
    # with the per-channel decays' terms and the tiles dM and dA as scratch.
    per_key = metal_emulated.backward_plan(
        per_key_gates=True, algorithm="chunked", normalize_qk=True, **shape
    )
    assert per_key["algorithm"] == "chunked"
    assert [d["stage"] for d in per_key["dispatches"]] == [d["stage"] for d in dispatches][:-2] + [
        "channel_pairs_backward",
        "qk_grad_reduce",
    ]
    sizes = per_key["buffer_bytes"]
    assert sizes["decay_entry_terms"] == sizes["decay_exit_terms"] == 2 * 3 * 64 * 32 * 4
    assert sizes["qk_grad"] == sizes["kkt_grad"] == 2 * 3 * 64 * 64 * 4
    assert "decay_pair_terms" not in sizes
    pairs = {d["stage"]: d for d in per_key["dispatches"]}["channel_pairs_backward"]
    assert pairs["threadgroups"] == (3, 2, 1)
    assert pairs["threads_per_threadgroup"] == 256
    assert pairs["bytes_moved"] > 0 and pairs["flops"] > 0
    # No tokens: chunk_carry copies the state, boundary_states seeds dstate.
    assert backward_stages(algorithm="chunked", **{**shape, "tokens": 0}) == [
        "chunk_carry",
        "boundary_states",
    ]


@pytest.mark.parametrize(
    "shape",
    [
        dict(tokens=130, key_dim=32, mask=True, algorithm="recurrent"),
        dict(tokens=5, key_dim=80, normalize_qk=True, per_key_gates=True),
        dict(tokens=0, key_dim=32, algorithm="recurrent"),
        dict(tokens=130, key_dim=32, mask=True, normalize_qk=True, algorithm="chunked"),
        dict(tokens=130, key_dim=32, mask=True, normalize_qk=True, per_key_gates=True),
        dict(tokens=130, key_dim=128, key_heads=1, algorithm="chunked"),
        dict(tokens=0, key_dim=32, algorithm="chunked"),
    ],
)
def test_every_buffer_the_backward_reads_was_written_before(shape):
    shape = {"key_heads": 1, **shape}
    plan = metal_emulated.backward_plan(batch=1, value_heads=2, value_dim=16, **shape)
    roles = plan["buffer_roles"]
    inputs = {name for name, role in roles.items() if role == "input"}
    assert inputs == {"q", "k", "v", "g", "beta", "state_in", "y_cotangent", "state_cotangent"} | (
        {"mask"} if shape.get("mask") else set()
    )
    outputs = {name for name, role in roles.items() if role == "output"}
    assert outputs == {"dq", "dk", "dv", "dg", "dgamma", "dbeta", "dstate"}
    written = set()
    for d in plan["dispatches"]:
        for _, name, writes in d["buffers"]:
            if not writes:
                assert name in inputs or name in written, (d["stage"], name)
            else:
                assert name not in inputs, (d["stage"], name)
        written |= {name for _, name, writes in d["buffers"] if writes}
    assert "dstate" in written
    if shape["tokens"] > 0:
        assert outputs <= written


def test_the_backward_takes_key_dims_up_to_256():
    shape = dict(batch=1, tokens=10, key_heads=1, value_heads=1, value_dim=8)
    assert backward_stages(key_dim=256, **shape)[-1] == "qk_grad_reduce"
    with pytest.raises(ValueError, match="Metal backward supports key_dim up to 256"):
        backward_stages(key_dim=257, **shape)


def test_the_qwen3_next_backward_plan_at_8192_tokens():
    plan = metal_emulated.backward_plan(
        **QWEN3_NEXT, dtype="bfloat16", normalize_qk=True, algorithm="recurrent"
    )
    dispatches = plan["dispatches"]
    assert len(dispatches) == 2 + 2 * 128
    for d in dispatches:
        assert 0 < d["threads_per_threadgroup"] <= 1024
        assert d["threadgroup_memory_bytes"] <= 32768
    sizes = plan["buffer_bytes"]
    state = 32 * 128 * 128 * 4
    # O(T / 64) states: one per chunk, and one chunk's states at a time.
    assert sizes["boundary_states"] == 128 * state
    assert sizes["chunk_states"] == 64 * state
    assert sizes["query_head_grad"] == sizes["key_head_grad"] == 8192 * 32 * 128 * 4
    grids = {d["stage"]: d["threadgroups"] for d in dispatches}
    assert grids["boundary_states"] == (16, 32, 1)
    assert grids["recurrent_chunk_backward"] == (32, 1, 1)
    assert grids["qk_grad_reduce"] == (8192 * 16 // 8, 1, 1)
    # FLOPs: the forward once more (5 per state entry and token, 127 chunks),
    # the states again (63 tokens of each chunk), and the reverse (20).
    entries = 32 * 128 * 128
    flops = sum(d["flops"] for d in dispatches if d["stage"] != "qk_grad_reduce")
    assert flops == pytest.approx(entries * (5 * 127 * 64 + 5 * 63 * 128 + 20 * 8192))
    text = metal_emulated.backward_plan(
        **QWEN3_NEXT, dtype="bfloat16", describe=True, algorithm="recurrent"
    )
    assert text.startswith("backward plan: recurrent, bfloat16")
    assert "dispatches: 258" in text
    assert "recurrent_chunk_backward x128" in text and "chunk_states x128" in text


def test_the_qwen3_next_chunked_backward_plan_at_8192_tokens():
    # Auto takes the chunked form; the states go through device memory once
    # per chunk instead of three times per token.
    plan = metal_emulated.backward_plan(**QWEN3_NEXT, dtype="bfloat16", normalize_qk=True)
    assert plan["algorithm"] == "chunked"
    dispatches = plan["dispatches"]
    # qk_norm, gate_cumsum, k_gram, kkt_inverse, recompute_w_u, chunk_qk,
    # chunk_carry, boundary_states, chunk_output_backward; three per chunk;
    # the three WY stages over all chunks and qk_grad_reduce.
    assert len(dispatches) == 9 + 3 * 128 + 4
    for d in dispatches:
        assert 0 < d["threads_per_threadgroup"] <= 1024
        assert d["threadgroup_memory_bytes"] <= 32768
    recurrent = metal_emulated.backward_plan(
        **QWEN3_NEXT, dtype="bfloat16", normalize_qk=True, algorithm="recurrent"
    )
    moved = sum(d["bytes_moved"] for d in dispatches)
    assert moved < sum(d["bytes_moved"] for d in recurrent["dispatches"]) / 10
    sizes = plan["buffer_bytes"]
    assert sizes["corrected_grad"] == 32 * 8192 * 128 * 4
    assert sizes["kkt_inverse_grad"] == 32 * 128 * 64 * 64 * 4
    text = metal_emulated.backward_plan(**QWEN3_NEXT, dtype="bfloat16", describe=True)
    assert text.startswith("backward plan: chunked, bfloat16")
    assert "chunk_carry_backward x128" in text


def test_the_qwen3_next_per_key_backward_moves_at_most_1_5x_the_scalar_gates_bytes():
    # Per-key gates (g [B, T, Hv, Dk]) on paper against scalar gates on the
    # same shape: the per-channel terms and the tiles dM and dA cost bytes,
    # but no stage reads the chunk's 64 x Dk gates for its chunk test.
    scalar, per_key = (
        metal_emulated.backward_plan(
            **QWEN3_NEXT, dtype="bfloat16", normalize_qk=True, per_key_gates=per_key_gates
        )
        for per_key_gates in (False, True)
    )

    def total(plan, key):
        return sum(d[key] for d in plan["dispatches"])

    assert per_key["algorithm"] == scalar["algorithm"] == "chunked"
    assert total(per_key, "bytes_moved") <= 1.5 * total(scalar, "bytes_moved")
    assert total(per_key, "flops") <= 1.5 * total(scalar, "flops")


@pytest.mark.parametrize("per_key_gates", [False, True])
def test_the_backward_stages_test_their_chunks_by_the_tiny_decay_mask(per_key_gates):
    # The rerun's gate_cumsum writes the mask, every stage that chooses
    # between the WY form and the recurrent reverse reads it, and only the
    # stages that use the gates themselves bind g. The forward has no mask.
    shape = dict(batch=1, tokens=130, key_heads=1, value_heads=2, key_dim=32, value_dim=16)
    plan = metal_emulated.backward_plan(
        algorithm="chunked", per_key_gates=per_key_gates, mask=True, **shape
    )
    width = 32 if per_key_gates else 1
    assert plan["buffer_bytes"]["tiny_decay_mask"] == 2 * 3 * width * 8
    tested = {
        "chunk_states",
        "recurrent_chunk_backward",
        "chunk_output_backward",
        "chunk_carry_backward",
        "recompute_w_u_backward",
        "kkt_inverse_backward",
        "channel_pairs_backward" if per_key_gates else "gate_cumsum_backward",
    }
    reads_gates = {"gate_cumsum", "boundary_states", "chunk_states", "recurrent_chunk_backward"} | (
        {"channel_pairs_backward"} if per_key_gates else {"gate_cumsum_backward"}
    )
    for d in plan["dispatches"]:
        names = {name: writes for _, name, writes in d["buffers"]}
        if d["stage"] == "gate_cumsum":
            assert names["tiny_decay_mask"] is True
        else:
            assert names.get("tiny_decay_mask", False) is False, d["stage"]
            assert ("tiny_decay_mask" in names) == (d["stage"] in tested), d["stage"]
        assert ("g" in names) == (d["stage"] in reads_gates), d["stage"]
    forward = metal_emulated.plan_dispatches(
        per_key_gates=per_key_gates, algorithm="chunked", **shape
    )
    assert all("tiny_decay_mask" not in {name for _, name, _ in d["buffers"]} for d in forward)
