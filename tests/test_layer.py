"""The drop-in layers and `patch_mlx_lm` on tiny random mlx-lm models:
parity with mlx-lm's own layers, the cache (conv-state layout, batching with
padding, prompt caches), weight loading and quantization, errors. The layer's
property tests (patched vs mlx-lm's logits and greedy tokens, prefill + decode)
are shipped in mlx_gated_delta/tests/test_layers.py, so that
`python -m mlx_gated_delta selftest` runs them too. The tiny models are the family records'
(mlx_gated_delta.layers.FAMILIES)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models import qwen3_next  # noqa: E402
from mlx_lm.models.cache import ArraysCache, BatchKVCache  # noqa: E402

from mlx_gated_delta import nn as our_nn  # noqa: E402
from mlx_gated_delta import patch_mlx_lm  # noqa: E402
from mlx_gated_delta.layers import FAMILIES  # noqa: E402
from mlx_gated_delta.layers.families.qwen3_next import tiny_args  # noqa: E402
from mlx_gated_delta.nn import Qwen3NextGatedDeltaNet  # noqa: E402
from mlx_gated_delta.reference import gated_delta_segment_reference, to_float64  # noqa: E402
from mlx_gated_delta.testing.contracts import assert_matches, product_terms  # noqa: E402
from mlx_gated_delta.testing.segment_cases import segment_terms  # noqa: E402
from mlx_gated_delta.tests.test_layers import family_model, tokens  # noqa: E402

# ---------------------------------------------------------------------------
# The oracle is mlx-lm's layer math (checked independently of our C++).
# ---------------------------------------------------------------------------


def test_gated_delta_net_is_the_documented_alias_of_the_qwen3_next_layer():
    # docs/contract.md: code written against the old name keeps working.
    assert our_nn.GatedDeltaNet is Qwen3NextGatedDeltaNet
    assert "GatedDeltaNet" in our_nn.__all__


def test_segment_oracle_reproduces_mlx_lm_layer():
    mx.random.seed(0)
    stock = qwen3_next.Qwen3NextGatedDeltaNet(tiny_args())
    stock.dt_bias = mx.random.normal((4,))
    stock.norm.weight = mx.random.uniform(0.5, 1.5, (8,))
    # Without its output projection the layer returns the segment's out.
    stock.out_proj = nn.Identity()
    x = mx.random.normal((2, 11, 64))
    expected = stock(x).reshape(2, 11, 4, 8)
    # Packed input from mlx-lm's own reordering, not from ours.
    q, k, v, z, b, a = stock.fix_query_key_value_ordering(
        stock.in_proj_qkvz(x), stock.in_proj_ba(x)
    )
    packed = mx.concatenate([t.reshape(2, 11, -1) for t in (q, k, v, z, b, a)], axis=-1)
    out, _, _ = gated_delta_segment_reference(
        packed,
        stock.conv1d.weight,
        stock.A_log,
        stock.dt_bias,
        stock.norm.weight,
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
    )
    # mlx-lm's layer is a float32 computation of the same math, token by
    # token: within the float32 contract of the exact result.
    terms, _ = segment_terms(
        packed,
        stock.conv1d.weight,
        stock.A_log,
        stock.dt_bias,
        stock.norm.weight,
        algorithm="recurrent",
        key_heads=2,
        value_heads=4,
        key_dim=16,
        value_dim=8,
    )
    assert_matches("out", expected, out, "segment.oracle.v3.float32.output", terms)


# ---------------------------------------------------------------------------
# Patched against mlx-lm's own layers.
# ---------------------------------------------------------------------------


def test_patch_keeps_the_parameter_tree_and_arrays():
    model = family_model("qwen3_next", 3)
    before = dict(tree_flatten(model.parameters()))
    patch_mlx_lm(model)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    assert all(before[name] is after[name] for name in before)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_batched_with_left_padding_equals_unbatched(kind):
    model = family_model(kind, 6)
    patch_mlx_lm(model)
    lengths = [13, 6, 9]
    width = max(lengths)
    prompts = [tokens(10 + i, (n,)) for i, n in enumerate(lengths)]
    padding = [width - n for n in lengths]
    padded = mx.stack(
        [
            mx.concatenate([mx.zeros((p,), mx.int32), t.astype(mx.int32)])
            for p, t in zip(padding, prompts)
        ]
    )
    cache = [
        ArraysCache(2, left_padding=padding) if layer.is_linear else BatchKVCache(padding)
        for layer in model.layers
    ]
    batched = model(padded, cache=cache)
    step = tokens(20, (3, 1))
    batched_next = model(step, cache=cache)
    for row, (prompt, p) in enumerate(zip(prompts, padding)):
        single_cache = model.make_cache()
        single = model(prompt[None], cache=single_cache)
        single_next = model(step[row : row + 1], cache=single_cache)
        assert_matches(
            f"row {row} prompt",
            batched[row : row + 1, p:],
            single,
            "layer.self_consistency.v2.float32.logits",
        )
        assert_matches(
            f"row {row} next",
            batched_next[row : row + 1],
            single_next,
            "layer.self_consistency.v2.float32.logits",
        )


def greedy_batch(model, prompts, max_tokens):
    """mlx-lm's continuous batching (left padding, lengths) on token lists."""
    generator = BatchGenerator(
        model, max_tokens=max_tokens, prefill_batch_size=4, completion_batch_size=4
    )
    uids = generator.insert(prompts)
    generated = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            generated[response.uid].append(response.token)
    generator.close()
    return [generated[uid] for uid in uids]


