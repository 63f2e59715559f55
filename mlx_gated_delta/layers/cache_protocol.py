"""What a gated-delta layer asks of its cache (docs/contract.md, "A trimmable
cache").

Every layer keeps mlx-lm's cache layout for its family: the conv states, then
the recurrent state, in the slots of an `ArraysCache`, read by index, with
mlx-lm's `lengths` for a batched prefill. A trimmable cache
(`mlx_gated_delta.cache.TrimmableArraysCache`) also keeps the slots after the
positions it names (`kept_positions`); `store_in_cache` hands it the call's
slots.
"""


def kept_positions(cache, tokens):
    """The positions of a call of `tokens` tokens after which the layer's
    cache keeps the states, if it is a trimmable cache
    (mlx_gated_delta.cache.TrimmableArraysCache), else None."""
    if cache is not None and hasattr(cache, "checkpoints_for"):
        return cache.checkpoints_for(tokens)
    return None


def store_in_cache(cache, slots, tokens, positions=None, slot_checkpoints=()):
    """Stores a call's new value of every cache slot (mlx-lm's layout: the
    conv states, then the state) and advances the cache by the call's
    `tokens`. A trimmable cache also keeps the slots after each of
    `positions` (`kept_positions`): `slot_checkpoints` holds each slot's
    values there, in the order of `positions`."""
    if hasattr(cache, "checkpoints_for"):
        kept = None
        if positions:
            kept = [[values[n] for values in slot_checkpoints] for n in range(len(positions))]
        cache.update(slots, tokens, kept)
    else:
        for slot, value in enumerate(slots):
            cache[slot] = value
    cache.advance(tokens)
