"""The drop-in layers in training mode (docs/contract.md, gradients): a patched tiny
mlx-lm model's parameter gradients equal the stock model's, mlx-lm's LoRA
tuner works on it (plain and quantized), a LoRA run in the style of
`mlx_lm.lora` follows the stock model's loss curve, and an `mx.compile`d
training step that updates the parameters in place leaves no stale weight.
The backward runs on the CPU, so everything here does."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from functools import partial  # noqa: E402

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import qwen3_next  # noqa: E402
from mlx_lm.tuner.lora import LoRALinear  # noqa: E402
from mlx_lm.tuner.trainer import default_loss  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from mlx_gated_delta import patch_mlx_lm  # noqa: E402
from mlx_gated_delta.layers.families.qwen3_next import tiny_args  # noqa: E402
from mlx_gated_delta.nn import GatedDeltaNet, Qwen35GatedDeltaNet  # noqa: E402
from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402
from mlx_gated_delta.tests.test_layers import FAMILY, family_model, tokens  # noqa: E402

KINDS = ("qwen3_next", "qwen3_5")
LORA = {"rank": 4, "scale": 10.0, "dropout": 0.0}


@pytest.fixture(autouse=True)
def on_the_cpu():
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def build_dense_routing_qwen3_next(seed):
    """The tiny Qwen3-Next model with every expert active: its
    top-2-of-4 routing is a discontinuous function of the weights, and a
    float32-level difference that flips one token's expert choice moves the
    loss by far more than any gradient error; with all experts routed the
    model is smooth in its weights."""
    args = tiny_args()
    args.num_experts_per_tok = args.num_experts
    mx.random.seed(seed)
    model = qwen3_next.Model(args)
    for attn in linear_attention_layers(model):
        attn.dt_bias = mx.random.normal(attn.dt_bias.shape)
        attn.norm.weight = mx.random.uniform(0.5, 1.5, attn.norm.weight.shape)
    mx.eval(model.parameters())
    return model


def quantizable(_path, module):
    """nn.quantize's own test, for modules whose input dim fits its group
    size of 32 (the KDA layers' f_b_proj and g_b_proj read 16 dims: left in
    float32)."""
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % 32 == 0


def stock_and_patched(kind, seed, quantize=False, lora=False):
    models = []
    for patched in (False, True):
        if kind == "qwen3_next_all_experts":
            model = build_dense_routing_qwen3_next(seed)
        else:
            model = family_model(kind, seed)
        if quantize:
            nn.quantize(model, group_size=32, bits=4, class_predicate=quantizable)
        if patched:
            assert patch_mlx_lm(model) == 3
        if lora:
            model.freeze()
            mx.random.seed(seed + 1)  # the same LoRA initialization on both
            linear_to_lora_layers(model, len(model.layers), LORA)
            # LoRA starts with lora_b = 0, where lora_a's gradient is 0: draw
            # it, so both factors of every adapter have a gradient to compare.
            for _name, module in sorted(model.named_modules(), key=lambda item: item[0]):
                if "lora_b" in module:
                    module.lora_b = 0.05 * mx.random.normal(module.lora_b.shape)
        model.train()
        models.append(model)
    return models


def linear_attention_layers(model):
    return [layer.linear_attn for layer in model.layers if layer.is_linear]


def batch(seed, shape=(2, 33)):
    sequence = tokens(seed, shape)
    lengths = mx.array([[0, shape[1] - 1]] * shape[0])
    return sequence, lengths


def gradients(model, sequence, lengths):
    (loss, _), grads = nn.value_and_grad(model, default_loss)(model, sequence, lengths)
    mx.eval(loss, grads)
    return float(loss), dict(tree_flatten(grads))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setup", ("full", "lora", "quantized_lora"))
def test_patched_parameter_gradients_equal_the_stock_models(kind, setup):
    stock, ours = stock_and_patched(
        kind, 3, quantize=setup == "quantized_lora", lora=setup != "full"
    )
    layers = linear_attention_layers(ours)
    assert all(isinstance(layer, (GatedDeltaNet, Qwen35GatedDeltaNet)) for layer in layers)
    if setup != "full":
        # The tuner wrapped our layers' projections.
        assert all(isinstance(layer.out_proj, LoRALinear) for layer in layers)
    sequence, lengths = batch(4)
    stock_loss, stock_grads = gradients(stock, sequence, lengths)
    our_loss, our_grads = gradients(ours, sequence, lengths)
    assert stock_grads.keys() == our_grads.keys()
    assert any(".linear_attn." in name for name in our_grads)
    for name, grad in stock_grads.items():
        assert float(mx.abs(grad).max()) > 0.0, name  # every gradient is compared
        assert_matches(
            name, our_grads[name], grad, "layer_grad.mlx_lm_parity.v1.float32.parameter_grad"
        )
    assert abs(our_loss - stock_loss) <= 1e-5 * abs(stock_loss)


def lora_run(model, steps=20, seed=7):
    """`steps` steps of Adam on the LoRA parameters, compiled like
    mlx_lm.tuner.trainer's step; returns the loss of each step."""
    optimizer = optim.Adam(learning_rate=1e-4)
    loss_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(sequence, lengths):
        (loss, _), grads = loss_and_grad(model, sequence, lengths)
        optimizer.update(model, grads)
        return loss

    # A small fixed data set, cycled, so the loss goes down.
    data = [batch(seed + i, (4, 25)) for i in range(4)]
    losses = []
    for i in range(steps):
        loss = step(*data[i % len(data)])
        mx.eval(state)
        losses.append(float(loss))
    return np.array(losses)


