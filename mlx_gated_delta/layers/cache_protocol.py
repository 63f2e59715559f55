"""What a gated-delta layer asks of its cache (docs/contract.md, "A trimmable
cache").

Every layer keeps mlx-lm's cache layout for its family: the conv states, then
the recurrent state, in the slots of an `ArraysCache`, read by index, with
mlx-lm's `lengths` for a batched prefill. Besides reading them, a layer asks
its cache two things, the methods of `LayerCache`:

- `checkpoints_for(tokens)`: the positions of a call of `tokens` tokens after
  which the cache keeps the slots (the op computes them in the same pass), or
  None;
- `store(slots, tokens, positions, slot_checkpoints)`: the call's new value of
  every slot and their values after those positions; it advances the cache by
  the call's tokens.

`mlx_gated_delta.cache.TrimmableArraysCache` (what a patched model's
`make_cache` gives) implements them. mlx-lm's own `ArraysCache` (an unpatched
model's, or one made by hand) keeps no checkpoints: a layer reads it through
`MlxLmArraysCache`, and a call without a cache through `NO_CACHE`, so that
the layers hold no case of their own for either.
"""

from __future__ import annotations

from typing import Any


class LayerCache:
    """The cache protocol of the gated-delta layers, with what a cache that
    keeps no checkpoints does. A subclass gives the slots by index
    (`self[slot]`), `lengths` and `advance(tokens)`, as mlx-lm's
    `ArraysCache` does."""

    def checkpoints_for(self, tokens: int) -> list[int] | None:
        """The positions of a call of `tokens` tokens after which the cache
        keeps the slots, or None: it keeps none."""
        return None

    def store(
        self, slots: list, tokens: int, positions: list[int] | None = None, slot_checkpoints=()
    ) -> None:
        """Stores a call's new value of every slot (mlx-lm's layout: the conv
        states, then the state) and advances the cache by the call's
        `tokens`. A cache that keeps checkpoints also keeps the slots after
        each of `positions` (what `checkpoints_for(tokens)` gave):
        `slot_checkpoints` holds each slot's values there, in the order of
        `positions`."""
        for slot, value in enumerate(slots):
            self[slot] = value
        self.advance(tokens)


class MlxLmArraysCache(LayerCache):
    """mlx-lm's own `ArraysCache` through the protocol: its slots, lengths and
    advance; no checkpoints."""

    def __init__(self, cache: Any):
        self._cache = cache

    def __getitem__(self, slot):
        return self._cache[slot]

    def __setitem__(self, slot, value):
        self._cache[slot] = value

    @property
    def lengths(self):
        return self._cache.lengths

    def advance(self, tokens: int) -> None:
        self._cache.advance(tokens)


class _NoCache(LayerCache):
    """A call without a cache: every slot empty (the states start at zero),
    no lengths, and nothing stored."""

    lengths = None

    def __getitem__(self, slot):
        return None

    def store(self, slots, tokens, positions=None, slot_checkpoints=()) -> None:
        pass


NO_CACHE = _NoCache()


def layer_cache(cache: Any) -> LayerCache:
    """The protocol of the `cache` a layer was called with: a LayerCache is
    itself, None is `NO_CACHE`, any other (mlx-lm's `ArraysCache`) is read
    through `MlxLmArraysCache`."""
    if isinstance(cache, LayerCache):
        return cache
    if cache is None:
        return NO_CACHE
    return MlxLmArraysCache(cache)


def kept_positions(cache, tokens):
    """The positions of a call of `tokens` tokens after which the layer's
    cache keeps the states (`LayerCache.checkpoints_for`), or None."""
    return layer_cache(cache).checkpoints_for(tokens)


def store_in_cache(cache, slots, tokens, positions=None, slot_checkpoints=()):
    """Stores a call's new value of every cache slot and advances the cache
    by the call's `tokens` (`LayerCache.store`)."""
    layer_cache(cache).store(slots, tokens, positions, slot_checkpoints)
