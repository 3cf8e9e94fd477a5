"""Masked grouped-query softmax attention, dense or blockwise over keys (same numbers, less memory).

Queries are grouped per key/value head ([B, T, Hkv, G, D]) instead of repeating keys, the same arithmetic as HF's
repeat_kv (query head h reads key/value head h // G). Scores and softmax are float32. A fully masked query row
(padding) averages all values uniformly instead of producing NaN, in both forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MASKED_SCORE = float(np.finfo(np.float32).min)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                      precision: jax.lax.Precision = jax.lax.Precision.DEFAULT, block_size: int = 0) -> jax.Array:
    """Attention of q [B, T, Hkv, G, D] over k, v [B, S, Hkv, D] where mask [B, T, S] is True -> [B, T, Hkv, G, D].

    block_size 0 materialises all [T, S] scores; a positive block size streams keys in blocks with an online
    softmax, each block rematerialised in the backward pass, so memory grows with T x block_size instead.
    """
    if block_size <= 0 or block_size >= k.shape[1]:
        return _dense_attention(q, k, v, mask, precision)
    return _blockwise_attention(q, k, v, mask, precision, block_size)


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     precision: jax.lax.Precision) -> jax.Array:
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32, precision=precision) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=precision)


def _blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                         precision: jax.lax.Precision, block_size: int) -> jax.Array:
    batch, length, kv_heads, groups, head_dim = q.shape
    keys = k.shape[1]
    num_blocks = -(-keys // block_size)
    pad = num_blocks * block_size - keys
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    k_blocks = k.reshape(batch, num_blocks, block_size, kv_heads, head_dim).swapaxes(0, 1)
    v_blocks = v.reshape(batch, num_blocks, block_size, kv_heads, head_dim).swapaxes(0, 1)
    mask_blocks = mask.reshape(batch, length, num_blocks, block_size).transpose(2, 0, 1, 3)
    # Padding keys score -inf (weight exactly 0), so a fully masked row still averages only the S real keys.
    pad_scores = jnp.where(jnp.arange(num_blocks * block_size) < keys, 0.0, -jnp.inf).reshape(num_blocks, block_size)
    scale = head_dim ** -0.5

    @jax.checkpoint
    def step(carry: tuple[jax.Array, jax.Array, jax.Array], block: tuple[jax.Array, ...]):
        running_max, normaliser, accumulated = carry
        k_block, v_block, mask_block, pad_block = block
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_block, preferred_element_type=jnp.float32,
                            precision=precision) * scale
        scores = jnp.where(mask_block[:, None, None, :, :], scores, MASKED_SCORE) + pad_block
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        weights = jnp.exp(scores - new_max[..., None])
        rescale = jnp.exp(running_max - new_max)
        normaliser = normaliser * rescale + weights.sum(axis=-1)
        accumulated = accumulated * rescale[..., None] + jnp.einsum(
            "bkgts,bskd->bkgtd", weights.astype(v.dtype), v_block, preferred_element_type=jnp.float32,
            precision=precision)
        return (new_max, normaliser, accumulated), None

    stats_shape = (batch, kv_heads, groups, length)
    init = (jnp.full(stats_shape, MASKED_SCORE, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32))
    (_, normaliser, accumulated), _ = jax.lax.scan(step, init, (k_blocks, v_blocks, mask_blocks, pad_scores))
    out = accumulated / normaliser[..., None]
    return out.transpose(0, 3, 1, 2, 4).astype(v.dtype)
