"""A layer called without a cache on at least twice `TOKEN_BLOCK` tokens runs
in token blocks (`mlx_gated_delta.layers.token_blocks`): one call's output
(on the CPU its bits) and its gradients within the split contract, for every
family's layer, with a mask, under LoRA (frozen weights) and in a compiled
step. A probe shows the comparisons catch a block that loses its entry
states.

Ordinary pytest functions on the default device, run by the repository's
`pytest` and by `python -m mlx_gated_delta selftest`; they need mlx-lm.
"""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip(
    "mlx_lm", reason='the layer properties need mlx-lm: pip install "mlx-gated-delta[mlx-lm]"'
)

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import ArraysCache  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from mlx_gated_delta import patch_mlx_lm  # noqa: E402
from mlx_gated_delta.layers import token_blocks  # noqa: E402
from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402
from mlx_gated_delta.tests.test_layers import FAMILY, family_model, our_layers  # noqa: E402

# 200 tokens in blocks of 64: two blocks of 64, and the last takes the 72
# left.
TOKENS = 200
BLOCK = 64


def first_layer(family, seed=3, lora=False):
    """The first of our layers in the family's patched tiny model (float32),
    its weights drawn; with `lora`, mlx-lm's LoRA adapters on its
    projections and everything else frozen."""
    model = family_model(family, seed)
    patch_mlx_lm(model)
    if lora:
        model.freeze()
        mx.random.seed(seed)
        linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 10.0, "dropout": 0.0})
        for _, module in model.named_modules():
            if "lora_b" in module:  # drawn, so lora_a has a gradient too
                module.lora_b = 0.05 * mx.random.normal(module.lora_b.shape)
    layer = our_layers(model, family)[0]
    mx.eval(layer.parameters())
    return layer


def hidden_size(layer):
    # The output projection's rows: quantization and LoRA keep them.
    projection = layer.out_proj if hasattr(layer, "out_proj") else layer.o_proj
    return (projection.linear if hasattr(projection, "linear") else projection).weight.shape[0]


def inputs(layer, seed=4, batch=2):
    """x [B, TOKENS, hidden] and a cotangent of the output, O(1)."""
    shape = (batch, TOKENS, hidden_size(layer))
    return (mx.random.normal(shape, key=mx.random.key(s)) for s in (seed, seed + 1))


def run(layer, x, cotangent, block, monkeypatch, mask=None):
    """The layer's output on x, and the gradients of sum(out * cotangent)
    with respect to x and the layer's trainable parameters (by name), with
    TOKEN_BLOCK = block (None: one call)."""
    monkeypatch.setattr(token_blocks, "TOKEN_BLOCK", block)
    params = layer.trainable_parameters()

    def loss(params, x):
        layer.update(params)
        return (layer(x, mask) * cotangent).sum()

    out = layer(x, mask)
    d_params, d_x = mx.grad(loss, argnums=(0, 1))(params, x)
    layer.update(params)
    d_params = dict(tree_flatten(d_params))
    mx.eval(out, d_x, d_params)
    return out, d_x, d_params


def assert_outputs_match(blocked, whole):
    """On the CPU the bits of one call: every block starts on a chunk
    boundary and runs the chunked core, and our CPU projection gives a row
    the same bits whatever rows come with it. Elsewhere (MLX's matmul, whose
    kernels may depend on the rows) one call's output within the layer's
    self-consistency contract."""
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(blocked[0], whole[0]).item()
    else:
        assert_matches("out", blocked[0], whole[0], "layer.self_consistency.v2.float32.logits")


def assert_gradients_match(blocked, whole):
    """x's and every parameter's gradient, blocked against one call: the
    same gradient summed in another order over calls that carry the
    states, the split contract."""
    _, d_x, d_params = blocked
    _, whole_d_x, whole_d_params = whole
    assert d_params.keys() == whole_d_params.keys() and d_params
    assert_matches("dx", d_x, whole_d_x, "segment_grad.split.v1.float32.input_grad")
    for name, grad in whole_d_params.items():
        assert float(mx.abs(grad).max()) > 0.0, name
        assert_matches(name, d_params[name], grad, "segment_grad.split.v1.float32.parameter_grad")


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_blocks_give_one_calls_output_bits_and_its_gradients(family, monkeypatch):
    layer = first_layer(family)
    x, cotangent = inputs(layer)
    whole = run(layer, x, cotangent, None, monkeypatch)
    blocked = run(layer, x, cotangent, BLOCK, monkeypatch)
    assert_outputs_match(blocked, whole)
    assert_gradients_match(blocked, whole)


