"""A trimmable cache for the gated-delta layers (docs/contract.md, "A
trimmable cache").

mlx-lm keeps a Gated DeltaNet layer's conv state and recurrent state in an
`ArraysCache` (`[conv_state, state]`), which cannot be trimmed: a recurrent
state cannot be rewound. `TrimmableArraysCache` is that cache plus the states
the layer had after each of its most recent `window` tokens, so that
`trim(n)` restores exactly the state (and conv state) `n` tokens back, for
any `n <= window`, whether those tokens came in one call (a speculative
verify step) or in several (a draft model, one token per call). A call of `T`
tokens asks the fused segment for checkpoints at its last positions, which it
computes in the same pass; nothing is recomputed on a trim.

Memory: up to `window` extra states per layer (each `[B, Hv, Dv, Dk]`
float32 and `[B, K-1, C]`), held as the arrays the op returned.
"""

from __future__ import annotations

from typing import List, Optional

from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import ArraysCache

# Tokens a trim may reach back by default: speculative decoding drafts a few
# tokens per step (mlx-lm's default is 2), 16 leaves a wide margin.
DEFAULT_TRIM_WINDOW = 16


class TrimmableArraysCache(ArraysCache):
    """mlx-lm's `ArraysCache` (`[conv_state, state]`) that `trim(n)` rewinds
    by up to `window` tokens (its most recent ones, across calls).

    `trimmable_tokens()` says how far a trim can reach now; `trim(n)` beyond
    it raises `ValueError` rather than leave a wrong state. The window starts
    empty after `load_prompt_cache` and after a change of the batch
    (`filter`, `extend`), whose rows the kept states no longer match.
    """

    def __init__(self, size: int = 2, left_padding: Optional[List[int]] = None,
                 window: int = DEFAULT_TRIM_WINDOW):
        super().__init__(size, left_padding)
        if window < 1:
            raise ValueError(f"window must be at least 1 token, got {window}")
        self.window = window
        # [conv_state, state] after each of the last tokens, oldest first; the
        # current ones (self.cache) follow the last entry.
        self.history: list = []

    @classmethod
    def from_state(cls, state):
        obj = super().from_state(state)
        obj.window = DEFAULT_TRIM_WINDOW
        obj.history = []
        return obj

    def checkpoints_for(self, tokens: int) -> Optional[List[int]]:
        """The positions of a call of `tokens` tokens whose states the window
        keeps (the state after the call is the cache itself), or None."""
        positions = list(range(max(1, tokens - self.window), tokens))
        return positions or None

    def update(self, conv_state, state, tokens: int, conv_checkpoints=None,
               checkpoints=None):
        """The layer's update after a call of `tokens` tokens: the new
        states, and the checkpoint states at `checkpoints_for(tokens)`."""
        self.history.append(list(self.cache))
        if checkpoints is not None:  # None for a one-token call: no inner positions
            self.history.extend([conv_checkpoints[n], checkpoints[n]]
                                for n in range(checkpoints.shape[0]))
        del self.history[: max(0, len(self.history) - self.window)]
        self.cache[0] = conv_state
        self.cache[1] = state

    @property
    def nbytes(self):
        kept = sum(a.nbytes for entry in self.history for a in entry if a is not None)
        return super().nbytes + kept

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
        return n

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self.history = []

    def extend(self, other):
        super().extend(other)
        self.history = []


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