def greedy(model, prompt, max_tokens, prompt_cache=None):
    return [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=max_tokens,
            sampler=lambda x: mx.argmax(x, -1),
            prompt_cache=prompt_cache,
        )
    ]


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_batch_generator_gives_mlx_lm_tokens_and_the_unbatched_ones(kind):
    model = family_model(kind, 21)
    prompts = [[int(t) for t in tokens(30 + i, (n,))] for i, n in enumerate([9, 3, 17])]
    expected = greedy_batch(model, prompts, 6)
    patch_mlx_lm(model)
    assert greedy_batch(model, prompts, 6) == expected
    assert [greedy(model, p, 6) for p in prompts] == expected


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3", "bailing_moe_v3"])
def test_kda_batch_generator_gives_mlx_lm_tokens_and_the_unbatched_ones(family):
    # Continuous batching runs the KDA layers with mlx-lm's masks (left
    # padding) and lengths-aware conv states.
    model = family_model(family, 40)
    prompts = [[int(t) for t in tokens(41 + i, (n,))] for i, n in enumerate([9, 3, 17])]
    expected = greedy_batch(model, prompts, 6)
    assert patch_mlx_lm(model) == 3
    assert greedy_batch(model, prompts, 6) == expected
    assert [greedy(model, p, 6) for p in prompts] == expected


def test_prompt_cache_across_turns_gives_mlx_lm_tokens():
    model = family_model("qwen3_next", 22)
    turns = [[int(t) for t in tokens(40 + i, (n,))] for i, n in enumerate([11, 5])]

    def conversation():
        cache = model.make_cache()
        return [greedy(model, turn, 5, prompt_cache=cache) for turn in turns]

    expected = conversation()
    patch_mlx_lm(model)
    assert conversation() == expected


def test_cache_matches_mlx_lm_layout_and_lengths_handling():
    # Same layer, mlx-lm's and ours, on a batch where cache.lengths ends the
    # rows early (mlx-lm's batched prefill): the same conv states (the same
    # projected inputs), states and valid outputs.
    mx.random.seed(7)
    stock = qwen3_next.Qwen3NextGatedDeltaNet(tiny_args())
    ours = Qwen3NextGatedDeltaNet(tiny_args())
    ours.update(stock.parameters())
    x = mx.random.normal((2, 9, 64))
    stock_cache, our_cache = ArraysCache(2), ArraysCache(2)
    stock_cache.prepare(lengths=[9, 5])
    our_cache.prepare(lengths=[9, 5])
    mask = stock_cache.make_mask(9)
    stock_out = stock(x, mask=mask, cache=stock_cache)
    our_out = ours(x, mask=mask, cache=our_cache)
    assert our_cache[0].shape == stock_cache[0].shape == (2, 3, 2 * 2 * 16 + 4 * 8)
    assert our_cache[0].dtype == stock_cache[0].dtype
    # Projections computed by different kernels: float32 rounding apart.
    assert_matches(
        "conv_state", our_cache[0], stock_cache[0], "layer.mlx_lm_parity.v2.float32.logits"
    )
    assert_matches("state", our_cache[1], stock_cache[1], "layer.mlx_lm_parity.v1.float32.state")
    valid = np.asarray(mask)
    assert_matches(
        "out",
        to_float64(our_out)[valid][None],
        to_float64(stock_out)[valid][None],
        "layer.mlx_lm_parity.v2.float32.logits",
    )


