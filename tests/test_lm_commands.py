"""mlx-lm's own commands with our layers, end to end and offline:
`python -m mlx_gated_delta lm generate | chat | server | lora` as
subprocesses on tiny random Qwen3-Next and Kimi-Linear checkpoints written to
a temporary folder (with a word-level tokenizer built offline), the server
spoken to over real HTTP on 127.0.0.1. Every answer is checked against
mlx-lm's stock model (unpatched, no draft) run greedily in this process, the
chat's against stock `mlx_lm chat` run as a subprocess."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm import generate as mlx_lm_generate  # noqa: E402
from mlx_lm import load  # noqa: E402

from mlx_gated_delta import patch_mlx_lm  # noqa: E402
from mlx_gated_delta.cache import TrimmableArraysCache  # noqa: E402
from mlx_gated_delta.layers.families import kimi_linear, qwen3_next  # noqa: E402
from mlx_gated_delta.lm import PREFIX, patch_loaded_model  # noqa: E402
from mlx_gated_delta.prompt_cache import rewind_points, shared_prefix  # noqa: E402
from mlx_gated_delta.testing.lm_checkpoints import (  # noqa: E402
    save_checkpoint,
    write_lora_data,
)
from mlx_gated_delta.testing.lm_server import LmServer, chat_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Seconds any one command may take on a slow, shared CI machine.
COMMAND_TIMEOUT = 120
NEW_TOKENS = 8
FAMILIES = {"qwen3_next": qwen3_next, "kimi_linear": kimi_linear}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's target (seed 0) and draft (seed 1, other weights: its
    drafts are mostly rejected, so every step trims the caches), and a
    model without gated delta (Llama)."""
    from mlx_lm.models import llama

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for name, family in FAMILIES.items():
        paths[name] = save_checkpoint(family.FAMILY.tiny_model(0), root / name)
        paths[f"{name}_draft"] = save_checkpoint(family.FAMILY.tiny_model(1), root / f"{name}_d")
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=128,
        max_position_embeddings=512,
    )
    paths["llama"] = save_checkpoint(llama.Model(args), root / "llama")
    return paths


def stock_answer(path, messages=None, prompt=None, max_tokens=NEW_TOKENS, adapter_path=None):
    """mlx-lm's stock model's greedy text for a chat or a raw prompt."""
    model, tokenizer = load(str(path), adapter_path=adapter_path)
    if messages is not None:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return mlx_lm_generate(model, tokenizer, prompt, max_tokens=max_tokens)


def run_module(module, *args, stdin=None):
    """Runs `python -m module args` (feeding it `stdin`); it must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_lm(*args, stdin=None):
    return run_module("mlx_gated_delta", "lm", *args, stdin=stdin)


def generated_text(stdout: str) -> str:
    """The text `mlx_lm generate` prints between its two rules."""
    return stdout.split("==========")[1].strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_and_without_draft_gives_the_stock_greedy_text(checkpoints, family):
    target, draft = checkpoints[family], checkpoints[f"{family}_draft"]
    common = ("generate", "--model", target, "--prompt", "w1 w2 w3 w4 w5")
    common += ("--max-tokens", 12, "--temp", 0)
    alone = run_lm(*common)
    drafted = run_lm(*common, "--draft-model", draft, "--num-draft-tokens", 3)
    expected = stock_answer(target, [{"role": "user", "content": "w1 w2 w3 w4 w5"}], max_tokens=12)
    assert generated_text(alone.stdout) == expected
    assert generated_text(drafted.stdout) == expected
    replaced = [line for line in drafted.stderr.splitlines() if "gated-delta layer(s)" in line]
    assert [str(target) in replaced[0], str(draft) in replaced[1]] == [True, True], replaced
    assert all(": replaced 3 gated-delta layer(s): 3 x " in line for line in replaced)


# `mlx_lm chat`'s line of statistics after each answer: "  N tokens · ... tok/s ...".
CHAT_STATISTICS = re.compile(r"^ +\d+ tokens .* tok/s")


def chat_answers(stdout: str) -> list[str]:
    """The answers `mlx_lm chat` streams: each is the line before its line of
    statistics (the word-level tokenizer decodes to no newline)."""
    lines = stdout.splitlines()
    return [lines[i - 1] for i, line in enumerate(lines) if CHAT_STATISTICS.match(line)]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_gives_stock_chats_answers_turn_after_turn(checkpoints, family):
    """`mlx_lm chat` keeps one prompt cache for the whole chat, each turn
    prefilled on top of the turns before it, until a reset (`r`) makes a new
    one. Two turns, a reset, the first turn again and quit (`q`) on stdin:
    every answer is stock `mlx_lm chat`'s greedy answer to the same input."""
    target = checkpoints[family]
    stdin = "w1 w2 w3 w4 w5\nw20 w21 w22 w23\nr\nw1 w2 w3 w4 w5\nq\n"
    args = ("chat", "--model", target, "--max-tokens", 20, "--temp", 0, "--seed", 0)
    ours = run_lm(*args, stdin=stdin)
    stock = run_module("mlx_lm", *args, stdin=stdin)
    answers = chat_answers(ours.stdout)
    assert len(answers) == 3 and all(answers), ours.stdout[-3000:]
    assert answers == chat_answers(stock.stdout)
    assert f"{PREFIX}: {target}: replaced 3 gated-delta layer(s): 3 x " in ours.stderr
    assert PREFIX not in stock.stderr


