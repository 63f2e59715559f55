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

Prompt reuse (opt in, `enable_prefix_snapshots`): the cache also keeps the
states at every `every`-th token since it was created (at most
`max_snapshots` of them, the most recent), taken as checkpoints of the
prefill's own calls, so that a server can rewind a model's whole prompt
cache to the longest snapshotted prefix of a new prompt
(`restore_prefix`) and prefill only the rest.
"""

from __future__ import annotations

from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import ArraysCache

from .layers.cache_protocol import LayerCache

# Tokens a trim may reach back by default: speculative decoding drafts a few
# tokens per step (mlx-lm's default is 2), 16 leaves a wide margin.
DEFAULT_TRIM_WINDOW = 16


class TrimmableArraysCache(ArraysCache, LayerCache):
    """mlx-lm's `ArraysCache` (conv states, then the state) that `trim(n)` rewinds
    by up to `window` tokens (its most recent ones, across calls).

    The layers give it the slots after the positions it asks for
    (`checkpoints_for`, `store`: the protocol of
    mlx_gated_delta.layers.cache_protocol.LayerCache).

    `trimmable_tokens()` says how far a trim can reach now; `trim(n)` beyond
    it raises `ValueError` rather than leave a wrong state. The window starts
    empty after `load_prompt_cache` and after a change of the batch
    (`filter`, `extend`), whose rows the kept states no longer match.
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
        self.max_snapshots = 0
        self.snapshots: dict = {}  # token count -> the slots there
        self._pending: list[int] = []

    @classmethod
    def from_state(cls, state):
        obj = super().from_state(state)
        obj.window = DEFAULT_TRIM_WINDOW
        obj._reset_history()
        return obj

    def checkpoints_for(self, tokens: int) -> list[int] | None:
        """The positions of a call of `tokens` tokens whose states the cache
        keeps: the window's, and with snapshots on, those at multiples of
        `snapshot_every` (the state after the call is the cache itself), or
        None."""
        positions = set(range(max(1, tokens - self.window), tokens))
        if self.snapshot_every:
            first = self.snapshot_every - self.offset % self.snapshot_every
            snapshots = list(range(first, tokens, self.snapshot_every))
            positions.update(snapshots[-self.max_snapshots :])
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
        if self.snapshot_every:
            kept[tokens] = list(slots)
            for position, states in kept.items():
                if (self.offset + position) % self.snapshot_every == 0:
                    self.snapshots[self.offset + position] = states
            for old in sorted(self.snapshots)[: -self.max_snapshots]:
                del self.snapshots[old]
        self.offset += tokens

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

    def is_trimmable(self) -> bool:
        # What mlx-lm asks before speculative decoding: this cache can be
        # trimmed (within its window; trim() refuses beyond it).
        return True

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        if n > len(self.history):
            raise ValueError(
                f"TrimmableArraysCache can trim at most {len(self.history)} tokens now "
                f"(its window is {self.window} tokens), asked for {n}"
            )
        self.cache = self.history[-n]
        del self.history[-n:]
        self.offset -= n
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= self.offset}
        return n

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
    64-token chunk is free in the chunked form), the `max_snapshots` most
    recent. Call it on an empty cache, before the prefill."""
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