# Qwen3.5's MLP is dense; Qwen3-Next's is routed to all experts (see
# build_dense_routing_qwen3_next).
@pytest.mark.parametrize("kind", ("qwen3_next_all_experts", "qwen3_5"))
def test_a_lora_run_follows_the_stock_models_loss_curve(kind):
    stock, ours = stock_and_patched(kind, 5, lora=True)
    stock_curve = lora_run(stock)
    our_curve = lora_run(ours)
    print(f"\n{kind} LoRA loss, stock:   " + " ".join(f"{x:.4f}" for x in stock_curve))
    print(f"{kind} LoRA loss, patched: " + " ".join(f"{x:.4f}" for x in our_curve))
    assert stock_curve[-4:].mean() < stock_curve[:4].mean() - 0.05  # it learns
    assert_matches("loss", our_curve, stock_curve, "layer_train.lora_curve.v1.float32.loss")


@pytest.mark.parametrize("kind", KINDS)
def test_no_stale_weight_after_a_compiled_step_or_an_in_place_update(kind):
    _, ours = stock_and_patched(kind, 6)
    sequence, lengths = batch(8)
    mx.eval(ours(sequence))  # a forward before training

    optimizer = optim.SGD(learning_rate=0.5)
    loss_and_grad = nn.value_and_grad(ours, default_loss)
    state = [ours.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(sequence, lengths):
        (loss, _), grads = loss_and_grad(ours, sequence, lengths)
        optimizer.update(ours, grads)
        return loss

    mx.eval(step(sequence, lengths), state)
    mx.eval(ours(sequence))
    # An update inside the same Python array object (item assignment keeps
    # the object): a weight derived and cached per array object would be
    # stale now.
    projection = linear_attention_layers(ours)[0]._projection_modules()[0]
    weight_object = projection.weight
    projection.weight[:4] = 0.0
    assert projection.weight is weight_object

    # The patched model's logits are those of a stock model with its weights.
    stock = family_model(kind, 6)
    stock.load_weights(list(tree_flatten(ours.parameters())))
    ours.eval()
    stock.eval()
    assert_matches(
        "logits", ours(sequence), stock(sequence), "layer.mlx_lm_parity.v2.float32.logits"
    )


# The families whose layers run the core op between mlx-lm's projections and
# convolutions (per-key gates for the three KDA layers): every family but
# the two Qwen ones (KINDS, on the segment, above).
CORE_OP_FAMILIES = [name for name in FAMILY if name not in KINDS]


@pytest.mark.parametrize("family", sorted(CORE_OP_FAMILIES))
@pytest.mark.parametrize("setup", ("full", "lora", "quantized_lora"))
def test_patched_core_op_families_parameter_gradients_equal_the_stock_models(family, setup):
    # Their plain projections run our CPU kernel; the tuner's LoRA wrappers
    # (and the quantized projections under them) keep their own call.
    stock, ours = stock_and_patched(
        family, 5, quantize=setup == "quantized_lora", lora=setup != "full"
    )
    layers = [(n, m) for n, m in ours.named_modules() if isinstance(m, FAMILY[family].layer)]
    assert len(layers) == FAMILY[family].tiny_model_layers
    if setup != "full":
        assert all(isinstance(m.o_proj, LoRALinear) for _, m in layers)
    if setup == "quantized_lora":
        assert all(isinstance(m.o_proj.linear, nn.QuantizedLinear) for _, m in layers)
    sequence, lengths = batch(6)
    stock_loss, stock_grads = gradients(stock, sequence, lengths)
    our_loss, our_grads = gradients(ours, sequence, lengths)
    assert stock_grads.keys() == our_grads.keys()
    # The parameters under the gated-delta layers, ours after patching.
    layer_grads = [name for name in our_grads if name.startswith(tuple(f"{n}." for n, _ in layers))]
    # Every trained parameter of the gated-delta layers gets a gradient (all
    # of them: projections, convolutions, A_log, dt_bias, norms; with LoRA
    # the adapters), compared below.
    assert layer_grads
    for name in layer_grads:
        assert float(mx.abs(stock_grads[name]).max()) > 0.0, name
    for name, grad in stock_grads.items():
        assert_matches(
            name, our_grads[name], grad, "layer_grad.mlx_lm_parity.v1.float32.parameter_grad"
        )
    assert abs(our_loss - stock_loss) <= 1e-5 * abs(stock_loss)
