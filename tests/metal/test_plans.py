"""The Metal dispatch plans (plain C++ shared by the Metal executor and the
emulator): the kernel each shape selects, the limits, and the plan of the
Qwen3-Next prefill the design is sized for."""

import pytest

from mlx_gated_delta.testing import metal_emulated

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
