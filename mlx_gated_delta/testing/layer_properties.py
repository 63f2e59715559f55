"""Property tests of the drop-in layer (docs/contract.md) on tiny random
mlx-lm models of the six gated-delta families (Qwen3-Next, Qwen3.5,
OLMo-Hybrid, Kimi-Linear, Kimi-K3, Bailing-MoE-V3): patched and unpatched give the same
logits, within the layer contract, and the same greedy tokens; prefill then
token-by-token decode through the cache gives the full forward's logits.

Ordinary pytest functions, run both by the repository's suite
(`tests/test_layer.py`, which also uses the model builders here) and by
`python -m mlx_gated_delta selftest`, on the default device. They need mlx-lm
(`pip install "mlx-gated-delta[mlx-lm]"`) and are skipped without it.
"""

import mlx.core as mx
import pytest

pytest.importorskip(
    "mlx_lm", reason='the layer properties need mlx-lm: pip install "mlx-gated-delta[mlx-lm]"'
)

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import (  # noqa: E402
    bailing_moe_v3,
    kimi_k3,
    kimi_linear,
    olmo_hybrid,
    qwen3_5,
    qwen3_next,
)

from mlx_gated_delta import patch_mlx_lm  # noqa: E402
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


VOCAB = 128

LINEAR_HEADS = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def next_args(layers=4):
    return qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=512,
        **LINEAR_HEADS,
    )


def qwen35_model(layers=4):
    text = dict(
        model_type="qwen3_5_text",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        **LINEAR_HEADS,
    )
    return qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))


def build(kind, seed):
    mx.random.seed(seed)
    model = qwen3_next.Model(next_args()) if kind == "qwen3_next" else qwen35_model()
    # mlx-lm initializes dt_bias and the norm weight to ones: draw them, so a
    # mix-up of heads or of value dims shows in the output.
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.linear_attn
            attn.dt_bias = mx.random.normal(attn.dt_bias.shape)
            attn.norm.weight = mx.random.uniform(0.5, 1.5, attn.norm.weight.shape)
    mx.eval(model.parameters())
    return model


def tokens(seed, shape):
    return mx.random.randint(0, VOCAB, shape, key=mx.random.key(seed))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_patched_model_matches_mlx_lm_logits_and_greedy_tokens(kind):
    model = build(kind, 1)
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
    model = build(kind, 4)
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
    model = build(kind, length)
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.linear_attn
            attn.A_log = mx.array([-12.0, 0.0, 5.7, 5.7])[: attn.A_log.shape[0]]
    mx.eval(model.parameters())
    prompt = tokens(length, (2, length))
    expected = model(prompt)
    patch_mlx_lm(model)
    check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


def olmo_hybrid_model(allow_neg_eigval, seed, layers=4):
    """A tiny random OLMo-Hybrid model (layer 3 full attention, the others
    Gated DeltaNet), with its gate parameters drawn."""
    mx.random.seed(seed)
    args = olmo_hybrid.ModelArgs(
        model_type="olmo_hybrid",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        linear_allow_neg_eigval=allow_neg_eigval,
        tie_word_embeddings=False,
        attention_bias=False,
        **LINEAR_HEADS,
    )
    model = olmo_hybrid.Model(args)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            attn = layer.linear_attn
            attn.A_log = mx.random.normal(attn.A_log.shape)
            attn.dt_bias = mx.random.normal(attn.dt_bias.shape)
            attn.o_norm.weight = mx.random.uniform(0.5, 1.5, attn.o_norm.weight.shape)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("allow_neg_eigval", (False, True))
def test_patched_olmo_hybrid_matches_mlx_lm_logits_and_greedy_tokens(allow_neg_eigval):
    # beta in [0, 2] with allow_neg_eigval: a layer that dropped the factor 2
    # (or applied it always) fails one of the two cases.
    model = olmo_hybrid_model(allow_neg_eigval, 3)
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
    model = olmo_hybrid_model(True, 7)
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
    model = olmo_hybrid_model(True, 9)
    prompt = tokens(10, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.allow_neg_eigval = False
    with pytest.raises(AssertionError, match="violated"):
        check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


def kimi_linear_model(seed):
    """A tiny random Kimi-Linear model: layers 1, 2 and 4 Kimi Delta
    Attention (per-key-channel gates), layer 3 MLA; A_log and the per head
    and channel dt_bias drawn."""
    mx.random.seed(seed)
    args = kimi_linear.ModelArgs(
        model_type="kimi_linear",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        model_max_length=512,
        num_experts=0,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4],
        },
    )
    model = kimi_linear.Model(args)
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.self_attn
            attn.A_log = mx.random.normal(attn.A_log.shape)
            attn.dt_bias = 2.0 * mx.random.normal(attn.dt_bias.shape)
            attn.o_norm.weight = mx.random.uniform(0.5, 1.5, attn.o_norm.weight.shape)
    mx.eval(model.parameters())
    return model


def test_patched_kimi_linear_matches_mlx_lm_logits_and_greedy_tokens():
    model = kimi_linear_model(12)
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
    model = kimi_linear_model(14)
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
    model = kimi_linear_model(16)
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