@pytest.mark.parametrize("first", ["ours", "mlx-lm"])
def test_a_cache_filled_by_one_layer_continues_in_the_other(first):
    # The cache layout is mlx-lm's: prefill with one implementation, decode
    # with the other, and get what either gives alone.
    mx.random.seed(14)
    stock = qwen3_next.Qwen3NextGatedDeltaNet(tiny_args())
    ours = Qwen3NextGatedDeltaNet(tiny_args())
    ours.update(stock.parameters())
    prefill, decode = mx.random.normal((2, 10, 64)), mx.random.normal((2, 3, 64))
    layers = {"ours": ours, "mlx-lm": stock}
    second = "mlx-lm" if first == "ours" else "ours"
    mixed_cache, plain_cache = ArraysCache(2), ArraysCache(2)
    layers[first](prefill, cache=mixed_cache)
    mixed = layers[second](decode, cache=mixed_cache)
    layers[second](prefill, cache=plain_cache)
    plain = layers[second](decode, cache=plain_cache)
    assert_matches("decode", mixed, plain, "layer.mlx_lm_parity.v2.float32.logits")
    assert_matches("state", mixed_cache[1], plain_cache[1], "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_family_keeps_mlx_lm_s_parameter_tree_fresh_and_patched(family):
    # Our layer built from the stock layer's settings has mlx-lm's parameter
    # names and shapes (checkpoints load into it), and patching keeps the
    # model's tree and its very arrays.
    model = family.tiny_model(30)
    stock = [m for _, m in model.named_modules() if type(m) is family.mlx_lm_layer()]
    assert len(stock) == family.tiny_model_layers
    for layer in stock:
        fresh = family.layer(family.config_from_layer(layer))
        shapes = {name: a.shape for name, a in tree_flatten(layer.parameters())}
        assert {name: a.shape for name, a in tree_flatten(fresh.parameters())} == shapes
    before = dict(tree_flatten(model.parameters()))
    patch_mlx_lm(model)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    assert all(before[name] is after[name] for name in before)


@pytest.mark.parametrize("family", ["kimi_k3", "bailing_moe_v3"])
def test_quantized_kda_model_patched_matches_quantized_mlx_lm(family):
    def quantized():
        model = family_model(family)
        # Every module whose input dim fits the group size (f_b_proj and
        # g_b_proj read 16 dims: left in float32).
        nn.quantize(
            model,
            group_size=32,
            bits=8,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
            ),
        )
        return model

    prompt = tokens(12, (1, 20))
    expected = quantized()(prompt)
    patched = quantized()
    assert patch_mlx_lm(patched) == 3
    attention = [m for _, m in patched.named_modules() if hasattr(m, "lower_bound")]
    assert len(attention) == 3
    assert all(isinstance(a.o_proj, nn.QuantizedLinear) for a in attention)
    assert_matches("logits", patched(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("lower_bound", (None, -5.0))
def test_kda_log_decay_is_mlx_lms_gate_in_float64(lower_bound):
    # The gates the segment forms, as MLX ops: dt_bias read per head and key
    # channel, float32 against the float64 formula.
    rng = np.random.default_rng(7)
    heads, dim = 3, 8
    f = rng.standard_normal((2, 5, heads, dim)).astype(np.float32)
    a_log = rng.standard_normal(heads).astype(np.float32)
    dt_bias = rng.standard_normal(heads * dim).astype(np.float32)
    with mx.stream(mx.cpu):
        g = our_nn.kda_log_decay(mx.array(f), mx.array(a_log), mx.array(dt_bias), lower_bound)
    logits = f.astype(np.float64) + dt_bias.reshape(heads, dim).astype(np.float64)
    rate = np.exp(a_log.astype(np.float64))[:, None]
    if lower_bound is None:
        expected = -rate * np.log1p(np.exp(logits))
    else:
        expected = lower_bound / (1.0 + np.exp(-rate * logits))
    assert g.dtype == mx.float32 and g.shape == f.shape
    np.testing.assert_allclose(np.array(g), expected, rtol=1e-5, atol=1e-6)


def test_load_weights_after_patching_reaches_the_patched_layers():
    source = family_model("qwen3_next", 8)
    prompt = tokens(9, (1, 12))
    expected = source(prompt)
    target = family_model("qwen3_next", 99)
    patch_mlx_lm(target)
    before = target(prompt)  # the packed projection is built from seed 99
    target.load_weights(list(tree_flatten(source.parameters())))
    assert not np.allclose(to_float64(before), to_float64(expected))
    assert_matches("logits", target(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


@pytest.mark.parametrize("patch_first", [False, True])
def test_quantized_model_patched_matches_quantized_mlx_lm(patch_first):
    model = family_model("qwen3_next", 11)
    nn.quantize(model, group_size=32, bits=8)
    prompt = tokens(12, (1, 20))
    expected = model(prompt)
    patched = family_model("qwen3_next", 11)
    if patch_first:  # quantizing replaces the arrays the packed weight came from
        patch_mlx_lm(patched)
        patched(prompt)
        nn.quantize(patched, group_size=32, bits=8)
    else:
        nn.quantize(patched, group_size=32, bits=8)
        patch_mlx_lm(patched)
    attention = patched.layers[0].linear_attn
    assert isinstance(attention, Qwen3NextGatedDeltaNet)
    assert isinstance(attention.in_proj_qkvz, nn.QuantizedLinear)
    assert isinstance(attention.out_proj, nn.QuantizedLinear)
    assert_matches("logits", patched(prompt), expected, "layer.mlx_lm_parity.v2.float32.logits")


def test_patch_errors_for_a_model_without_gated_delta_layers():
    with pytest.raises(ValueError, match="no Gated DeltaNet layer"):
        patch_mlx_lm(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_the_gated_delta_rule_finds_exactly_mlx_lm_s_six_layer_classes():
    # patch_mlx_lm tells a gated-delta layer by its methods calling mlx-lm's
    # recurrence: over every module class of every mlx-lm model file, that
    # rule picks exactly the six layer classes it replaces, no other.
    import importlib
    import inspect
    import pkgutil

    import mlx_lm.models

    from mlx_gated_delta.patch import _calls_a_recurrence, _replacements

    found = set()
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (ImportError, SystemExit):  # an optional dependency is missing
            continue  # (mlx-lm's olmo.py exits without ai2-olmo)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, nn.Module):
                if _calls_a_recurrence(cls):
                    found.add(cls)
    assert found == set(_replacements())


class _Subclassed(qwen3_next.Qwen3NextGatedDeltaNet):
    """A user's subclass of a stock layer: it may compute something else."""

    def __call__(self, inputs, mask=None, cache=None):
        return 2 * super().__call__(inputs, mask, cache)


class _OwnRecurrence(nn.Module):
    """A gated-delta layer patch_mlx_lm does not know: it calls mlx-lm's
    recurrence itself."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)

    def __call__(self, x, mask=None, cache=None):
        from mlx_lm.models.gated_delta import gated_delta_update

        q = self.proj(x).reshape(*x.shape[:2], 2, 32)
        out, _ = gated_delta_update(
            q, q, q, q[..., 0], q[..., 0], mx.zeros(2), mx.zeros(2), mask=mask
        )
        return out.reshape(x.shape)


class _StaticRecurrence(nn.Module):
    """A gated-delta layer whose only call of a recurrence (MLX's) is in a
    static method: found there too."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)

    def __call__(self, x, mask=None, cache=None):
        return self._step(self.proj(x), mask)

    @staticmethod
    def _step(x, mask):
        out, _ = mx.fast.gated_delta_update(
            x[..., None, :], x[..., None, :], x[..., None, :], x[..., :1], x[..., :1]
        )
        return out[..., 0, :]


@pytest.mark.parametrize(
    "unknown, reason",
    [
        (lambda: _Subclassed(tiny_args()), "a subclass of mlx-lm's"),
        (_OwnRecurrence, "calls mlx-lm's gated-delta recurrence"),
        (_StaticRecurrence, "calls mlx-lm's gated-delta recurrence"),
    ],
)
def test_patch_refuses_a_gated_delta_layer_it_does_not_know_naming_it(unknown, reason):
    # Layer 2 of a Qwen3-Next model becomes a gated-delta layer of a class
    # patch_mlx_lm does not know: it raises, naming that layer, its class and
    # why, and replaces none of the model's layers (no half-patched model).
    model = family_model("qwen3_next", 17)
    model.model.layers[2].linear_attn = unknown()
    name = type(model.model.layers[2].linear_attn).__qualname__
    with pytest.raises(ValueError, match="does not know") as raised:
        patch_mlx_lm(model)
    message = str(raised.value)
    assert "model.layers.2.linear_attn" in message
    assert name in message and reason in message
    assert "nothing was replaced" in message
    assert all(
        type(layer.linear_attn) is not Qwen3NextGatedDeltaNet
        for layer in model.layers
        if layer.is_linear
    )


def test_the_unknown_layer_check_leaves_other_modules_alone():
    # Probe for the check above: the same model with a plain module (no
    # recurrence) in that place patches the other layers without complaint.
    model = family_model("qwen3_next", 17)
    model.model.layers[2].linear_attn = nn.Linear(64, 64, bias=False)
    assert patch_mlx_lm(model) == 2


def test_patching_twice_replaces_nothing_more():
    model = family_model("qwen3_next", 13)
    assert patch_mlx_lm(model) == 3
    assert patch_mlx_lm(model) == 0


def test_layer_rejects_head_counts_that_do_not_divide():
    args = tiny_args()
    args.linear_num_value_heads = 3
    with pytest.raises(ValueError, match="multiple"):
        Qwen3NextGatedDeltaNet(args)


@pytest.mark.parametrize("family", ("qwen3_next", "qwen3_5"))
def test_a_long_call_projects_through_gathered_weights(family):
    # A call with more rows than the hidden size projects once through the
    # weights gathered into mixed_qkvzba's order; a short one concatenates
    # and reorders the modules' outputs. Each column of the row is the same
    # product of the same kernel, so the rows are the same bits; the
    # gradients are float32 products summed in another order (one product
    # over all columns for x's), each held to the projection's contract
    # against float64.
    model = family_model(family, 23)
    patch_mlx_lm(model)
    layer = next(m for _, m in model.named_modules() if hasattr(m, "mixed_qkvzba"))
    modules = layer._projection_modules()
    hidden = layer.hidden_size
    x = mx.random.normal((2, hidden // 2 + 1, hidden), key=mx.random.key(3))
    assert x.size // hidden > hidden  # mixed_qkvzba takes the gathered weights
    row = layer.mixed_qkvzba(x)
    assert np.array_equal(np.array(row), np.array(layer._project_by_modules(x)))

    cotangent = mx.random.normal(row.shape, key=mx.random.key(4))

    def loss(weights, x):
        for m, w in zip(modules, weights):
            m.weight = w
        return (layer._project_through_gathered_weights(x) * cotangent).sum()

    weights = [m.weight for m in modules]
    d_weights, dx = mx.grad(loss, argnums=(0, 1))(weights, x)
    for m, w in zip(modules, weights):
        m.weight = w

    # float64: the gathered weight's gradient, scattered back to the modules.
    columns = layer._mixed_qkvzba_columns()
    order = np.arange(row.shape[-1]) if columns is None else np.array(columns)
    weight64 = np.concatenate([to_float64(w) for w in weights])[order]
    x64 = to_float64(x).reshape(-1, hidden)
    cotangent64 = to_float64(cotangent).reshape(-1, row.shape[-1])
    d_weight64 = np.zeros_like(weight64)
    d_weight64[order] = cotangent64.T @ x64
    starts = np.cumsum([0] + [w.shape[0] for w in weights])
    d_weight_terms = np.zeros_like(weight64)
    d_weight_terms[order] = product_terms(cotangent64.T, x64)
    dx_terms = product_terms(cotangent64, weight64).reshape(x.shape)
    contract = "projection.linear.v3.float32.output"
    assert_matches("dx", dx, (cotangent64 @ weight64).reshape(x.shape), contract, terms=dx_terms)
    for i, d_weight in enumerate(d_weights):
        part = slice(starts[i], starts[i + 1])
        terms = d_weight_terms[part]
        assert_matches(f"d weight {i}", d_weight, d_weight64[part], contract, terms=terms)
