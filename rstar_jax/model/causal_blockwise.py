"""Causal self-attention over packed rows in query x key blocks, skipping every block above the diagonal.

The training attention of issue 12 (DESIGN "Functional learner"): the same numbers as the dense reference
(`attention.grouped_attention` under `segments.causal_segment_mask`) at half the score work and without storing
any [T, T] array for the backward pass.

Layout. The row is cut into n blocks of `block` tokens. Diagonal band d pairs every query block i >= d with key
block i - d, so one band is ONE batched matmul over n - d block pairs (blocks lead the arrays, so a band is a
contiguous slice), and the n bands cover exactly the n (n + 1) / 2 blocks on or below the diagonal. On XLA:CPU a
few large dots run near the matmul peak where a loop over single blocks would not. The G query heads of a key/value
head share its keys, so a block's query matrix is [G x block, D].

Numerics. Forward: an online softmax over the bands (running max, normaliser and output, all float32), saving
only the output and each query's log-sum-exp. Backward (FlashAttention-2's): each band's probabilities are
recomputed from the saved log-sum-exp, so memory stays O(T x block). A fully masked query row (padding before a
row's first real token) averages the keys of its visited blocks uniformly: finite, and never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.model.segments import allowed_keys

MASKED_SCORE = float(np.finfo(np.float32).min)
Blocks = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def causal_blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block: int,
                               precision: jax.lax.Precision = jax.lax.Precision.DEFAULT) -> jax.Array:
    """Causal attention of q [B, T, Hkv, G, D] over k, v [B, T, Hkv, D] within segments [B, T] -> [B, T, Hkv, G, D].

    Query t reads key s when s <= t and `segments.allowed_keys` allows it; `block` (> 0) is the query and key block
    length (T is padded up to a multiple of it with padding tokens).
    """
    if block <= 0:
        raise ValueError(f"causal blockwise attention needs a positive block size, got {block}")
    batch, length, kv_heads, groups, head_dim = q.shape
    blocks = -(-length // block)
    pad = blocks * block - length
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    q_blocks = q.reshape(batch, blocks, block, kv_heads, groups, head_dim).transpose(1, 0, 3, 4, 2, 5)
    k_blocks, v_blocks = (x.reshape(batch, blocks, block, kv_heads, head_dim).transpose(1, 0, 3, 2, 4) for x in (k, v))
    segment_blocks = segment_ids.reshape(batch, blocks, block).swapaxes(0, 1)
    out = _banded_attention(q_blocks, k_blocks, v_blocks, segment_blocks, precision)
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, blocks * block, kv_heads, groups, head_dim)[:, :length]


def _band_scores(q_blocks: jax.Array, k_blocks: jax.Array, segment_blocks: jax.Array, band: int,
                 precision: jax.lax.Precision) -> jax.Array:
    """Masked, scaled float32 scores [n - band, B, Hkv, G, block, block] of query blocks i >= band against key
    blocks i - band. Only the diagonal band needs the causal triangle; every band needs the segment rule."""
    blocks, block = q_blocks.shape[0], q_blocks.shape[-2]
    queries, keys = q_blocks[band:], k_blocks[:blocks - band]
    scores = jnp.einsum("nbhgqd,nbhkd->nbhgqk", queries, keys, preferred_element_type=jnp.float32,
                        precision=precision) * (q_blocks.shape[-1] ** -0.5)
    allowed = allowed_keys(segment_blocks[band:], segment_blocks[:blocks - band])  # [n - band, B, block, block]
    if band == 0:
        allowed = allowed & (jnp.arange(block)[:, None] >= jnp.arange(block)[None, :])
    return scores + jnp.where(allowed, 0.0, MASKED_SCORE)[:, :, None, None]


def _suffix_update(full: jax.Array, band: int, value: jax.Array) -> jax.Array:
    """`full` with blocks band.. replaced by `value` (an in-place dynamic-update-slice, not a copy of `full`)."""
    return jax.lax.dynamic_update_slice_in_dim(full, value.astype(full.dtype), band, axis=0)


def _forward(q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array, segment_blocks: jax.Array,
             precision: jax.lax.Precision) -> tuple[jax.Array, jax.Array]:
    """Output blocks [n, B, Hkv, G, block, D] (v's dtype) and the log-sum-exp [n, B, Hkv, G, block] (float32)."""
    blocks = q_blocks.shape[0]
    running_max = normaliser = accumulated = None
    for band in range(blocks):
        scores = _band_scores(q_blocks, k_blocks, segment_blocks, band, precision)
        values = v_blocks[:blocks - band]
        if band == 0:
            running_max = scores.max(axis=-1)
            weights = jnp.exp(scores - running_max[..., None])
            normaliser = weights.sum(axis=-1)
            accumulated = _weighted_values(weights, values, precision)
            continue
        old_max = running_max[band:]
        new_max = jnp.maximum(old_max, scores.max(axis=-1))
        rescale = jnp.exp(old_max - new_max)
        weights = jnp.exp(scores - new_max[..., None])
        running_max = _suffix_update(running_max, band, new_max)
        normaliser = _suffix_update(normaliser, band, normaliser[band:] * rescale + weights.sum(axis=-1))
        accumulated = _suffix_update(accumulated, band, accumulated[band:] * rescale[..., None]
                                     + _weighted_values(weights, values, precision))
    out = (accumulated / normaliser[..., None]).astype(v_blocks.dtype)
    return out, running_max + jnp.log(normaliser)


def _weighted_values(weights: jax.Array, values: jax.Array, precision: jax.lax.Precision) -> jax.Array:
    """Probabilities (or unnormalised weights) [.., G, q, k] times value blocks [.., k, D], float32 accumulation."""
    return jnp.einsum("nbhgqk,nbhkd->nbhgqd", weights.astype(values.dtype), values,
                      preferred_element_type=jnp.float32, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _banded_attention(q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array, segment_blocks: jax.Array,
                      precision: jax.lax.Precision) -> jax.Array:
    return _forward(q_blocks, k_blocks, v_blocks, segment_blocks, precision)[0]


def _banded_attention_fwd(q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array, segment_blocks: jax.Array,
                          precision: jax.lax.Precision) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, log_normaliser = _forward(q_blocks, k_blocks, v_blocks, segment_blocks, precision)
    return out, (q_blocks, k_blocks, v_blocks, segment_blocks, out, log_normaliser)


def _banded_attention_bwd(precision: jax.lax.Precision, residuals: tuple[jax.Array, ...],
                          d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    q_blocks, k_blocks, v_blocks, segment_blocks, out, log_normaliser = residuals
    blocks = q_blocks.shape[0]
    scale = q_blocks.shape[-1] ** -0.5
    # D_i = sum_d dO_id O_id: the softmax Jacobian's row term, once per query.
    row_term = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    d_q = d_k_t = d_v_t = None
    for band in range(blocks):
        keys = blocks - band
        queries, key_blocks, value_blocks, band_d_out = q_blocks[band:], k_blocks[:keys], v_blocks[:keys], d_out[band:]
        probs = jnp.exp(_band_scores(q_blocks, k_blocks, segment_blocks, band, precision)
                        - log_normaliser[band:, ..., None])
        d_probs = jnp.einsum("nbhgqd,nbhkd->nbhgqk", band_d_out, value_blocks, preferred_element_type=jnp.float32,
                             precision=precision)
        d_scores = (probs * (d_probs - row_term[band:, ..., None]) * scale).astype(q_blocks.dtype)
        band_d_q = jnp.einsum("nbhgqk,nbhkd->nbhgqd", d_scores, key_blocks, preferred_element_type=jnp.float32,
                              precision=precision)
        # Sums over a block's queries, taken as dO^T P and Q^T dS ([D, key] results): the small operand is the one
        # transposed. As P^T dO and dS^T Q, XLA:CPU first transposed the [G x block, block] probabilities and
        # their gradient, which cost more than the matmuls (measured).
        band_d_v_t = jnp.einsum("nbhgqd,nbhgqk->nbhdk", band_d_out, probs.astype(band_d_out.dtype),
                                preferred_element_type=jnp.float32, precision=precision)
        band_d_k_t = jnp.einsum("nbhgqd,nbhgqk->nbhdk", queries, d_scores, preferred_element_type=jnp.float32,
                                precision=precision)
        if band == 0:  # the diagonal band covers every block: it starts the sums
            d_q, d_k_t, d_v_t = band_d_q, band_d_k_t, band_d_v_t
            continue
        d_q = _suffix_update(d_q, band, d_q[band:] + band_d_q)
        d_k_t = jax.lax.dynamic_update_slice_in_dim(d_k_t, d_k_t[:keys] + band_d_k_t, 0, axis=0)
        d_v_t = jax.lax.dynamic_update_slice_in_dim(d_v_t, d_v_t[:keys] + band_d_v_t, 0, axis=0)
    return (d_q.astype(q_blocks.dtype), d_k_t.swapaxes(-1, -2).astype(k_blocks.dtype),
            d_v_t.swapaxes(-1, -2).astype(v_blocks.dtype), None)


_banded_attention.defvjp(_banded_attention_fwd, _banded_attention_bwd)
