"""A trimmable cache for the gated-delta layers (docs/contract.md, "A
trimmable cache").

mlx-lm keeps a gated-delta layer's conv states and recurrent state in an
`ArraysCache` (the conv states first, one per convolution of the family, the
recurrent state last: `[conv_state, state]` for Qwen3-Next, `[q, k, v conv
states, state]` for Kimi-Linear), which cannot be trimmed: a recurrent state
cannot be rewound. `TrimmableArraysCache` is that cache plus every slot's
value after each of the layer's most recent `window` tokens, so that
`trim(n)` restores exactly the states `n` tokens back, for any
`n <= window`, whether those tokens came in one call (a speculative verify
step) or in several (a draft model, one token per call). A call of `T`
tokens asks the op for checkpoints at its last positions, which it computes
in the same pass (the conv states there are slices of the call's inputs);
nothing is recomputed on a trim.

Memory: up to `window` extra copies of the slots per layer (the state
`[B, Hv, Dv, Dk]` float32 and each conv state `[B, K-1, C]`), held as the
arrays the op returned.

Deeper trims: the cache also keeps the states at chosen positions, its
snapshots: at every `every`-th token (`enable_prefix_snapshots`, for prompt
reuse through `restore_prefix`) and at the positions asked for with
`keep_states_at` (mlx_gated_delta.prompt_cache asks for the ends of a chat
prompt's segments, where two requests' prompts part, and the prompt's last
token but one). They are checkpoints of the calls that reach them, and a trim
that lands on one restores it exactly, however deep. At most `max_snapshots`
are kept per layer (16 by default, each one copy of the slots); beyond that
the snapshot closest to the one before it goes (position 0, the empty cache,
counting as the first), since a reuse that would have landed on it then
prefills at most that gap again. A trim to a position that is neither in the
window nor a snapshot raises `ValueError`; nothing is ever rewound to a
wrong state.
"""

from __future__ import annotations

import copy

from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import ArraysCache

from .layers.cache_protocol import LayerCache

# Tokens a trim may reach back by default: speculative decoding drafts a few
# tokens per step (mlx-lm's default is 2), 16 leaves a wide margin.
DEFAULT_TRIM_WINDOW = 16
# Snapshots a layer keeps at most by default (each one copy of its slots).
DEFAULT_MAX_SNAPSHOTS = 16


