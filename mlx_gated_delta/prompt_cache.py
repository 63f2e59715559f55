"""mlx-lm's server prompt cache, reused exactly on patched models, with a draft
model too (`python -m mlx_gated_delta lm server`).

mlx-lm 0.32's server keeps each request's cache (`LRUPromptCache`) under the
tokens of its prompt and answer, and serves a later prompt from the stored
cache that shares the most with it: as it is when the stored tokens are a
prefix of the new prompt, else trimmed back to the shared prefix. Two things
break that for a patched model served with a draft model:

- The key is one token too long: the last token speculative decoding yields
  is never fed to the model (and the draft's caches can lag one more token).
  A cache reused under that key misses a token, whatever the model.
- The trim is deep (the rest of the old prompt and its whole answer), and a
  gated-delta layer's state can go back only to a position it kept
  (`TrimmableArraysCache.restorable_positions`): its window of recent tokens
  and its snapshots.

`SnapshotPromptCache` mends both when it fetches. It rewinds a stored cache
to the deepest position that all its layers can restore exactly and that
every one of them holds (so never past the tokens they were fed, whatever the
key says) and the new prompt shares, and the server prefills the rest:
exact, at the price of prefilling again the tokens between that position
and the shared prefix. And it has the caches keep, during the prefill that
follows, their states where a later request is likely to resume: at the
ends of the prompt's segments (mlx-lm's own split of a chat prompt: the
system prompt, the conversation, a thinking tail), where the prompt parted
from the stored one nearest it, where the reused cache starts, and after the
prompt's last token but one (where the same prompt asked again resumes). The
snapshots are bounded per layer (`TrimmableArraysCache.max_snapshots`); one
that was dropped only means a deeper rewind and a longer prefill.

Entries of mlx-lm's own caches (a model without gated-delta layers, or the
batched server's entries, which mlx-lm stores as its plain `ArraysCache`)
keep mlx-lm's rules.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging

from mlx_lm import server
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from .cache import TrimmableArraysCache


def rewind_points(caches: list) -> set[int] | None:
    """The token counts every cache of a model's prompt cache can be rewound
    to exactly; None when it holds no `TrimmableArraysCache` or a cache that
    cannot be trimmed by token counts (mlx-lm's rules apply then)."""
    ours = [c for c in caches if isinstance(c, TrimmableArraysCache)]
    others = [c for c in caches if not isinstance(c, TrimmableArraysCache)]
    trimmable = (c.is_trimmable() and isinstance(getattr(c, "offset", None), int) for c in others)
    if not ours or not all(trimmable):
        return None
    points = set.intersection(*(set(c.restorable_positions()) for c in ours))
    held = min(c.offset for c in caches)
    return {p for p in points if p <= held}


def shared_prefix(a: list, b: list) -> int:
    """How many leading tokens `a` and `b` share."""
    for n, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return n
    return min(len(a), len(b))


class SnapshotPromptCache(LRUPromptCache):
    """mlx-lm's `LRUPromptCache` that rewinds patched models' caches exactly
    (the module's docstring says how)."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self._expected = None

    def expect_prompt(self, tokens: list, segment_ends: list[int], new_cache=None) -> None:
        """Says what the next `fetch_nearest_cache` is for: the prompt's
        tokens, where its segments end, and a maker of an empty cache for its
        model (or None: the server makes it)."""
        self._expected = (list(tokens), segment_ends, new_cache)

    def fetch_nearest_cache(self, model, tokens: list):
        expected, self._expected = self._expected, None
        found = self._trie.search(model, tokens)
        keys = [key for key in (found.exact, found.shorter, found.longer) if key]
        entries = [(key, self._trie.get(found.model, key).prompt_cache) for key in keys]
        if entries and all(rewind_points(entry) is None for _, entry in entries):
            return super().fetch_nearest_cache(model, tokens)

        # At least one token of the prompt is left to feed. An entry of
        # mlx-lm's own caches beside ours (the batched server's) is used only
        # as it is, when its tokens begin the prompt.
        reach, source, rewind = 0, None, False
        for key, entry in entries:
            usable = min(shared_prefix(key, tokens), len(tokens) - 1)
            points = rewind_points(entry)
            candidates = {len(key)} if points is None else points
            best = max((p for p in candidates if p <= usable), default=0)
            if best > reach:
                reach, source, rewind = best, entry, points is not None
        cache = None
        if source is not None:
            cache = copy.deepcopy(source)
            for c in cache if rewind else ():
                c.trim(c.offset - reach)
        elif expected is not None and expected[2] is not None:
            cache = expected[2]()

        if cache is not None:
            keep = {reach, len(tokens) - 1}
            if found.longer is not None:
                keep.add(found.common_prefix)
            if expected is not None and expected[0] == list(tokens):
                keep.update(expected[1])
            for c in cache:
                if isinstance(c, TrimmableArraysCache):
                    c.keep_states_at(sorted(keep))
        shared = max((shared_prefix(key, tokens) for key in keys), default=0)
        logging.info(
            f"mlx_gated_delta: prompt cache: {reach} of {len(tokens)} prompt tokens reused "
            f"(shared with a stored prompt: {shared})"
        )
        return cache, tokens[reach:]


class SnapshotResponseGenerator(server.ResponseGenerator):
    """mlx-lm's server loop with a `SnapshotPromptCache` (of the size and
    bytes it was given), told of each prompt's segments as it tokenizes
    them."""

    def __init__(self, model_provider, prompt_cache: LRUPromptCache):
        ours = SnapshotPromptCache(prompt_cache.max_size, prompt_cache.max_bytes)
        super().__init__(model_provider, ours)

    def _tokenize(self, tokenizer, request, args):
        tokenized = super()._tokenize(tokenizer, request, args)
        prompt, segments = tokenized[0], tokenized[1]
        ends = list(itertools.accumulate(len(s) for s in segments))[:-1]
        speculative = self.model_provider.draft_model is not None
        self.prompt_cache.expect_prompt(
            prompt, ends, self._speculative_cache if speculative else None
        )
        return tokenized

    def _speculative_cache(self) -> list:
        # What the server makes for a speculative request: the model's
        # caches, then the draft's.
        provider = self.model_provider
        return make_prompt_cache(provider.model) + make_prompt_cache(provider.draft_model)


@contextlib.contextmanager
def snapshot_prompt_cache():
    """While in the block, mlx-lm's server (`mlx_lm.server.run`) serves with
    `SnapshotResponseGenerator`."""
    generator = server.ResponseGenerator
    server.ResponseGenerator = SnapshotResponseGenerator
    try:
        yield
    finally:
        server.ResponseGenerator = generator
