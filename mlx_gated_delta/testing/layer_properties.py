"""Property tests of the drop-in layer (docs/contract.md) on tiny random
mlx-lm models of the six gated-delta families (Qwen3-Next, Qwen3.5,
OLMo-Hybrid, Kimi-Linear, Kimi-K3, Bailing-MoE-V3; their records'
`tiny_model`, mlx_gated_delta.layers.FAMILIES): patched and unpatched give
the same logits, within the layer contract, and the same greedy tokens;
prefill then token-by-token decode through the cache gives the full
forward's logits.

Ordinary pytest functions, run both by the repository's suite
(`tests/test_layer.py`, which also uses the helpers here) and by
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
from mlx_gated_delta.nn import (  # noqa: E402
    BailingKDA,
    GatedDeltaNet,
    KimiDeltaAttention,
    KimiK3DeltaAttention,
    OlmoHybridGatedDeltaNet,
    Qwen35GatedDeltaNet,
)
from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402

# The reviewed (id, fingerprint) pairs of the contracts these properties hold.
FINGERPRINTS = {
    "layer.mlx_lm_parity.v2.float32.logits": "292f83dfa1ee545ad6798b5d305fdb59b835f5de333d272d620938a09777e8f8",
    "layer.self_consistency.v2.float32.logits": "bf1dc95683ed3f1b553f16ca0db699a843503b691541bb12d7fde45296b4abd4",
}


def check(name, actual, expected, contract_id):
    return assert_matches(name, actual, expected, contract_id, FINGERPRINTS[contract_id])


FAMILY = {family.name: family for family in FAMILIES}


def family_model(name, seed=30, **options):
    """The tiny random (unpatched) mlx-lm model of the family `name`."""
    return FAMILY[name].tiny_model(seed, **options)


def tokens(seed, shape):
    return mx.random.randint(0, VOCAB, shape, key=mx.random.key(seed))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_patched_model_matches_mlx_lm_logits_and_greedy_tokens(kind):
    model = family_model(kind, 1)
    prompt = tokens(2, (1, 37))
    expected_logits = model(prompt)
    expected_tokens = [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)
        )
    ]
    assert patch_mlx_lm(model) == 3
    assert all(
        isinstance(layer.linear_attn, (GatedDeltaNet, Qwen35GatedDeltaNet))
        for layer in model.layers
        if layer.is_linear
    )
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    got_tokens = [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)
        )
    ]
    assert got_tokens == expected_tokens


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_prefill_then_token_by_token_decode_equals_full_forward(kind):
    model = family_model(kind, 4)
    patch_mlx_lm(model)
    sequence = tokens(5, (1, 24))
    full = model(sequence)
    cache = model.make_cache()
    pieces = [model(sequence[:, :17], cache=cache)]
    for t in range(17, 24):
        pieces.append(model(sequence[:, t : t + 1], cache=cache))
    check(
        "logits", mx.concatenate(pieces, axis=1), full, "layer.self_consistency.v2.float32.logits"
    )


@pytest.mark.parametrize("length", (63, 64, 65, 127, 128))
def test_extreme_decays_at_chunk_boundaries_match_mlx_lm(length):
    # Per value head: a decay near 1 (A_log = -12, rate 6e-6), a model-like
    # one and severe ones (A_log = 5.7, rate about 300: g = -300 softplus(.)
    # is below -104 per token, where exp(g) underflows to exactly 0 in
    # float32, wherever softplus(.) > 0.35).
    kind = "qwen3_next" if length % 2 else "qwen3_5"
    model = family_model(kind, length)
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.linear_attn
            attn.A_log = mx.array([-12.0, 0.0, 5.7, 5.7])[: attn.A_log.shape[0]]
    mx.eval(model.parameters())
    prompt = tokens(length, (2, length))
    expected = model(prompt)
    patch_mlx_lm(model)
    check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("allow_neg_eigval", (False, True))
def test_patched_olmo_hybrid_matches_mlx_lm_logits_and_greedy_tokens(allow_neg_eigval):
    # beta in [0, 2] with allow_neg_eigval: a layer that dropped the factor 2
    # (or applied it always) fails one of the two cases.
    model = family_model("olmo_hybrid", 3, allow_neg_eigval=allow_neg_eigval)
    prompt = tokens(6, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)
        )
    ]
    assert patch_mlx_lm(model) == 3
    assert all(
        isinstance(layer.linear_attn, OlmoHybridGatedDeltaNet)
        for layer in model.model.layers
        if hasattr(layer, "linear_attn")
    )
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    got_tokens = [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)
        )
    ]
    assert got_tokens == expected_tokens


def test_patched_olmo_hybrid_prefill_then_decode_equals_full_forward():
    model = family_model("olmo_hybrid", 7)
    patch_mlx_lm(model)
    sequence = tokens(8, (1, 24))
    full = model(sequence)
    cache = model.make_cache()
    pieces = [model(sequence[:, :17], cache=cache)]
    for t in range(17, 24):
        pieces.append(model(sequence[:, t : t + 1], cache=cache))
    check(
        "logits", mx.concatenate(pieces, axis=1), full, "layer.self_consistency.v2.float32.logits"
    )


def test_the_olmo_hybrid_check_sees_beta_in_zero_one_where_two_is_allowed():
    # Probe: with allow_neg_eigval the stock model's logits differ, beyond
    # the contract, from the same model whose layers keep beta in [0, 1].
    model = family_model("olmo_hybrid", 9, allow_neg_eigval=True)
    prompt = tokens(10, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.allow_neg_eigval = False
    with pytest.raises(AssertionError, match="violated"):
        check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


def test_patched_kimi_linear_matches_mlx_lm_logits_and_greedy_tokens():
    model = family_model("kimi_linear", 12)
    prompt = tokens(13, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)
        )
    ]
    assert patch_mlx_lm(model) == 3
    assert all(
        isinstance(layer.self_attn, KimiDeltaAttention) for layer in model.layers if layer.is_linear
    )
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    got_tokens = [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)
        )
    ]
    assert got_tokens == expected_tokens


def test_patched_kimi_linear_prefill_then_decode_equals_full_forward():
    model = family_model("kimi_linear", 14)
    patch_mlx_lm(model)
    sequence = tokens(15, (1, 24))
    full = model(sequence)
    cache = model.make_cache()
    pieces = [model(sequence[:, :17], cache=cache)]
    for t in range(17, 24):
        pieces.append(model(sequence[:, t : t + 1], cache=cache))
    check(
        "logits", mx.concatenate(pieces, axis=1), full, "layer.self_consistency.v2.float32.logits"
    )


def test_the_kimi_check_sees_dt_bias_read_once_per_head():
    # Probe for mlx-lm#1792's bug: dt_bias [H, Dk] read once per head (its
    # channel 0 for every channel) gives logits outside the contract around
    # the stock model's, so the parity test above would catch it.
    model = family_model("kimi_linear", 16)
    prompt = tokens(17, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.self_attn
            per_head = attn.dt_bias.reshape(attn.num_heads, attn.head_dim)[:, :1]
            attn.dt_bias = mx.repeat(per_head, attn.head_dim, axis=1).reshape(-1)
    with pytest.raises(AssertionError, match="violated"):
        check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


def _kda_layers(model):
    """Kimi-K3's and Bailing-MoE-V3's Kimi Delta Attention layers."""
    return [
        layer.self_attn if hasattr(layer, "self_attn") else layer.attention
        for layer in model.layers
        if layer.is_linear
    ]


def greedy_tokens(model, prompt, count=8):
    """`count` greedy tokens after `prompt` ([1, T]): mlx-lm's prefill of the
    prompt through the prompt cache, then one-token decode steps."""
    return [
        int(t)
        for t, _ in generate_step(
            prompt[0], model, max_tokens=count, sampler=lambda x: mx.argmax(x, -1)
        )
    ]


KIMI_K3_CASES = {
    "lower_bound": dict(lower_bound=-5.0),
    "no_lower_bound": dict(lower_bound=None),
    "full_rank_gate": dict(lower_bound=-3.0, full_rank_gate=True),
}


@pytest.mark.parametrize("case", sorted(KIMI_K3_CASES))
def test_patched_kimi_k3_matches_mlx_lm_logits_and_greedy_tokens(case):
    # With and without gate_lower_bound: a layer that ignored it (or always
    # applied it) fails one of the cases.
    model = family_model("kimi_k3", 20, **KIMI_K3_CASES[case])
    prompt = tokens(21, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = greedy_tokens(model, prompt)
    assert patch_mlx_lm(model) == 3
    assert all(isinstance(attn, KimiK3DeltaAttention) for attn in _kda_layers(model))
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    assert greedy_tokens(model, prompt) == expected_tokens


def test_patched_bailing_moe_v3_matches_mlx_lm_logits_and_greedy_tokens():
    model = family_model("bailing_moe_v3", 22)
    prompt = tokens(23, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = greedy_tokens(model, prompt)
    assert patch_mlx_lm(model) == 3
    assert all(isinstance(attn, BailingKDA) for attn in _kda_layers(model))
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    assert greedy_tokens(model, prompt) == expected_tokens


@pytest.mark.parametrize("family", ["kimi_k3", "bailing_moe_v3"])
def test_patched_kda_prefill_then_decode_equals_full_forward(family):
    model = family_model(family, 24)
    patch_mlx_lm(model)
    sequence = tokens(25, (1, 24))
    full = model(sequence)
    cache = model.make_cache()
    pieces = [model(sequence[:, :17], cache=cache)]
    for t in range(17, 24):
        pieces.append(model(sequence[:, t : t + 1], cache=cache))
    check(
        "logits", mx.concatenate(pieces, axis=1), full, "layer.self_consistency.v2.float32.logits"
    )


@pytest.mark.parametrize("family", ["kimi_k3", "bailing_moe_v3"])
def test_the_kda_checks_see_the_lower_bound_ignored(family):
    # Probe: the stock model's logits differ, beyond the contract, from the
    # same model whose layers drop the lower bound (Kimi-Linear's softplus
    # gate instead), so the parity tests above would catch it.
    model = family_model(family, 26)
    prompt = tokens(27, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for attn in _kda_layers(model):
        attn.lower_bound = None
    with pytest.raises(AssertionError, match="violated"):
        check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("family", ["kimi_k3", "bailing_moe_v3"])
def test_the_kda_checks_see_dt_bias_read_once_per_head(family):
    # Probe for mlx-lm#1792's bug on these layers: dt_bias [H, Dk] read once
    # per head (its channel 0 for every channel).
    model = family_model(family, 28)
    prompt = tokens(29, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for attn in _kda_layers(model):
        per_head = attn.dt_bias.reshape(attn.num_heads, attn.head_dim)[:, :1]
        attn.dt_bias = mx.repeat(per_head, attn.head_dim, axis=1).reshape(-1)
    with pytest.raises(AssertionError, match="violated"):
        check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_every_patched_family_gives_the_stock_greedy_tokens(family):
    # The six families, patched: every gated-delta layer replaced by ours,
    # and greedy generation (prefill of a prompt past one chunk, then
    # one-token decode steps) gives the stock model's tokens.
    model, layers = family_model(family), FAMILY[family].tiny_model_layers
    prompt = tokens(31, (1, 67))
    expected = greedy_tokens(model, prompt, count=12)
    assert patch_mlx_lm(model) == layers
    assert patch_mlx_lm(model) == 0  # no stock gated-delta layer is left
    assert greedy_tokens(model, prompt, count=12) == expected