def test_generate_runs_a_model_without_gated_delta_unpatched(checkpoints):
    prompt = ("--prompt", "w1 w2", "--max-tokens", NEW_TOKENS)
    result = run_lm("generate", "--model", checkpoints["llama"], *prompt)
    assert "has no gated-delta layer; it runs unpatched" in result.stderr
    expected = stock_answer(checkpoints["llama"], [{"role": "user", "content": "w1 w2"}])
    assert generated_text(result.stdout) == expected


def test_an_unknown_gated_delta_layer_is_refused(checkpoints):
    model, _ = load(str(checkpoints["qwen3_next"]))
    layer = model.layers[0].linear_attn
    layer.__class__ = type("CustomGatedDeltaNet", (type(layer),), {})
    with pytest.raises(ValueError, match="of a class it does not know"):
        patch_loaded_model(model, "custom")


# The caches' exact rewinds, which the server's prompt cache relies on.


def feed(cache, calls):
    """Feeds `cache` calls of the given token counts, as a layer does: every
    slot's value after token n is n."""
    for tokens in calls:
        start, positions = cache.offset, cache.checkpoints_for(tokens)
        kept = [[mx.array([start + p])] * 2 for p in positions or ()]
        cache.update([mx.array([start + tokens])] * 2, tokens, kept if positions else None)


def test_a_trim_lands_exactly_on_a_kept_snapshot_however_deep():
    cache = TrimmableArraysCache(2)
    cache.keep_states_at([5, 12])
    feed(cache, [12, 40])
    # The snapshots, then the 16-token window before the current offset.
    assert cache.restorable_positions() == [5, 12, *range(36, 53)]
    with pytest.raises(ValueError, match="asked for 32"):
        cache.trim(32)  # to 20 tokens: neither in the window nor a snapshot
    assert cache.offset == 52 and cache[0].item() == 52
    assert cache.trim(40) == 40 and (cache.offset, cache[0].item(), cache[1].item()) == (12, 12, 12)
    assert cache.trim(7) == 7 and (cache.offset, cache[0].item()) == (5, 5)


def test_the_snapshots_are_bounded_keeping_them_spread():
    cache = TrimmableArraysCache(2)
    cache.max_snapshots = 2
    cache.keep_states_at([4, 6, 20])
    feed(cache, [30])
    # 6 goes: 2 tokens after the snapshot before it, the smallest gap.
    assert cache.snapshot_positions() == [4, 20]


def test_a_copy_shares_the_states_and_leaves_the_original_as_it_was():
    cache = TrimmableArraysCache(2)
    cache.keep_states_at([5])
    feed(cache, [30])
    copied = copy.deepcopy(cache)
    assert copied[1] is cache[1]  # the states are shared, not copied
    copied.trim(25)
    feed(copied, [3])
    assert (copied.offset, copied[0].item()) == (8, 8)
    assert (cache.offset, cache[0].item(), cache.restorable_positions()) == (
        30,
        30,
        [5, *range(14, 31)],
    )
    assert cache.trim(25) == 25 and cache[1].item() == 5


