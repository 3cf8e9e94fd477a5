"""The JAX engine's device work: its jitted steps and the buckets that bound their shapes.

`prefill_and_sample` starts one request in one slot (the slot is a traced index) from its prompt padded to a
bucket length; `clone_and_sample` starts one in a slot by copying the cache of another that holds the same prompt
(the 2G rollouts of a GRPO group share their first prompt: one prefill serves them all); `extend_and_sample` starts
one from the first tokens another slot (or the same one) holds, prefilling only the rest of its prompt, padded to a
turn bucket (a trajectory's next turn: its previous turn's tokens are still cached); `copy_row` moves a row between
the decoding cache and the park store; `decode_and_sample` feeds every slot its pending token and samples the next,
a fixed number of times per call, attending over a window of the cache that covers the longest running sequence.
Their shapes depend only on (slots, park rows, max_len, bucket or window, steps), so an engine compiles
len(buckets) + len(turn buckets) + len(windows) + 3 programs at most and nothing once warm (DESIGN "Functional
learner": shapes are bucketed so a step compiles a bounded number of times).
"""

from __future__ import annotations

import bisect
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from rstar_jax.model import KVCache, ModelConfig, decode_step, extend, prefill_slot
from rstar_jax.model.lm import Params
from rstar_jax.rollout.sampling import sample_tokens

SMALLEST_BUCKET = 16
SMALLEST_DECODE_WINDOW = 128  # below this, a smaller window saves less than its extra program costs to compile
LARGEST_TURN_BUCKET = 128  # a longer suffix goes in several calls (a turn's new tokens: a tool response and a header)


