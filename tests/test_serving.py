"""Serving with a patched model: the trimmable cache (restores, window,
errors, save/load, batching) and mlx-lm's speculative decoding. The
properties (trim then re-feed, speculative = greedy) live in
mlx_gated_delta/tests/test_serving.py."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    ArraysCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlx_gated_delta.cache import DEFAULT_TRIM_WINDOW, TrimmableArraysCache  # noqa: E402
from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402
from mlx_gated_delta.tests.test_layers import tokens  # noqa: E402
from mlx_gated_delta.tests.test_serving import (  # noqa: E402
    KINDS,
    argmax,
    attention_draft,
    feed,
    patched,
)


def linear_caches(cache):
    return [c for c in cache if isinstance(c, ArraysCache)]


def test_patched_models_make_trimmable_caches():
    model = patched("qwen3_next", 1)
    cache = make_prompt_cache(model)
    assert len(linear_caches(cache)) == 3
    assert all(type(c) is TrimmableArraysCache for c in linear_caches(cache))
    assert can_trim_prompt_cache(cache)
    # Patching again does not wrap make_cache twice.
    make_cache = model.make_cache
    from mlx_gated_delta import patch_mlx_lm

    assert patch_mlx_lm(model) == 0
    assert model.make_cache is make_cache


def test_a_layer_sees_each_kind_of_cache_through_the_protocol():
    from mlx_gated_delta.layers.cache_protocol import NO_CACHE, LayerCache, layer_cache

    trimmable = TrimmableArraysCache(2)
    assert layer_cache(trimmable) is trimmable
    # No cache: empty slots, nothing kept or stored.
    assert layer_cache(None) is NO_CACHE
    assert NO_CACHE[0] is None and NO_CACHE.lengths is None
    assert NO_CACHE.checkpoints_for(5) is None
    # mlx-lm's own cache: its slots and lengths, no checkpoints; a store
    # writes the slots and advances the lengths, as mlx-lm's layers do.
    plain = ArraysCache(2)
    plain.prepare(lengths=[5, 3])
    seen = layer_cache(plain)
    assert isinstance(seen, LayerCache) and seen.checkpoints_for(5) is None
    slots = [mx.zeros((2, 3, 4)), mx.ones((2, 1, 4, 4))]
    seen.store(slots, 2)
    assert plain[0] is slots[0] and seen[1] is slots[1]
    assert seen.lengths.tolist() == [3, 1]


def test_trim_reaches_back_across_calls_and_within_a_call_up_to_the_window():
    model = patched("qwen3_5", 2)
    sequence = tokens(4, (1, 40))
    cache = make_prompt_cache(model)
    feed(model, cache, sequence, [0, 30, 35, 36, 37])
    assert all(c.trimmable_tokens() == DEFAULT_TRIM_WINDOW for c in linear_caches(cache))
    with pytest.raises(ValueError, match="can trim at most 16 tokens"):
        linear_caches(cache)[0].trim(DEFAULT_TRIM_WINDOW + 1)
    assert trim_prompt_cache(cache, 0) == 0
    assert trim_prompt_cache(cache, 2) == 2  # two single-token calls
    assert trim_prompt_cache(cache, 3) == 3  # inside the 5-token call
    fresh = make_prompt_cache(model)
    feed(model, fresh, sequence, [0, 32])
    for ours, theirs in zip(linear_caches(cache), linear_caches(fresh)):
        assert mx.array_equal(ours[1], theirs[1]).item()
        assert mx.array_equal(ours[0], theirs[0]).item()


@pytest.mark.parametrize("kind", ["qwen3_next", "kimi_linear"])
def test_a_trim_that_breaks_the_state_is_caught_by_the_refeed_check(kind):
    # The checker's probe: restoring the state one token off (what a wrong
    # checkpoint index would do) changes the logits of the re-fed tokens
    # beyond the self-consistency contract, so it fails the property whether
    # the family is compared bit for bit or within that contract
    # (the family record's `splits_bitwise`).
    model = patched(kind, 3)
    sequence = tokens(9, (1, 20))
    cache = make_prompt_cache(model)
    feed(model, cache, sequence, [0, 20])
    # The state after 15 tokens where the one after 16 belongs: the same
    # tokens re-fed give other logits.
    trim_prompt_cache(cache, 5)
    off_by_one = feed(model, cache, sequence, [16, 20])
    fresh = feed(model, make_prompt_cache(model), sequence, [0, 16, 20])
    assert off_by_one.shape == fresh.shape
    with pytest.raises(AssertionError, match="violated"):
        assert_matches("logits", off_by_one, fresh, "layer.self_consistency.v2.float32.logits")


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_prompt_cache_keep_the_states(tmp_path, kind):
    model = patched(kind, 1)
    sequence = tokens(3, (1, 12))
    cache = make_prompt_cache(model)
    feed(model, cache, sequence, [0, 10])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    # The window starts empty after a load: honest about what it can trim.
    assert all(c.trimmable_tokens() == 0 for c in linear_caches(loaded))
    with pytest.raises(ValueError, match="can trim at most 0 tokens"):
        linear_caches(loaded)[0].trim(1)
    after_load = feed(model, loaded, sequence, [10, 12])
    continued = feed(model, cache, sequence, [10, 12])
    assert mx.array_equal(after_load, continued).item()


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("draft_kind", ["attention", "hybrid"])
def test_speculative_decoding_with_partial_acceptance_gives_the_greedy_tokens(kind, draft_kind):
    target = patched(kind, 1)
    # A hybrid draft close to the target accepts some drafts, rejects others:
    # the target is trimmed within its verify call, the draft across calls.
    draft = attention_draft(5) if draft_kind == "attention" else patched(kind, 1, 0.005)
    prompt = tokens(2, (30,))
    greedy = [int(t) for t, _ in generate_step(prompt, target, max_tokens=24, sampler=argmax)]
    steps = list(
        speculative_generate_step(
            prompt, target, draft, num_draft_tokens=4, max_tokens=24, sampler=argmax
        )
    )
    assert [int(t) for t, _, _ in steps] == greedy
    accepted = sum(from_draft for _, _, from_draft in steps)
    if draft_kind == "hybrid":
        assert 0 < accepted < 24


@pytest.mark.parametrize("kind", KINDS)
def test_batched_generation_with_trimmable_caches_matches_unbatched(kind):
    from mlx_lm.generate import BatchGenerator

    model = patched(kind, 6)
    prompts = [tokens(1, (9,)).tolist(), tokens(2, (14,)).tolist()]
    assert all(type(c) is TrimmableArraysCache for c in linear_caches(model.make_cache()))
    generator = BatchGenerator(model, max_tokens=6, prefill_batch_size=4, completion_batch_size=4)
    uids = generator.insert(prompts)
    results = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        for response in responses:
            results[response.uid].append(response.token)
    generator.close()
    for uid, prompt in zip(uids, prompts):
        alone = [
            int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6, sampler=argmax)
        ]
        assert results[uid] == alone


def test_demo_speculative_run_gives_the_greedy_tokens_with_accepted_drafts():
    from mlx_gated_delta import demo, models

    target, draft = models.speculative_models(0, target_layers=8, draft_layers=4, damping=0.05)
    prompt = mx.random.randint(0, models.demo_config().vocab_size, (24,), key=mx.random.key(1))
    alone = demo.generate(target, prompt, 8)
    drafted = demo.speculative_generate(target, draft, prompt, 8, draft_tokens=3)
    assert drafted["tokens"] == alone["tokens"]
    # The damped target is what the draft predicts often: drafts are accepted.
    assert drafted["accepted"] > 0


def test_nbytes_counts_the_kept_states():
    model = patched("qwen3_next", 1)
    cache = make_prompt_cache(model)
    feed(model, cache, tokens(3, (1, 8)), [0, 8])
    layer = linear_caches(cache)[0]
    current = layer[0].nbytes + layer[1].nbytes
    # Eight tokens: the states before the call (none: a fresh cache) and
    # after its first seven.
    assert layer.trimmable_tokens() == 8
    assert layer.nbytes == current + 7 * current


@pytest.mark.parametrize("kind", ["qwen3_5", "kimi_k3", "bailing_moe_v3", "olmo_hybrid"])
def test_prompt_reuse_restores_the_longest_snapshotted_prefix(kind):
    from mlx_gated_delta.cache import enable_prefix_snapshots, restore_prefix, reusable_prefix

    model = patched(kind, 8)
    first = tokens(10, (1, 200))
    # A second prompt that shares the first 150 tokens, then differs.
    second = mx.concatenate([first[:, :150], tokens(11, (1, 40))], axis=1)
    cache = make_prompt_cache(model)
    enable_prefix_snapshots(cache, every=64, max_snapshots=2)
    feed(model, cache, first, [0, 100, 200])
    layer = linear_caches(cache)[0]
    # Bounded: the two most recent multiples of 64.
    assert layer.snapshot_positions() == [128, 192]
    assert reusable_prefix(cache, 150) == 128
    restore_prefix(cache, 128)
    reused = feed(model, cache, second, [128, 190])
    fresh = feed(model, make_prompt_cache(model), second, [0, 128, 190])
    # The snapshot at 128 was cut inside a chunk of the call [100, 200): the
    # same tokens as a fresh prefill split otherwise, within the layer's
    # self-consistency contract.
    assert_matches("logits", reused, fresh, "layer.self_consistency.v2.float32.logits")
    with pytest.raises(ValueError, match="no snapshot after 100 tokens"):
        layer.restore(100)


def test_without_snapshots_nothing_is_reusable():
    from mlx_gated_delta.cache import reusable_prefix

    model = patched("qwen3_next", 8)
    cache = make_prompt_cache(model)
    feed(model, cache, tokens(10, (1, 130)), [0, 130])
    assert reusable_prefix(cache, 130) == 0
    assert all(c.snapshot_positions() == [] for c in linear_caches(cache))


class TokenIdDetokenizer:
    """A streaming detokenizer that writes each token id as text: enough for
    mlx-lm's generate() on a model without a real tokenizer."""

    def reset(self):
        self.pending = ""

    def add_token(self, token):
        self.pending += f"{token} "

    def finalize(self):
        pass

    @property
    def last_segment(self):
        segment, self.pending = self.pending, ""
        return segment


def token_id_tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    # The wrapper's constructor inspects a Hugging Face tokenizer; generate()
    # only reads the detokenizer and the end-of-sequence ids.
    tokenizer = TokenizerWrapper.__new__(TokenizerWrapper)
    tokenizer._detokenizer = TokenIdDetokenizer()
    tokenizer._eos_token_ids = set()
    return tokenizer


@pytest.mark.parametrize("kind", KINDS)
def test_mlx_lm_generate_with_a_draft_model_gives_the_greedy_text(kind):
    from mlx_lm.generate import generate

    target = patched(kind, 1)
    prompt = tokens(2, (25,))
    options = dict(max_tokens=12, sampler=argmax)
    greedy = generate(target, token_id_tokenizer(), prompt, **options)
    for draft in (attention_draft(5), patched(kind, 1, 0.005)):
        drafted = generate(
            target, token_id_tokenizer(), prompt, draft_model=draft, num_draft_tokens=3, **options
        )
        assert drafted == greedy
    assert len(greedy.split()) == 12