class TrimmableArraysCache(ArraysCache, LayerCache):
    """mlx-lm's `ArraysCache` (conv states, then the state) that `trim(n)` rewinds
    by up to `window` tokens (its most recent ones, across calls), or further
    to any of its snapshots.

    The layers give it the slots after the positions it asks for
    (`checkpoints_for`, `store`: the protocol of
    mlx_gated_delta.layers.cache_protocol.LayerCache).

    `trimmable_tokens()` says how far the window reaches now and
    `restorable_positions()` every token count a trim can land on; `trim(n)`
    to any other raises `ValueError` rather than leave a wrong state. The
    window and the snapshots start empty after `load_prompt_cache` and after
    a change of the batch (`filter`, `extend`), whose rows the kept states no
    longer match.
    """

    def __init__(
        self,
        size: int = 2,
        left_padding: list[int] | None = None,
        window: int = DEFAULT_TRIM_WINDOW,
    ):
        super().__init__(size, left_padding)
        if window < 1:
            raise ValueError(f"window must be at least 1 token, got {window}")
        self.window = window
        self._reset_history()

    def _reset_history(self):
        # The slots after each of the last tokens, oldest first; the current
        # ones (self.cache) follow the last entry.
        self.history: list = []
        self.offset = 0  # tokens fed since the cache was made (or restored)
        self.snapshot_every: int | None = None
        self.max_snapshots = DEFAULT_MAX_SNAPSHOTS
        self.snapshots: dict = {}  # token count -> the slots there
        self.marked: set[int] = set()  # token counts still to snapshot when reached
        self._pending: list[int] = []

    @classmethod
    def from_state(cls, state):
        obj = super().from_state(state)
        obj.window = DEFAULT_TRIM_WINDOW
        obj._reset_history()
        return obj

    def __deepcopy__(self, memo):
        # A copy shares the slots and the kept states: they are never written
        # in place (every call stores new arrays), so a server that copies a
        # stored prompt cache for each request copies lists, not states.
        # mlx-lm's lengths and padding are updated in place: they are copied.
        other = copy.copy(self)
        other.cache = list(self.cache)
        other.history = [list(entry) for entry in self.history]
        other.snapshots = {position: list(s) for position, s in self.snapshots.items()}
        other.marked = set(self.marked)
        other._pending = list(self._pending)
        other.left_padding = copy.deepcopy(self.left_padding, memo)
        other.lengths = copy.deepcopy(self.lengths, memo)
        return other

    def keep_states_at(self, positions) -> None:
        """Asks the cache to snapshot the states after each of `positions`
        (token counts since it was made): now for its current offset, later
        for one a call reaches; positions already passed are ignored."""
        for position in positions:
            if position == self.offset and position > 0:
                self._add_snapshot(position, list(self.cache))
            elif position > self.offset:
                self.marked.add(position)

    def checkpoints_for(self, tokens: int) -> list[int] | None:
        """The positions of a call of `tokens` tokens whose states the cache
        keeps: the window's, the multiples of `snapshot_every` with snapshots
        on, and the marked ones (the state after the call is the cache
        itself), or None."""
        positions = set(range(max(1, tokens - self.window), tokens))
        if self.snapshot_every:
            # Only the most recent can be kept (`_add_snapshot`).
            first = self.snapshot_every - self.offset % self.snapshot_every
            periodic = range(first, tokens, self.snapshot_every)
            positions.update(periodic[-self.max_snapshots :])
        positions.update(p - self.offset for p in self.marked if p < self.offset + tokens)
        self._pending = sorted(positions)
        return self._pending or None

    def store(self, slots: list, tokens: int, positions=None, slot_checkpoints=()):
        """A layer's call of `tokens` tokens: its new value of every slot and,
        for the `positions` of `checkpoints_for(tokens)`, each slot's values
        there (`slot_checkpoints`, one list per slot, in the order of
        `positions`); then advances mlx-lm's lengths and padding."""
        kept = None
        if positions:
            kept = [[values[n] for values in slot_checkpoints] for n in range(len(positions))]
        self.update(slots, tokens, kept)
        self.advance(tokens)

    def update(self, slots: list, tokens: int, checkpoints: list | None = None):
        """What `store` keeps of a call of `tokens` tokens: the new value of
        every slot, and the slots' values after each position of
        `checkpoints_for(tokens)` (None for a call without such positions,
        one token)."""
        kept = {}
        if checkpoints is not None:
            kept = dict(zip(self._pending, checkpoints, strict=True))
        self.history.append(list(self.cache))
        self.history.extend(kept[p] for p in range(max(1, tokens - self.window), tokens))
        del self.history[: max(0, len(self.history) - self.window)]
        self.cache = list(slots)
        kept[tokens] = list(slots)
        for position, states in kept.items():
            at = self.offset + position
            periodic = self.snapshot_every and at % self.snapshot_every == 0
            if periodic or at in self.marked:
                self._add_snapshot(at, states)
        self.offset += tokens
        self.marked = {p for p in self.marked if p > self.offset}

    def _add_snapshot(self, position: int, states: list):
        self.snapshots[position] = states
        while len(self.snapshots) > self.max_snapshots:
            # The one closest to the snapshot before it (0, the empty cache,
            # for the first): what a reuse that would land on it prefills
            # again is that gap, the least of any.
            kept = sorted(self.snapshots)
            gaps = [(p - before, p) for before, p in zip([0, *kept], kept)]
            del self.snapshots[min(gaps)[1]]

    @property
    def nbytes(self):
        entries = self.history + list(self.snapshots.values())
        kept = sum(a.nbytes for entry in entries for a in entry if a is not None)
        return super().nbytes + kept

    def restore(self, tokens: int):
        """Rewinds to the snapshot after the first `tokens` tokens (a
        position of `snapshot_positions()`); the window starts empty."""
        if tokens not in self.snapshots:
            raise ValueError(
                f"TrimmableArraysCache has no snapshot after {tokens} tokens; it has "
                f"{self.snapshot_positions()}"
            )
        self.cache = list(self.snapshots[tokens])
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= tokens}
        self.history = []
        self.offset = tokens

    def snapshot_positions(self) -> list[int]:
        return sorted(self.snapshots)

    def trimmable_tokens(self) -> int:
        return len(self.history)

    def restorable_positions(self) -> list[int]:
        """Every token count `trim` can rewind to exactly: the window's (the
        current offset and the `trimmable_tokens()` before it) and the
        snapshots'."""
        window = range(self.offset - len(self.history), self.offset + 1)
        return sorted(set(window) | set(self.snapshots))

    def is_trimmable(self) -> bool:
        # What mlx-lm asks before speculative decoding and before it rewinds
        # a stored prompt cache: this cache can be trimmed (to the positions
        # of restorable_positions(); trim() refuses any other).
        return True

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        if n <= len(self.history):
            self.cache = self.history[-n]
            del self.history[-n:]
            self.offset -= n
            self.snapshots = {p: s for p, s in self.snapshots.items() if p <= self.offset}
            return n
        if self.offset - n in self.snapshots:
            self.restore(self.offset - n)
            return n
        raise ValueError(
            f"TrimmableArraysCache can trim at most {len(self.history)} tokens now "
            f"(its window is {self.window} tokens), or back to a snapshot after "
            f"{self.snapshot_positions()} tokens; asked for {n} (to {self.offset - n} tokens)"
        )

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self._forget_kept_states()

    def extend(self, other):
        super().extend(other)
        self._forget_kept_states()

    def _forget_kept_states(self):
        # The kept states are of the old batch's rows.
        self.history = []
        self.snapshots = {}
        self.marked = set()


