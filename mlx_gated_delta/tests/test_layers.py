"""Property tests of the drop-in layers (docs/contract.md) on the tiny random
mlx-lm model of every family record (`mlx_gated_delta.layers.FAMILIES`):
patched and unpatched give the same logits, within the layer contract, and
the same greedy tokens; prefill then token-by-token decode through the cache
gives the full forward's logits. Probes show the parity checks catch the
layer bugs each family invites.

Ordinary pytest functions, run both by the repository's `pytest` (whose
`tests/test_layer.py` also uses the helpers here) and by
`python -m mlx_gated_delta selftest`, on the default device. They need mlx-lm
(`pip install "mlx-gated-delta[mlx-lm]"`) and are skipped without it.
"""

import mlx.core as mx
import pytest

pytest.importorskip(
    "mlx_lm", reason='the layer properties need mlx-lm: pip install "mlx-gated-delta[mlx-lm]"'
)

from mlx_lm.generate import generate_step  # noqa: E402

from mlx_gated_delta import patch_mlx_lm  # noqa: E402
from mlx_gated_delta.layers import FAMILIES  # noqa: E402
from mlx_gated_delta.layers.families.tiny import VOCAB  # noqa: E402
from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402

FAMILY = {family.name: family for family in FAMILIES}


def family_model(name, seed=30, **options):
    """The tiny random (unpatched) mlx-lm model of the family `name`."""
    return FAMILY[name].tiny_model(seed, **options)


def our_layers(model, name):
    """The family's gated-delta layers of a patched model: ours."""
    return [m for _, m in model.named_modules() if isinstance(m, FAMILY[name].layer)]


def tokens(seed, shape):
    return mx.random.randint(0, VOCAB, shape, key=mx.random.key(seed))


def greedy_tokens(model, prompt, count=8):
    """`count` greedy tokens after `prompt` ([1, T]): mlx-lm's prefill of the
    prompt through the prompt cache, then one-token decode steps."""
    return [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=count, sampler=lambda x: mx.argmax(x, -1)
        )
    ]


# Every family with every setting of its layer its record names.
VARIANTS = [
    pytest.param(
        family.name,
        options,
        id=family.name if len(family.tiny_model_variants) == 1 else f"{family.name}-{variant}",
    )
    for family in FAMILIES
    for variant, options in family.tiny_model_variants.items()
]

NAMES = [family.name for family in FAMILIES]


@pytest.mark.parametrize("name, options", VARIANTS)
def test_patched_model_matches_mlx_lm_logits_and_greedy_tokens(name, options):
    # A prompt past one chunk, then one-token decode steps.
    family = FAMILY[name]
    model = family_model(name, 3, **options)
    prompt = tokens(6, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = greedy_tokens(model, prompt)
    assert patch_mlx_lm(model) == family.tiny_model_layers
    assert len(our_layers(model, name)) == family.tiny_model_layers
    assert_matches(
        "logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits"
    )
    assert greedy_tokens(model, prompt) == expected_tokens


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_token_by_token_decode_equals_full_forward(name):
    model = family_model(name, 4)
    patch_mlx_lm(model)
    sequence = tokens(5, (1, 24))
    full = model(sequence)
    cache = model.make_cache()
    pieces = [model(sequence[:, :17], cache=cache)]
    for t in range(17, 24):
        pieces.append(model(sequence[:, t : t + 1], cache=cache))
    assert_matches(
        "logits", mx.concatenate(pieces, axis=1), full, "layer.self_consistency.v2.float32.logits"
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_patched_family_gives_the_stock_greedy_tokens(name):
    # Every gated-delta layer replaced by ours, and greedy generation
    # (prefill of a prompt past one chunk, then one-token decode steps)
    # gives the stock model's tokens.
    model, layers = family_model(name), FAMILY[name].tiny_model_layers
    prompt = tokens(31, (1, 67))
    expected = greedy_tokens(model, prompt, count=12)
    assert patch_mlx_lm(model) == layers
    assert patch_mlx_lm(model) == 0  # no stock gated-delta layer is left
    assert greedy_tokens(model, prompt, count=12) == expected


@pytest.mark.parametrize("length", (63, 64, 65, 127, 128))
def test_extreme_decays_at_chunk_boundaries_match_mlx_lm(length):
    # The segment's gates (Qwen3-Next, Qwen3.5). Per value head: a decay
    # near 1 (A_log = -12, rate 6e-6), a model-like one and severe ones
    # (A_log = 5.7, rate about 300: g = -300 softplus(.) is below -104 per
    # token, where exp(g) underflows to exactly 0 in float32, wherever
    # softplus(.) > 0.35).
    name = "qwen3_next" if length % 2 else "qwen3_5"
    model = family_model(name, length)
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.linear_attn
            attn.A_log = mx.array([-12.0, 0.0, 5.7, 5.7])[: attn.A_log.shape[0]]
    mx.eval(model.parameters())
    prompt = tokens(length, (2, length))
    expected = model(prompt)
    patch_mlx_lm(model)
    assert_matches("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


def test_the_olmo_hybrid_check_sees_beta_in_zero_one_where_two_is_allowed():
    # Probe: with allow_neg_eigval the stock model's logits differ, beyond
    # the contract, from the same model whose layers keep beta in [0, 1].
    model = family_model("olmo_hybrid", 9, allow_neg_eigval=True)
    prompt = tokens(10, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for attn in our_layers(model, "olmo_hybrid"):
        attn.allow_neg_eigval = False
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3", "bailing_moe_v3"])
def test_the_kda_checks_see_dt_bias_read_once_per_head(name):
    # Probe for mlx-lm#1792's bug: dt_bias [H, Dk] read once per head (its
    # channel 0 for every channel) gives logits outside the contract around
    # the stock model's, so the parity test above would catch it.
    model = family_model(name, 28)
    prompt = tokens(29, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for attn in our_layers(model, name):
        per_head = attn.dt_bias.reshape(attn.num_heads, attn.head_dim)[:, :1]
        attn.dt_bias = mx.repeat(per_head, attn.head_dim, axis=1).reshape(-1)
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("name", ["kimi_k3", "bailing_moe_v3"])
def test_the_kda_checks_see_the_lower_bound_ignored(name):
    # Probe: the stock model's logits differ, beyond the contract, from the
    # same model whose layers drop the lower bound (Kimi-Linear's softplus
    # gate instead), so the parity tests above would catch it.
    model = family_model(name, 26)
    prompt = tokens(27, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for attn in our_layers(model, name):
        attn.lower_bound = None
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")
