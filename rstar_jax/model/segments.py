"""Segment ids: which tokens of a row belong together, so several short sequences can share one training row.

A row's `segment_ids` [T] holds 0 on padding and k > 0 on the tokens of its k-th sequence; a plain 0/1 attention
mask is the one-sequence case, so every function here gives the old padding-mask numbers on such a mask. Packing
short trajectories into one row instead of padding each to the longest (issue 12; DESIGN "Functional learner":
shapes bucketed, few compiles) needs exactly two things from the model: attention that never crosses a segment
boundary (`allowed_keys`) and RoPE positions that restart at each segment (`segment_positions`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


def allowed_keys(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """[..., Tq, Tk] True where a query may read a key, ignoring causality: the key is a real token (segment > 0)
    and the query is in its segment, or the query is padding (a padding query reads every real key, as under the
    plain padding mask; its output is never used). Segment ids [..., Tq] and [..., Tk]."""
    query = query_segments[..., :, None]
    key = key_segments[..., None, :]
    return (key > 0) & ((query == key) | (query == 0))


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] True where query t may read key s: s <= t and `allowed_keys` (the dense reference mask)."""
    length = segment_ids.shape[-1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    return causal[None] & allowed_keys(segment_ids, segment_ids)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """RoPE positions [B, T] (int32): a real token's count of earlier real tokens of its segment, so each packed
    sequence starts at 0; padding gets the row's count of earlier real tokens (clipped at 0).

    On a 0/1 mask this is cumsum(mask) - 1 clipped at 0, the padded-batch rule, so left padding does not shift
    RoPE. Ids must lie in [0, T]. Linear in T: each segment's offset is the smallest running count over its tokens.
    """
    ids = segment_ids.astype(jnp.int32)
    count = jnp.cumsum(ids > 0, axis=-1, dtype=jnp.int32) - 1
    start = per_segment(count, ids, jax.ops.segment_min)
    return jnp.where(ids > 0, count - start, jnp.maximum(count, 0))


def per_segment(values: jax.Array, segment_ids: jax.Array, reduce: Callable[..., jax.Array]) -> jax.Array:
    """[B, T]: at each position, `reduce` (`jax.ops.segment_sum`, `segment_min`, ...) of `values` [B, T] over the
    positions of its row with its segment id (padding, id 0, is a segment of its own). Ids must lie in [0, T]: each
    row's ids are offset by row x (T + 1), so one flat segment reduction serves the whole batch."""
    ids = segment_ids.astype(jnp.int32)
    batch, length = ids.shape
    flat = ids + (jnp.arange(batch, dtype=jnp.int32) * (length + 1))[:, None]
    totals = reduce(values.reshape(-1), flat.reshape(-1), num_segments=batch * (length + 1))
    return totals[flat]


class SegmentIds(NamedTuple):
    """A batch's segment ids [B, T] handed to the layers in place of a [B, T, T] mask: causal self-attention within
    segments, in the configured implementation (`attention.causal_attention`)."""

    ids: jax.Array
