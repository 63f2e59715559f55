"""A long call without a cache in blocks of tokens, recomputed block by
block in the backward.

A layer's call holds the segment's packed input row (its projections'
outputs: 320 MiB for Kimi-Linear's layer at T=8192 in bf16) from the forward
until the segment's backward, and the row's gradient beside it. Called
without a cache on at least twice `TOKEN_BLOCK` tokens (a training step), a
layer runs `in_token_blocks`: block by block, each block's states carried
into the next as in a prompt split over calls. The forward keeps only the
states entering each block; the backward recomputes one block at a time,
the last first, so a step holds one block's row and gradient, not the whole
call's. The price is the forward computed twice.

Every block starts on a chunk boundary (a multiple of 64 tokens) and is at
least `TOKEN_BLOCK` long, the last taking the tokens left over, so the
chunked core sees the chunks of one call and the forward gives the same
bits. The gradients are the same sums in another order: each block's
parameter gradient is summed into the call's in the parameters' dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .cache_protocol import LayerCache

# Tokens a block: 6 chunks of 64 (a 15 MiB row for Kimi-Linear's layer,
# hidden 2048, bf16). Measured at T=8192 (benchmarks/RESULTS.md), blocks of
# 512 left Qwen3-Next's step at 2.03x its io and 256 made it 10% slower.
# None runs every call as one: the step is faster by the recomputed forward
# and holds the whole call's row.
TOKEN_BLOCK: int | None = 384


class _BlockCache(LayerCache):
    """What a block runs with as its cache: the states entering it (None:
    the call's start, zeros) and, after the block, the states it stored."""

    lengths = None

    def __init__(self, slots: list[mx.array] | None):
        self.slots = slots

    def __getitem__(self, slot):
        return None if self.slots is None else self.slots[slot]

    def store(self, slots, tokens, positions=None, slot_checkpoints=()) -> None:
        self.slots = list(slots)


def blocked_without_cache(call):
    """A layer's `__call__(self, x, mask=None, cache=None)` that, called
    without a cache, runs in blocks of `TOKEN_BLOCK` tokens
    (`in_token_blocks`: one block below 2 TOKEN_BLOCK tokens). TOKEN_BLOCK is
    read at each call."""

    @functools.wraps(call)
    def layer_call(layer, x, mask=None, cache=None):
        if TOKEN_BLOCK is None or cache is not None:
            return call(layer, x, mask, cache)
        return in_token_blocks(layer, functools.partial(call, layer), x, mask, TOKEN_BLOCK)

    return layer_call


def in_token_blocks(
    layer: nn.Module,
    call: Callable[[mx.array, mx.array | None, LayerCache], mx.array],
    x: mx.array,
    mask: mx.array | None,
    block: int,
) -> mx.array:
    """`call(x, mask, cache)` (the layer's call on `x` `[B, T, hidden]` from
    zero states, storing its new states in `cache`) over blocks of `block`
    tokens (a multiple of 64), with the gradients of x and of the layer's
    trainable parameters. A frozen parameter is read as a constant, as
    `nn.utils.checkpoint` reads it."""
    if block <= 0 or block % 64:
        raise ValueError(f"block must be a positive multiple of 64 tokens, got {block}")
    # The last block takes the tokens left over (fewer than `block`), so
    # that every block is long enough for the chunked core, as the whole
    # call is: a call of fewer than 2 `block` tokens is one block.
    tokens = x.shape[1]
    blocks = tokens // block
    if blocks < 2:
        return call(x, mask, None)
    bounds = [(i * block, (i + 1) * block) for i in range(blocks - 1)]
    bounds.append(((blocks - 1) * block, tokens))
    named = tree_flatten(layer.trainable_parameters())
    names = [name for name, _ in named]
    params = [value for _, value in named]
    count = len(params)

    def run_block(index, arrays):
        """Block `index`'s out and exit states from `arrays`: the parameters,
        the block's x and its entry states (none for the first)."""
        start, stop = bounds[index]
        layer.update(tree_unflatten(list(zip(names, arrays[:count]))))
        try:
            cache = _BlockCache(list(arrays[count + 1 :]) if index else None)
            block_mask = None if mask is None else mask[:, start:stop]
            out = call(arrays[count], block_mask, cache)
        finally:
            layer.update(tree_unflatten(list(zip(names, params))))
        return [out, *cache.slots]

    @mx.custom_function
    def blocked(*arrays):
        # The outputs: out, then the entry states of every block but the
        # first, which the backward starts its blocks from.
        outs, entries, slots = [], [], []
        for index, (start, stop) in enumerate(bounds):
            out, *slots = run_block(index, [*arrays[:count], arrays[count][:, start:stop], *slots])
            outs.append(out)
            if index + 1 < len(bounds):
                entries.extend(slots)
        return (mx.concatenate(outs, axis=1), *entries)

    @blocked.vjp
    def blocked_vjp(primals, cotangents, outputs):
        d_out = cotangents[0]
        per_block = (len(outputs) - 1) // (len(bounds) - 1)
        entries = [[]] + [
            list(outputs[1 + i * per_block : 1 + (i + 1) * per_block])
            for i in range(len(bounds) - 1)
        ]
        d_params, d_xs, d_slots = None, [], []
        for index in reversed(range(len(bounds))):
            start, stop = bounds[index]
            last = index + 1 == len(bounds)
            seeds = [d_out[:, start:stop], *d_slots]
            inputs = [*primals[:count], primals[count][:, start:stop], *entries[index]]
            # Not before the later blocks' gradients are summed: each block's
            # recompute, row and parameter gradient come and go in turn.
            inputs = mx.depends(inputs, seeds + (d_params or []))
            # The last block's exit states leave the call: no gradient.
            outputs_of = (
                (lambda *a: run_block(index, a)[:1]) if last else (lambda *a: run_block(index, a))
            )
            _, grads = mx.vjp(outputs_of, inputs, seeds)
            block_params = grads[:count]
            d_params = (
                block_params
                if d_params is None
                else [total + part for total, part in zip(d_params, block_params)]
            )
            d_xs.append(grads[count])
            d_slots = grads[count + 1 :]
        return (*d_params, mx.concatenate(d_xs[::-1], axis=1))

    return blocked(*params, x)[0]