def power_of_two_buckets(max_len: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest` below max_len, then max_len itself: every admissible prompt fits one."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (a prompt token and a new one), got {max_len}")
    if smallest < 1:
        raise ValueError(f"the smallest prefill bucket must be positive, got {smallest}")
    buckets = []
    size = smallest
    while size < max_len:
        buckets.append(size)
        size *= 2
    return (*buckets, max_len)


def check_buckets(buckets: Sequence[int], max_len: int, what: str = "prefill buckets") -> tuple[int, ...]:
    """Sorted, de-duplicated buckets; an error naming `what` unless they are in [1, max_len] and the largest holds
    max_len - 1."""
    result = tuple(sorted({int(b) for b in buckets}))
    if not result or result[0] < 1 or result[-1] > max_len:
        raise ValueError(f"{what} must be non-empty and within [1, max_len={max_len}], got {tuple(buckets)}")
    if result[-1] < max_len - 1:
        raise ValueError(f"the largest of the {what} ({result[-1]}) cannot hold the longest admissible prompt "
                         f"({max_len - 1} tokens for max_len={max_len})")
    return result


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding `length` tokens (buckets sorted); an error if none does."""
    index = bisect.bisect_left(buckets, length)
    if index == len(buckets):
        raise ValueError(f"a prompt of {length} tokens exceeds the largest prefill bucket {buckets[-1]}")
    return buckets[index]


def suffix_chunks(length: int, buckets: Sequence[int]) -> list[tuple[int, int]]:
    """(tokens, bucket) of each call that prefills a suffix of `length` tokens: as many of the largest bucket as
    needed, then the smallest bucket that holds the rest (buckets sorted)."""
    if length < 1:
        raise ValueError(f"a suffix has at least one token, got {length}")
    largest = buckets[-1]
    full, rest = divmod(length, largest)
    return [(largest, largest)] * full + ([(rest, bucket_for(rest, buckets))] if rest else [])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def prefill_and_sample(params: Params, config: ModelConfig, cache: KVCache, slot: jax.Array, prompt_ids: jax.Array,
                       prompt_mask: jax.Array, temperature: jax.Array, top_p: jax.Array,
                       seed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, KVCache]:
    """Empty `slot`, cache the prompt (ids [T] right-padded, mask [T]) and sample the first new token.

    Returns (token, its temperature-1 log-prob, the logits [V] it was sampled from, the cache); the token is not
    cached yet (the next decode feeds it).
    """
    logits, cache = prefill_slot(params, config, cache, slot, prompt_ids, prompt_mask, all_logits=False)
    token, logprob = _sample_one(logits, temperature, top_p, seed, jnp.sum(prompt_mask, dtype=jnp.int32))
    return token, logprob, logits, cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def clone_and_sample(cache: KVCache, source: jax.Array, slot: jax.Array, length: jax.Array, logits: jax.Array,
                     temperature: jax.Array, top_p: jax.Array, seed: jax.Array) -> tuple[jax.Array, jax.Array, KVCache]:
    """Start `slot` with the first `length` cached tokens of `source` and sample its first new token from `logits`.

    `source` must hold a prompt of `length` tokens (decoding since then only appended to it) and `logits` [V] must
    be what its prefill returned: the cache and the sample are then exactly those `prefill_and_sample` would give
    for the same prompt and seed, for a copy of one slot instead of a forward pass. Returns (token, log-prob, cache).
    """
    def copy_row(stacked: jax.Array) -> jax.Array:  # [L, B, ...]: slot's row becomes source's
        return jax.lax.dynamic_update_slice_in_dim(stacked, jax.lax.dynamic_slice_in_dim(stacked, source, 1, 1),
                                                   slot, axis=1)

    cache = KVCache(copy_row(cache.keys), copy_row(cache.values), cache.lengths.at[slot].set(length))
    token, logprob = _sample_one(logits, temperature, top_p, seed, length)
    return token, logprob, cache


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def extend_and_sample(params: Params, config: ModelConfig, cache: KVCache, source: jax.Array, slot: jax.Array,
                      start: jax.Array, suffix_ids: jax.Array, suffix_mask: jax.Array, temperature: jax.Array,
                      top_p: jax.Array, seed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, KVCache]:
    """Start `slot` with the first `start` cached tokens of `source` (any slot, `slot` itself included) followed
    by the suffix (ids [T] right-padded, mask [T]), and sample the next token.

    The suffix attends over the `start` cached positions and itself (`kv_cache.extend` over the whole row): the
    same computation as a prefill of the whole prompt up to float rounding, for T tokens instead of start + T.
    Returns (token, its temperature-1 log-prob, the logits [V] after the suffix, the cache); as after a prefill,
    the token is not cached yet.
    """
    row = KVCache(jax.lax.dynamic_slice_in_dim(cache.keys, source, 1, axis=1),
                  jax.lax.dynamic_slice_in_dim(cache.values, source, 1, axis=1), start[None])
    logits, row = extend(params, config, row, suffix_ids[None], suffix_mask[None], all_logits=False)
    cache = KVCache(jax.lax.dynamic_update_slice_in_dim(cache.keys, row.keys, slot, axis=1),
                    jax.lax.dynamic_update_slice_in_dim(cache.values, row.values, slot, axis=1),
                    cache.lengths.at[slot].set(row.lengths[0]))
    token, logprob = _sample_one(logits[0], temperature, top_p, seed, row.lengths[0])
    return token, logprob, logits[0], cache


@functools.partial(jax.jit, donate_argnames=("target",))
def copy_row(target: KVCache, source: KVCache, row: jax.Array, source_row: jax.Array) -> KVCache:
    """`target`'s `row` becomes a copy of `source`'s `source_row` (keys, values, length): a slot parked in the
    park store, or a parked row brought back into a slot."""
    def copy(to: jax.Array, of: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(to, jax.lax.dynamic_slice_in_dim(of, source_row, 1, 1), row, 1)

    return KVCache(copy(target.keys, source.keys), copy(target.values, source.values),
                   target.lengths.at[row].set(source.lengths[source_row]))


def _sample_one(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seed: jax.Array,
                position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sample_tokens` for one request: logits [V] -> (token, its temperature-1 log-prob)."""
    tokens, logprobs = sample_tokens(logits[None], temperature[None], top_p[None], seed[None], position[None])
    return tokens[0], logprobs[0]


@functools.partial(jax.jit, static_argnames=("config", "steps", "window"), donate_argnames=("cache",))
def decode_and_sample(params: Params, config: ModelConfig, cache: KVCache, token_ids: jax.Array, active: jax.Array,
                      temperature: jax.Array, top_p: jax.Array, seeds: jax.Array, steps: int = 1,
                      window: int | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
    """`steps` decode steps in one call: each caches every active slot's pending token ([B]) and samples the next.

    Returns (tokens [steps, B], their temperature-1 log-probs [steps, B], the cache); inactive slots are left
    unchanged and their rows are junk. Running several steps per call saves a host round trip per token; the
    host discards what a slot samples after its turn ended (cache writes past max_len are dropped). Attention
    reads the first `window` cache positions (see `kv_cache.extend`): every active slot must hold at most
    `window - steps + 1` cached tokens when the call starts.
    """
    def step(carry: tuple[KVCache, jax.Array], _: None) -> tuple[tuple[KVCache, jax.Array], tuple[jax.Array, ...]]:
        cache, pending = carry
        logits, cache = decode_step(params, config, cache, pending, active, window=window)
        tokens, logprobs = sample_tokens(logits, temperature, top_p, seeds, cache.lengths)
        return (cache, tokens), (tokens, logprobs)

    (cache, _), (tokens, logprobs) = jax.lax.scan(step, (cache, token_ids), None, length=steps)
    return tokens, logprobs, cache
