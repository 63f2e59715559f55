"""The kernel-choice predicates and the launch-extent check, as pure functions.

The Qwen3-Next shape (Hk=16, Hv=32, D=128) plus the edges of each rule
(csrc/core/dispatch.h).
"""

import pytest

from mlx_gated_delta import _ext

U32_MAX = 2**32 - 1


@pytest.mark.parametrize(
    "key_dim, simd_width, expected",
    [
        (128, 32, True),
        (128, 16, False),  # the design's lanes are 32 wide
        (96, 32, True),
        (80, 32, False),  # not a multiple of the SIMD width
        (160, 32, False),  # more than four values per lane
        (32, 32, True),
        (64, 32, True),
        (16, 32, False),
        (256, 32, False),
        (128, 64, False),
    ],
)
def test_supports_simd_delta(key_dim, simd_width, expected):
    assert _ext.supports_simd_delta(16, 32, key_dim, 128, simd_width) is expected


def test_supports_simd_delta_depends_on_the_key_dim_only():
    for key_heads, value_heads, value_dim in [(1, 1, 16), (16, 16, 80), (2, 8, 256)]:
        assert _ext.supports_simd_delta(key_heads, value_heads, 128, value_dim, 32)
        assert not _ext.supports_simd_delta(key_heads, value_heads, 80, value_dim, 32)


@pytest.mark.parametrize(
    "key_heads, value_heads, key_dim, expected",
    [
        (16, 32, 128, True),  # Qwen3-Next
        (16, 16, 128, False),  # no repeated key heads: nothing to share
        (16, 32, 64, False),
        (1, 4, 128, True),
        (4, 4, 128, False),
        (2, 8, 96, False),
    ],
)
def test_uses_chunk_k_gram_k128(key_heads, value_heads, key_dim, expected):
    assert _ext.uses_chunk_k_gram_k128(key_heads, value_heads, key_dim, 128) is expected


# 2^32 - 1 = 3 * 5 * 17 * 257 * 65537: shapes whose element count is exactly
# the largest a 32-bit index addresses, and one element past it.
@pytest.mark.parametrize(
    "extents, tensor",
    [
        # (batch, tokens, key_heads, value_heads, key_dim, value_dim)
        ((15, 4369, 1, 1, 65537, 1), "QK activation elements"),
        ((15, 4369, 1, 1, 1, 65537), "V activation elements"),
        ((1, 1, 1, 1, 65535, 65537), "state elements"),
    ],
    ids=["qk", "v", "state"],
)
def test_validate_launch_extents_rejects_counts_past_32_bits(extents, tensor):
    batch, tokens, key_heads, value_heads, key_dim, value_dim = extents
    _ext.validate_launch_extents(*extents)  # exactly 2^32 - 1 elements: fits

    one_more = list(extents)
    if tensor == "V activation elements":
        one_more[5] += 1
    else:
        one_more[4] += 1
    with pytest.raises(ValueError, match=tensor) as failure:
        _ext.validate_launch_extents(*one_more)
    assert str(U32_MAX) in str(failure.value)


def test_validate_launch_extents_at_the_qwen3_next_shape():
    # One 256k-token Qwen3-Next prefill has 2^29 QK and 2^30 V elements.
    _ext.validate_launch_extents(1, 262144, 16, 32, 128, 128)
    with pytest.raises(ValueError, match="V activation elements"):
        # Four such rows: 2^31 QK elements fit, 2^32 V elements do not.
        _ext.validate_launch_extents(4, 262144, 16, 32, 128, 128)
