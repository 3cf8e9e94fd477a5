"""KV-cache decoding: prefill prompts, append tokens, and step one token at a time over static shapes.

Layout: keys/values [L, B, Hkv, max_len, D] (head-major: each slot's and head's keys are one contiguous [max_len, D]
matrix, the operand attention's dot reads without a transpose) and `lengths` [B]. Each batch row is an independent
slot stored compactly: the token at position p of a slot lives at cache index p, so a slot's positions are
0..length-1 whatever the padding of the batch that wrote it. A call reads the cache and attends to its own new
keys beside it, then writes them in place (the cache is donated), so a decode step never copies the cache. Every
call takes a token mask: rows whose mask is all zero keep their state, which is how a continuous-batching engine
prefills one slot while others keep decoding; `prefill_slot` does the same for a single slot without computing the
other rows. Shapes never depend on the data, so nothing recompiles.
Writes past `max_len` are dropped: the caller must keep length + new tokens <= max_len.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rstar_jax.model.backbone import Backbone
from rstar_jax.model.config import DTYPES, ModelConfig
from rstar_jax.model.lm import Params, logits_from_hidden


class KVCache(NamedTuple):
    """Stacked per-layer keys/values and each slot's number of cached tokens."""

    keys: jax.Array  # [L, B, Hkv, max_len, D]
    values: jax.Array  # [L, B, Hkv, max_len, D]
    lengths: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        """Tokens one slot can hold."""
        return self.keys.shape[3]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty cache of `batch` slots of `max_len` tokens each, in `dtype` (default: the compute dtype)."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs positive batch and max_len, got batch={batch}, max_len={max_len}")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or config.jnp_dtype)
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "all_logits", "window"), donate_argnames=("cache",))
def extend(params: Params, config: ModelConfig, cache: KVCache, input_ids: jax.Array, attention_mask: jax.Array,
           all_logits: bool = True, window: int | None = None) -> tuple[jax.Array, KVCache]:
    """Append each row's real tokens (mask 1, any padding side) to its slot and return their logits.

    Returns float32 logits [B, T, V] (all_logits) or those of each row's last real token [B, V]; a multi-turn
    agent appends a tool response this way without recomputing the conversation. `window` (static) reads only the
    first `window` cache positions, so attention costs what the live sequences need, not max_len: the caller
    guarantees every row that matters has at most `window` cached tokens (a bucketed bound keeps compiles few).
    """
    window = cache.max_len if window is None else window
    if not 1 <= window <= cache.max_len:
        raise ValueError(f"window must be in [1, max_len={cache.max_len}], got {window}")
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"extend needs input_ids [B, T] and a mask of the same shape, got {input_ids.shape} "
                         f"and {attention_mask.shape}")
    if input_ids.shape[0] != cache.lengths.shape[0]:
        raise ValueError(f"input batch {input_ids.shape[0]} differs from the cache's {cache.lengths.shape[0]} slots")
    real = attention_mask.astype(bool)
    offsets = jnp.cumsum(real, axis=-1, dtype=jnp.int32) - 1
    positions = cache.lengths[:, None] + jnp.maximum(offsets, 0)
    cached_mask = jnp.arange(window)[None, None, :] < cache.lengths[:, None, None]  # [B, 1, window]
    new_mask = real[:, None, :] & (positions[:, None, :] <= positions[:, :, None])  # [B, T, T]
    hidden, (new_keys, new_values) = Backbone(config).apply(
        {"params": params}, input_ids.astype(jnp.int32), positions, (cached_mask, new_mask),
        (cache.keys, cache.values))
    write_index = jnp.where(real, positions, cache.max_len)  # padding goes past the end: dropped
    rows = jnp.arange(input_ids.shape[0])[:, None]
    # [L, B, T, Hkv, D] -> [B, T, L, Hkv, D], the order of cache[:, rows, :, write_index] (advanced indices first)
    new_cache = KVCache(cache.keys.at[:, rows, :, write_index].set(new_keys.transpose(1, 2, 0, 3, 4), mode="drop"),
                        cache.values.at[:, rows, :, write_index].set(new_values.transpose(1, 2, 0, 3, 4),
                                                                     mode="drop"),
                        cache.lengths + real.sum(axis=-1, dtype=jnp.int32))
    if not all_logits:
        last = jnp.argmax(offsets, axis=-1)  # first index of the largest offset: the last real token
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
        return logits_from_hidden(params, config, hidden)[:, 0], new_cache
    return logits_from_hidden(params, config, hidden), new_cache