@pytest.mark.parametrize("family", ["qwen3_5", "olmo_hybrid", "kimi_linear"])
def test_blocks_follow_the_mask(family, monkeypatch):
    # Left padding of 70 and 5 tokens: the mask crosses a block boundary.
    layer = first_layer(family)
    x, cotangent = inputs(layer)
    mask = mx.arange(TOKENS)[None] >= mx.array([[70], [5]])
    whole = run(layer, x, cotangent, None, monkeypatch, mask)
    blocked = run(layer, x, cotangent, BLOCK, monkeypatch, mask)
    assert_outputs_match(blocked, whole)
    assert_gradients_match(blocked, whole)


@pytest.mark.parametrize("family", ["qwen3_next", "bailing_moe_v3"])
def test_blocks_give_lora_adapters_their_gradients(family, monkeypatch):
    layer = first_layer(family, lora=True)
    x, cotangent = inputs(layer)
    whole = run(layer, x, cotangent, None, monkeypatch)
    blocked = run(layer, x, cotangent, BLOCK, monkeypatch)
    # Only the adapters train.
    assert blocked[2] and all("lora_" in name for name in blocked[2])
    assert_outputs_match(blocked, whole)
    assert_gradients_match(blocked, whole)


def test_probe_a_block_that_loses_its_entry_states_is_caught(monkeypatch):
    layer = first_layer("olmo_hybrid")
    x, cotangent = inputs(layer)
    whole = run(layer, x, cotangent, None, monkeypatch)
    monkeypatch.setattr(token_blocks._BlockCache, "__getitem__", lambda self, slot: None)
    blocked = run(layer, x, cotangent, BLOCK, monkeypatch)
    with pytest.raises(AssertionError):
        assert_outputs_match(blocked, whole)
    with pytest.raises(AssertionError, match="violated"):
        assert_gradients_match(blocked, whole)


def test_a_call_with_a_cache_or_of_one_block_is_one_call(monkeypatch):
    layer = first_layer("qwen3_next")
    x, _ = inputs(layer)
    blocks = []
    monkeypatch.setattr(token_blocks, "_BlockCache", lambda slots: blocks.append(slots))
    monkeypatch.setattr(token_blocks, "TOKEN_BLOCK", BLOCK)
    layer(x, None, ArraysCache(2))
    layer(x[:, : 2 * BLOCK - 1])
    assert blocks == []
    with pytest.raises(AttributeError):  # the stand-in cache has no slots
        layer(x)
    assert blocks == [None]


@pytest.mark.parametrize("block", [0, -64, 100])
def test_a_block_that_is_not_a_multiple_of_64_is_refused(block):
    layer = first_layer("qwen3_5")
    x, _ = inputs(layer)
    with pytest.raises(ValueError, match="multiple of 64"):
        token_blocks.in_token_blocks(layer, layer._mix, x, None, block)


def test_blocks_run_in_a_compiled_training_step(monkeypatch):
    layer = first_layer("kimi_linear")
    x, cotangent = inputs(layer)
    _, _, expected = run(layer, x, cotangent, BLOCK, monkeypatch)
    gradient = nn.value_and_grad(layer, lambda model, x: (model(x) * cotangent).sum())

    @partial(mx.compile, inputs=layer.state, outputs=layer.state)
    def step(x):
        return gradient(layer, x)[1]

    d_params = dict(tree_flatten(step(x)))
    assert d_params.keys() == expected.keys()
    for name, grad in expected.items():
        assert_matches(
            name, d_params[name], grad, "segment_grad.transforms.v1.float32.parameter_grad"
        )
