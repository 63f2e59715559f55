"""Property tests of serving with a patched model of each family record
(`mlx_gated_delta.layers.FAMILIES`; docs/contract.md, "A trimmable cache"):
trimming the cache and feeding the same tokens again equals a fresh cache
fed them, however the tokens were split into calls; and mlx-lm's
speculative decoding yields exactly the greedy tokens, with a
pure-attention draft and with a hybrid one, whatever the draft accepts.

Run by the repository's `pytest` and by `python -m mlx_gated_delta selftest`, on the
default device. They need mlx-lm
and are skipped without it.
"""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip(
    "mlx_lm", reason='the serving properties need mlx-lm: pip install "mlx-gated-delta[mlx-lm]"'
)

from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # noqa: E402

from mlx_gated_delta import patch_mlx_lm  # noqa: E402
from mlx_gated_delta.cache import DEFAULT_TRIM_WINDOW  # noqa: E402
from mlx_gated_delta.layers import FAMILIES  # noqa: E402
from mlx_gated_delta.layers.families.tiny import VOCAB  # noqa: E402
from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402
from mlx_gated_delta.tests.test_layers import (  # noqa: E402
    FAMILY,
    family_model,
    tokens,
)

KINDS = tuple(sorted(family.name for family in FAMILIES))


def patched(kind, seed, noise=0.0):
    """A tiny random patched model; with `noise`, its weights moved by that
    much (a draft that agrees with the unmoved model on some tokens)."""
    model = family_model(kind, seed)
    patch_mlx_lm(model)
    if noise:
        mx.random.seed(seed + 1000)
        model.update(tree_map(lambda p: p + noise * mx.random.normal(p.shape), model.parameters()))
        mx.eval(model.parameters())
    return model


def attention_draft(seed):
    """A tiny random llama with the test vocabulary: a pure-attention draft."""
    mx.random.seed(seed)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
        )
    )
    mx.eval(model.parameters())
    return model


def argmax(logprobs):
    return mx.argmax(logprobs, axis=-1)


def feed(model, cache, sequence, bounds):
    """Feeds sequence[:, a:b] for consecutive bounds; returns the last logits."""
    logits = None
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            logits = model(sequence[:, start:stop], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


@pytest.mark.parametrize("kind", KINDS)
@settings(deadline=None)
@given(data=st.data())
def test_trim_then_refeed_equals_a_fresh_cache(kind, data):
    model = patched(kind, 3)
    length = data.draw(st.integers(2, 40), label="tokens")
    sequence = tokens(data.draw(st.integers(0, 1000), label="seed"), (1, length))
    # Any split into calls, then trim back by up to the window (and to the
    # prompt's start at most) and feed the trimmed tokens again.
    points = sorted(data.draw(st.lists(st.integers(1, length - 1), max_size=4), label="splits"))
    trim = data.draw(st.integers(1, min(DEFAULT_TRIM_WINDOW, length - 1)), label="trim")
    cache = make_prompt_cache(model)
    feed(model, cache, sequence, [0, *points, length])
    assert trim_prompt_cache(cache, trim) == trim
    refed = feed(model, cache, sequence, [length - trim, length])
    fresh_cache = make_prompt_cache(model)
    fresh = feed(model, fresh_cache, sequence, [0, length - trim, length])
    # Where the family's tiny model does not give bitwise the same states
    # however a prompt is split into calls (its record's `splits_bitwise`),
    # the re-fed logits are held to the layer's self-consistency contract,
    # which a state one token off violates (tests/test_serving.py). The
    # record is the CPU's: there the layer's projections are our row-blocked
    # kernel, and MLX's CPU ops in the rest of the tiny model round the same
    # for any number of rows. On a GPU they are MLX's matmuls, whose kernels
    # depend on the number of rows (on MLX's CUDA backend every family's
    # re-fed logits differ in their last bits while our op's and segment's
    # recurrent splits stay bitwise there), so the contract holds there.
    bitwise = FAMILY[kind].splits_bitwise and mx.default_device() == mx.cpu
    if not bitwise:
        assert_matches("logits", refed, fresh, "layer.self_consistency.v2.float32.logits")
        return
    # The same calls after the trim point from the same restored states:
    # identical logits and identical states (every conv state and state of
    # the gated-delta layers, the attention layers' keys and values).
    assert mx.array_equal(refed, fresh).item()
    for ours, theirs in zip(cache, fresh_cache):
        ours, theirs = (
            [(name, a) for name, a in tree_flatten(c.state) if a is not None]
            for c in (ours, theirs)
        )
        assert [name for name, _ in ours] == [name for name, _ in theirs]
        assert ours
        for (name, a), (_, b) in zip(ours, theirs):
            assert mx.array_equal(a, b).item(), name


@pytest.mark.parametrize("kind", KINDS)
@settings(deadline=None, max_examples=6)
@given(
    draft_kind=st.sampled_from(("attention", "hybrid")),
    noise=st.sampled_from((0.0, 0.003, 0.01)),
    draft_tokens=st.integers(1, 5),
    prompt_seed=st.integers(0, 1000),
)
def test_speculative_decoding_yields_the_greedy_tokens(
    kind, draft_kind, noise, draft_tokens, prompt_seed
):
    target = patched(kind, 1)
    draft = attention_draft(5) if draft_kind == "attention" else patched(kind, 1, noise)
    prompt = tokens(prompt_seed, (20,))
    greedy = [int(t) for t, _ in generate_step(prompt, target, max_tokens=16, sampler=argmax)]
    speculative = [
        int(t)
        for t, _, _ in speculative_generate_step(
            prompt, target, draft, num_draft_tokens=draft_tokens, max_tokens=16, sampler=argmax
        )
    ]
    assert speculative == greedy
