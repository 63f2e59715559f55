"""The cases the CUDA check runs: small shapes that reach every kernel, plus
one larger Qwen3-Next-like head layout, and fused segment calls. Rebuilt
bit-identically from these recipes (make_core_case and make_segment_case are
seeded) both where they are exported and where the GPU's results are compared
with the oracle."""

CASES = {
    "recurrent_simd_f32_mask": (
        "recurrent",
        dict(
            batch=2,
            tokens=9,
            key_heads=2,
            value_heads=4,
            key_dim=64,
            value_dim=32,
            mask_kind="random",
        ),
    ),
    "recurrent_simd_bf16_norm": (
        "recurrent",
        dict(
            batch=1,
            tokens=7,
            key_heads=1,
            value_heads=2,
            key_dim=128,
            value_dim=16,
            dtype="bfloat16",
            normalize_qk=True,
            head_mapping="interleaved",
        ),
    ),
    "recurrent_generic_f16": (
        "recurrent",
        dict(
            batch=1,
            tokens=6,
            key_heads=1,
            value_heads=2,
            key_dim=80,
            value_dim=16,
            dtype="float16",
            mask_kind="left_padding",
        ),
    ),
    "chunked_f32_mask_interleaved": (
        "chunked",
        dict(
            batch=2,
            tokens=130,
            key_heads=2,
            value_heads=4,
            key_dim=32,
            value_dim=16,
            mask_kind="random",
            head_mapping="interleaved",
        ),
    ),
    "chunked_bf16_norm": (
        "chunked",
        dict(
            batch=1,
            tokens=100,
            key_heads=1,
            value_heads=2,
            key_dim=96,
            value_dim=32,
            dtype="bfloat16",
            normalize_qk=True,
        ),
    ),
    "chunked_k_gram_f16": (
        "chunked",
        dict(
            batch=1,
            tokens=129,
            key_heads=1,
            value_heads=2,
            key_dim=128,
            value_dim=16,
            dtype="float16",
            decay="strong",
        ),
    ),
    "chunked_qwen_layout_f32": (
        "chunked",
        dict(
            batch=1,
            tokens=1000,
            key_heads=4,
            value_heads=8,
            key_dim=128,
            value_dim=128,
            normalize_qk=True,
        ),
    ),
    # The chunked stages with per-key gates: gate_cumsum per channel, the
    # decayed grams built pair by pair, decays per column; wipes on single
    # channels and a mask, past two chunks.
    "chunked_per_key_f16_wipes_mask": (
        "chunked",
        dict(
            batch=2,
            tokens=130,
            key_heads=1,
            value_heads=2,
            key_dim=40,
            value_dim=24,
            dtype="float16",
            mask_kind="random",
            per_key_gates=True,
            wipes="runs",
        ),
    ),
}
# The fused segment (its own stages around the core's).
SEGMENT_CASES = {
    "segment_recurrent_f16_mask": (
        "recurrent",
        dict(
            batch=2,
            tokens=9,
            key_heads=2,
            value_heads=4,
            key_dim=32,
            value_dim=16,
            dtype="float16",
            mask_kind="random",
            head_mapping="interleaved",
        ),
    ),
    "segment_chunked_bf16_negative_rate": (
        "chunked",
        dict(
            batch=1,
            tokens=100,
            key_heads=1,
            value_heads=2,
            key_dim=64,
            value_dim=24,
            dtype="bfloat16",
            decay_parameterization="negative_rate",
            mask_kind="left_padding",
            conv_kernel=3,
        ),
    ),
    "segment_chunked_qwen_layout_f32": (
        "chunked",
        dict(batch=1, tokens=300, key_heads=4, value_heads=8, key_dim=128, value_dim=128),
    ),
}
# Core and segment cases with checkpoints (token counts) and, for the
# recurrent kernels, tree verification (a parent per token), by the names of
# the cases above whose inputs they reuse; held to the CPU op's results.
CHECKPOINT_CASES = {
    "checkpoints_recurrent_simd": ("recurrent_simd_f32_mask", [1, 4, 5, 9], None),
    "checkpoints_chunked": ("chunked_f32_mask_interleaved", [1, 30, 64, 65, 128, 130], None),
    "checkpoints_chunked_qwen_layout": ("chunked_qwen_layout_f32", [17, 64, 500, 999], None),
    "tree_recurrent_simd": (
        "recurrent_simd_f32_mask",
        list(range(1, 10)),
        [-1, 0, 0, 1, -1, 4, 2, 6, 3],
    ),
    "tree_recurrent_generic": ("recurrent_generic_f16", [2, 6], [-1, 0, 1, 0, 3, 3]),
    "checkpoints_segment_chunked": ("segment_chunked_bf16_negative_rate", [3, 64, 99, 100], None),
}
# The backward (the vjp of the core op), against the float64 reference vjp
# for the cotangents of backward_cotangents, as (algorithm, recipe). "auto"
# takes the chunked WY form from 8 tokens (the forward's chunked stages,
# boundary_states, the WY stages chunk_output_backward, chunk_carry_backward,
# recompute_w_u_backward, kkt_inverse_backward and gate_cumsum_backward, with
# per-key gates channel_pairs_backward in its place, and chunk_states and
# recurrent_chunk_backward on the chunks with a wipe); one scalar-gate case asks
# for the recurrent form (boundary_states, chunk_states and
# recurrent_chunk_backward per chunk). qk_grad_reduce in both.
BACKWARD_CASES = {
    "backward_f32_mask_interleaved": (
        "auto",
        dict(
            batch=2,
            tokens=130,
            key_heads=2,
            value_heads=4,
            key_dim=32,
            value_dim=16,
            mask_kind="random",
            head_mapping="interleaved",
            wipes="chunk_edges",
        ),
    ),
    "backward_bf16_norm": (
        "auto",
        dict(
            batch=1,
            tokens=100,
            key_heads=1,
            value_heads=2,
            key_dim=96,
            value_dim=32,
            dtype="bfloat16",
            normalize_qk=True,
        ),
    ),
    "backward_f16_per_key": (
        "auto",
        dict(
            batch=1,
            tokens=70,
            key_heads=1,
            value_heads=2,
            key_dim=40,
            value_dim=9,
            dtype="float16",
            per_key_gates=True,
            wipes="runs",
        ),
    ),
    # Per-key gates with no wipe and no tiny decay: every chunk takes the WY
    # stages and channel_pairs_backward (the wipe runs above send each of
    # that case's chunks to the recurrent reverse).
    "backward_f32_per_key_mask": (
        "auto",
        dict(
            batch=2,
            tokens=130,
            key_heads=1,
            value_heads=2,
            key_dim=64,
            value_dim=16,
            mask_kind="random",
            per_key_gates=True,
        ),
    ),
    "backward_qwen_layout_f32": (
        "auto",
        dict(
            batch=1,
            tokens=300,
            key_heads=4,
            value_heads=8,
            key_dim=128,
            value_dim=128,
            normalize_qk=True,
        ),
    ),
    "backward_bf16_recurrent_scalar": (
        "recurrent",
        dict(
            batch=2,
            tokens=70,
            key_heads=1,
            value_heads=2,
            key_dim=48,
            value_dim=16,
            dtype="bfloat16",
            mask_kind="left_padding",
            wipes="runs",
        ),
    ),
}
# The cases the sanitizers run (slow under instrumentation): every kernel once.
SANITIZER_CASES = (
    "recurrent_simd_f32_mask",
    "recurrent_generic_f16",
    "chunked_bf16_norm",
    "chunked_k_gram_f16",
    "segment_recurrent_f16_mask",
    "checkpoints_chunked",
    "tree_recurrent_generic",
    "checkpoints_segment_chunked",
    "backward_f16_per_key",
    "chunked_per_key_f16_wipes_mask",
    "backward_bf16_norm",
    "backward_bf16_recurrent_scalar",
)