def test_a_stored_cache_rewinds_no_further_than_all_its_layers_hold():
    from mlx_lm.models.cache import KVCache

    ours = TrimmableArraysCache(2)
    feed(ours, [10])
    attention = KVCache()
    attention.update_and_fetch(mx.zeros((1, 1, 9, 4)), mx.zeros((1, 1, 9, 4)))
    # A draft's attention layers one token behind the target's state.
    assert rewind_points([ours, attention]) == set(range(10))
    assert rewind_points([attention]) is None  # mlx-lm's own caches: its rules


# The server.


@pytest.fixture
def server():
    """Starts `lm server` with the given arguments; always stopped."""
    started = []

    def start(*args):
        started.append(LmServer(*args, cwd=REPO, max_tokens=NEW_TOKENS))
        return started[-1]

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def answers_at_once(calls):
    """Runs the calls in threads at the same time; their results in order."""
    results = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as error:  # reported below, on the test's thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=COMMAND_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a request did not finish in time"
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def answer_of(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def cached_tokens(response: dict) -> int:
    """The prompt tokens the server took from its prompt cache (not prefilled)."""
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def chat_tokens(path, messages) -> list[int]:
    _, tokenizer = load(str(path))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_server_with_a_draft_model_gives_the_stock_greedy_answers(checkpoints, server, family):
    target = checkpoints[family]
    s = server(
        "--model", target, "--draft-model", checkpoints[f"{family}_draft"],
        "--num-draft-tokens", 3,
    )  # fmt: skip
    first = chat_of("w1 w2 w3", system="w9 w8 w7 w6")
    answer = answer_of(s.chat(first))
    assert answer == stock_answer(target, first)
    assert s.chat_streamed(first) == answer
    completion = s.complete("w5 w6 w7 w8")["choices"][0]["text"]
    assert completion == stock_answer(target, prompt="w5 w6 w7 w8")
    # Two clients at once.
    second = chat_of("w40 w41 w42 w43 w44")
    both = answers_at_once([lambda: s.chat(first), lambda: s.chat(second)])
    assert [answer_of(r) for r in both] == [answer, stock_answer(target, second)]
    replaced = [line for line in s.stop().splitlines() if "gated-delta layer(s)" in line]
    assert len(replaced) == 2, replaced


# Each family's target with its hybrid draft, and with a draft of attention
# layers only (Llama, the same vocabulary), whose caches lag the target's by
# a token when speculative decoding stops after accepting every draft.
@pytest.mark.parametrize(
    "family,draft",
    [(name, f"{name}_draft") for name in FAMILIES] + [("qwen3_next", "llama")],
)
def test_server_with_a_draft_model_serves_a_repeated_system_prompt_from_its_cache(
    checkpoints, server, family, draft
):
    """With a draft model, the prompt cache is reused exactly: a later
    request with the same system prompt prefills none of the tokens it
    shares with the first (the server's `cached_tokens` is all of them), a
    repeated request prefills only its last token, a next turn of the chat
    reuses the whole first exchange, and every answer is the stock model's
    greedy answer from a fresh prefill."""
    target = checkpoints[family]
    s = server("--model", target, "--draft-model", checkpoints[draft], "--num-draft-tokens", 3)
    # User turns and answers longer than the cache's 16-token window, so that
    # reaching back to the system prompt or the prompt's end needs a snapshot.
    tokens = 24

    def ask(messages):
        response = s.chat(messages, max_tokens=tokens)
        assert answer_of(response) == stock_answer(target, messages, max_tokens=tokens)
        return response

    system = " ".join(f"w{i}" for i in range(1, 21))
    first = chat_of(" ".join(f"w{i}" for i in range(30, 50)), system)
    second = chat_of(" ".join(f"w{i}" for i in range(60, 80)), system)
    shared = shared_prefix(chat_tokens(target, first), chat_tokens(target, second))
    assert shared > len(system.split())  # the system prompt and the chat's markup
    r1 = ask(first)
    assert cached_tokens(r1) == 0
    assert cached_tokens(ask(second)) == shared
    # The first request again: everything but its last prompt token is reused.
    assert cached_tokens(ask(first)) == len(chat_tokens(target, first)) - 1
    # The chat's next turn: the first exchange (up to the tokens the cache
    # was fed) comes from the cache.
    follow_up = [*first, {"role": "assistant", "content": answer_of(r1)}, *chat_of("w90 w91")]
    assert cached_tokens(ask(follow_up)) >= len(chat_tokens(target, first))
    # Two clients at once, a third user turn with the same system prompt.
    third = chat_of("w50 w51 w52 w53", system)
    both = answers_at_once([lambda: ask(second), lambda: ask(third)])
    assert all(cached_tokens(r) >= shared for r in both)
    assert s.chat_streamed(third, max_tokens=tokens) == answer_of(both[1])


def test_server_reuses_prompts(checkpoints, server):
    """Without a draft model the server batches requests and keeps prompt
    caches across them: a repeated system prompt is served from the cache,
    and the answers stay the stock model's, two clients at once included;
    a model loaded on demand is patched as well."""
    target = checkpoints["qwen3_next"]
    s = server("--model", target)
    system = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"
    first, second = chat_of("w20 w21", system), chat_of("w30 w31 w32", system)
    r1 = s.chat(first)
    assert r1["choices"][0]["message"]["content"] == stock_answer(target, first)
    r2 = s.chat(second)
    assert r2["choices"][0]["message"]["content"] == stock_answer(target, second)
    # The system prompt's tokens (at least) came from the cache.
    assert cached_tokens(r2) >= len(system.split())
    both = answers_at_once([lambda: s.chat(first), lambda: s.chat(chat_of("w50", system))])
    assert [r["choices"][0]["message"]["content"] for r in both] == [
        stock_answer(target, first),
        stock_answer(target, chat_of("w50", system)),
    ]
    assert s.chat_streamed(second) == r2["choices"][0]["message"]["content"]
    # A request served on its own (a seed makes it unbatchable) from an
    # empty cache stores our caches; a later batched request that shares its
    # system prompt, more than 16 tokens back, is served exactly.
    other_system = " ".join(f"w{i}" for i in range(100, 110))
    seeded = chat_of(" ".join(f"w{i}" for i in range(60, 80)), other_system)
    assert answer_of(s.chat(seeded, seed=0)) == stock_answer(target, seeded)
    after = chat_of("w91", other_system)
    assert answer_of(s.chat(after)) == stock_answer(target, after)
    # A model the server loads on demand, for a request that names it, is
    # patched too.
    other = checkpoints["kimi_linear"]
    answer = s.chat(first, model=str(other))["choices"][0]["message"]["content"]
    assert answer == stock_answer(other, first)
    patched = [line for line in s.stop().splitlines() if "gated-delta layer(s)" in line]
    assert [str(target) in patched[0], str(other) in patched[1]] == [True, True], patched


# LoRA.


def test_lora_trains_a_patched_model_and_its_adapters_load_into_the_stock_model(
    checkpoints, tmp_path
):
    target = checkpoints["qwen3_next"]
    data = write_lora_data(tmp_path / "data", size=128)
    adapters = tmp_path / "adapters"
    result = run_lm(
        "lora", "--model", target, "--train", "--data", data, "--iters", 4,
        "--batch-size", 2, "--num-layers", 2, "--max-seq-length", 32,
        "--steps-per-report", 2, "--steps-per-eval", 4, "--val-batches", 1,
        "--learning-rate", 1e-3, "--adapter-path", adapters,
    )  # fmt: skip
    assert "replaced 3 gated-delta layer(s)" in result.stderr
    saved = mx.load(str(adapters / "adapters.safetensors"))
    lora_b = [value for name, value in saved.items() if name.endswith("lora_b")]
    assert lora_b and any(mx.abs(b).max().item() > 0 for b in lora_b), "nothing was trained"
    # The stock model takes the adapters (a strict load), and gives the
    # tokens the patched model gives with them.
    stock, tokenizer = load(str(target), adapter_path=str(adapters))
    loaded = dict(tree_flatten(stock.parameters()))
    assert all(mx.array_equal(loaded[name], value).item() for name, value in saved.items())
    patched, _ = load(str(target), adapter_path=str(adapters))
    patch_mlx_lm(patched)
    prompt = "w3 w4 w5 w6 w7"
    assert mlx_lm_generate(patched, tokenizer, prompt, max_tokens=NEW_TOKENS) == (
        mlx_lm_generate(stock, tokenizer, prompt, max_tokens=NEW_TOKENS)
    )