@functools.partial(jax.jit, static_argnames=("config", "all_logits"), donate_argnames=("cache",))
def prefill(params: Params, config: ModelConfig, cache: KVCache, input_ids: jax.Array, attention_mask: jax.Array,
            all_logits: bool = True) -> tuple[jax.Array, KVCache]:
    """Start a new sequence in every row that has real tokens (its slot is emptied first); other rows keep state."""
    has_tokens = attention_mask.astype(bool).any(axis=-1)
    cache = cache._replace(lengths=jnp.where(has_tokens, 0, cache.lengths))
    return extend(params, config, cache, input_ids, attention_mask, all_logits=all_logits)


@functools.partial(jax.jit, static_argnames=("config", "window"), donate_argnames=("cache",))
def decode_step(params: Params, config: ModelConfig, cache: KVCache, token_ids: jax.Array,
                active: jax.Array | None = None, window: int | None = None) -> tuple[jax.Array, KVCache]:
    """Feed one token per slot ([B]); float32 next-token logits [B, V]. Inactive slots are left unchanged.
    `window` as in `extend`: every active slot holds at most `window` cached tokens."""
    if token_ids.ndim != 1:
        raise ValueError(f"decode_step takes one token per slot, shape [B]; got {token_ids.shape}")
    active = jnp.ones(token_ids.shape, jnp.int32) if active is None else active
    logits, cache = extend(params, config, cache, token_ids[:, None], active[:, None], all_logits=True, window=window)
    return logits[:, 0], cache


def prefill_slot(params: Params, config: ModelConfig, cache: KVCache, slot: int | jax.Array, input_ids: jax.Array,
                 attention_mask: jax.Array, all_logits: bool = True) -> tuple[jax.Array, KVCache]:
    """Start a new sequence of tokens [T] in one slot (a traced index: no recompile per slot), computing only it.

    Returns logits [T, V] (all_logits) or the last real token's [V]. A Python int slot is range-checked here
    (inside jit an out-of-range index would be clamped to the last slot).
    """
    slots = cache.lengths.shape[0]
    if isinstance(slot, int) and not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is outside the cache's {slots} slots")
    return _prefill_slot(params, config, cache, slot, input_ids, attention_mask, all_logits=all_logits)


@functools.partial(jax.jit, static_argnames=("config", "all_logits"), donate_argnames=("cache",))
def _prefill_slot(params: Params, config: ModelConfig, cache: KVCache, slot: jax.Array, input_ids: jax.Array,
                  attention_mask: jax.Array, all_logits: bool) -> tuple[jax.Array, KVCache]:
    if input_ids.ndim != 1 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"prefill_slot takes one sequence [T] and its mask, got {input_ids.shape} and "
                         f"{attention_mask.shape}")
    # The slot starts empty, so its old row is never read: the prompt's keys go into a fresh row of T positions
    # (attending over one masked cache position, not max_len), which is then written over the start of the slot's
    # row. Positions past the prompt keep stale keys, unread: they lie beyond the slot's length.
    shape = (cache.keys.shape[0], 1, cache.keys.shape[2], input_ids.shape[0], cache.keys.shape[4])
    row = KVCache(jnp.zeros(shape, cache.keys.dtype), jnp.zeros(shape, cache.values.dtype), jnp.zeros((1,), jnp.int32))
    logits, row = extend(params, config, row, input_ids[None], attention_mask[None], all_logits=all_logits, window=1)
    start = (0, slot, 0, 0, 0)
    new_cache = KVCache(jax.lax.dynamic_update_slice(cache.keys, row.keys, start),
                        jax.lax.dynamic_update_slice(cache.values, row.values, start),
                        jax.lax.dynamic_update_slice_in_dim(cache.lengths, row.lengths, slot, axis=0))
    return logits[0], new_cache
