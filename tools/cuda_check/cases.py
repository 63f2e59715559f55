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
# The cases the sanitizers run (slow under instrumentation): every kernel once.
SANITIZER_CASES = (
    "recurrent_simd_f32_mask",
    "recurrent_generic_f16",
    "chunked_bf16_norm",
    "chunked_k_gram_f16",
    "segment_recurrent_f16_mask",
)


def make_case(name):
    """(algorithm, case) of a core case or of a segment case."""
    from mlx_gated_delta.testing.segment_cases import make_segment_case
    from mlx_gated_delta.testing.strategies import make_core_case

    if name in SEGMENT_CASES:
        algorithm, recipe = SEGMENT_CASES[name]
        return algorithm, make_segment_case(sum(map(ord, name)), **recipe)
    algorithm, recipe = CASES[name]
    return algorithm, make_core_case(sum(map(ord, name)), **recipe)