def kimi_k3_model(seed, lower_bound=-5.0, full_rank_gate=False):
    """A tiny random Kimi-K3 model: layers 1, 2 and 4 Kimi Delta Attention
    (one q|k|v projection and convolution, per-key-channel gates,
    lower-bounded unless `lower_bound` is None), layer 3 MLA; A_log and the
    per head and channel dt_bias drawn."""
    mx.random.seed(seed)
    linear = {
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "use_full_rank_gate": full_rank_gate,
    }
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    text = dict(
        model_type="kimi_k3",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        linear_attn_config=linear,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=0,
    )
    model = kimi_k3.Model(kimi_k3.ModelArgs(model_type="kimi_k3", text_config=text))
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.self_attn
            attn.A_log = mx.random.normal(attn.A_log.shape)
            attn.dt_bias = 2.0 * mx.random.normal(attn.dt_bias.shape)
            attn.o_norm.weight = mx.random.uniform(0.5, 1.5, attn.o_norm.weight.shape)
    mx.eval(model.parameters())
    return model


def bailing_moe_v3_model(seed):
    """A tiny random Bailing-MoE-V3 model: layers 0 to 2 Kimi Delta Attention
    (full-rank `f_proj` gates, lower-bounded at -5), layer 3 MLA, layer 0 a
    dense MLP and the others mixtures of experts; A_log and the per head and
    channel dt_bias drawn."""
    mx.random.seed(seed)
    args = bailing_moe_v3.ModelArgs(
        model_type="bailing_moe_v3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        layer_group_size=4,
        head_dim=16,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_lower_bound=-5.0,
        max_position_embeddings=512,
    )
    model = bailing_moe_v3.Model(args)
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.attention
            attn.A_log = mx.random.normal(attn.A_log.shape)
            attn.dt_bias = 2.0 * mx.random.normal(attn.dt_bias.shape)
            attn.o_norm.weight = mx.random.uniform(0.5, 1.5, attn.o_norm.weight.shape)
    mx.eval(model.parameters())
    return model


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
    model = kimi_k3_model(20, **KIMI_K3_CASES[case])
    prompt = tokens(21, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = greedy_tokens(model, prompt)
    assert patch_mlx_lm(model) == 3
    assert all(isinstance(attn, KimiK3DeltaAttention) for attn in _kda_layers(model))
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    assert greedy_tokens(model, prompt) == expected_tokens


def test_patched_bailing_moe_v3_matches_mlx_lm_logits_and_greedy_tokens():
    model = bailing_moe_v3_model(22)
    prompt = tokens(23, (1, 70))
    expected_logits = model(prompt)
    expected_tokens = greedy_tokens(model, prompt)
    assert patch_mlx_lm(model) == 3
    assert all(isinstance(attn, BailingKDA) for attn in _kda_layers(model))
    check("logits", model(prompt), expected_logits, "layer.mlx_lm_parity.v2.float32.logits")
    assert greedy_tokens(model, prompt) == expected_tokens


@pytest.mark.parametrize("family", ["kimi_k3", "bailing_moe_v3"])
def test_patched_kda_prefill_then_decode_equals_full_forward(family):
    model = kimi_k3_model(24) if family == "kimi_k3" else bailing_moe_v3_model(24)
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
    model = kimi_k3_model(26) if family == "kimi_k3" else bailing_moe_v3_model(26)
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
    model = kimi_k3_model(28) if family == "kimi_k3" else bailing_moe_v3_model(28)
    prompt = tokens(29, (1, 40))
    expected = model(prompt)
    patch_mlx_lm(model)
    for attn in _kda_layers(model):
        per_head = attn.dt_bias.reshape(attn.num_heads, attn.head_dim)[:, :1]
        attn.dt_bias = mx.repeat(per_head, attn.head_dim, axis=1).reshape(-1)
    with pytest.raises(AssertionError, match="violated"):
        check("logits", model(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


# Every family mlx-lm runs gated delta in: a tiny random model from a seed,
# and its number of gated-delta layers.
FAMILIES = {
    "qwen3_next": (lambda seed: build("qwen3_next", seed), 3),
    "qwen3_5": (lambda seed: build("qwen3_5", seed), 3),
    "olmo_hybrid": (lambda seed: olmo_hybrid_model(True, seed), 3),
    "kimi_linear": (kimi_linear_model, 3),
    "kimi_k3": (kimi_k3_model, 3),
    "bailing_moe_v3": (bailing_moe_v3_model, 3),
}


def family_model(family, seed=30):
    """A tiny random (unpatched) mlx-lm model of one of the `FAMILIES`."""
    builder, _ = FAMILIES[family]
    return builder(seed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_patched_family_gives_the_stock_greedy_tokens(family):
    # The six families, patched: every gated-delta layer replaced by ours,
    # and greedy generation (prefill of a prompt past one chunk, then
    # one-token decode steps) gives the stock model's tokens.
    model, layers = family_model(family), FAMILIES[family][1]
    prompt = tokens(31, (1, 67))
    expected = greedy_tokens(model, prompt, count=12)
    assert patch_mlx_lm(model) == layers
    assert patch_mlx_lm(model) == 0  # no stock gated-delta layer is left
    assert greedy_tokens(model, prompt, count=12) == expected