# load_prompt_cache looks a saved cache's class up by name in mlx-lm's cache
# module: make ours findable there.
mlx_lm_cache.TrimmableArraysCache = TrimmableArraysCache


def trimmable_cache(caches: list, window: int = DEFAULT_TRIM_WINDOW) -> list:
    """`caches` with every plain `ArraysCache` (a gated-delta layer's) replaced
    by an empty `TrimmableArraysCache` of the same size."""
    return [
        TrimmableArraysCache(len(c.cache), window=window) if type(c) is ArraysCache else c
        for c in caches
    ]


def enable_prefix_snapshots(cache: list, every: int = 256, max_snapshots: int = 16) -> None:
    """Opts a model's prompt cache into prompt reuse: its gated-delta layers
    keep their states at every `every`-th token (a multiple of the op's
    64-token chunk is free in the chunked form), at most `max_snapshots` of
    them (of these alone, the most recent). Call it on an empty cache, before
    the prefill."""
    if every < 1 or max_snapshots < 1:
        raise ValueError(f"every and max_snapshots must be positive, got {every}, {max_snapshots}")
    for c in cache:
        if isinstance(c, TrimmableArraysCache):
            c.snapshot_every = every
            c.max_snapshots = max_snapshots


def reusable_prefix(cache: list, common_tokens: int) -> int:
    """The longest prefix, at most `common_tokens` long (what the cached and
    the new prompt share), that `restore_prefix` can rewind to: a snapshot of
    every gated-delta layer, or 0."""
    positions = None
    for c in cache:
        if isinstance(c, TrimmableArraysCache):
            mine = set(c.snapshot_positions())
            positions = mine if positions is None else positions & mine
    candidates = [p for p in (positions or ()) if p <= common_tokens]
    return max(candidates, default=0)


def restore_prefix(cache: list, tokens: int) -> None:
    """Rewinds a model's prompt cache to its first `tokens` tokens: the
    gated-delta layers to their snapshot there, the other layers (mlx-lm's
    KV caches) by trimming."""
    for c in cache:
        if isinstance(c, TrimmableArraysCache):
            c.restore(tokens)
        else:
            c.trim(c.offset - tokens)