def make_case(name):
    """(algorithm, case) of a core case or of a segment case (a checkpoint
    case: of the case it reuses)."""
    if name in CHECKPOINT_CASES:
        name = CHECKPOINT_CASES[name][0]
    from mlx_gated_delta.testing.segment_cases import make_segment_case
    from mlx_gated_delta.testing.strategies import make_core_case

    if name in BACKWARD_CASES:
        algorithm, recipe = BACKWARD_CASES[name]
        return algorithm, make_core_case(sum(map(ord, name)), **recipe)
    if name in SEGMENT_CASES:
        algorithm, recipe = SEGMENT_CASES[name]
        return algorithm, make_segment_case(sum(map(ord, name)), **recipe)
    algorithm, recipe = CASES[name]
    return algorithm, make_core_case(sum(map(ord, name)), **recipe)


def backward_cotangents(case):
    """The cotangents of y (rounded to the activation dtype) and of the final
    state a backward case is run with, as float32 NumPy arrays."""
    import numpy as np

    import metal_emulated  # on the path export.py and compare.py set

    rng = np.random.default_rng(7)
    dtype = case.recipe["dtype"]
    wy = rng.standard_normal(case.v.shape).astype(np.float32)
    if dtype == "float16":
        wy = wy.astype(np.float16).astype(np.float32)
    elif dtype == "bfloat16":
        wy = metal_emulated.round_to_bfloat16(wy)
    shape = (case.v.shape[0], case.v.shape[2], case.v.shape[3], case.q.shape[3])
    return wy, rng.standard_normal(shape).astype(np.float32)
