"""Blockwise attention gives the dense attention's outputs and gradients (it only changes memory); attention over a
head-major cache plus the call's own keys gives the dense attention over both written into one key sequence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import forward, init_params
from rstar_jax.model.attention import cached_attention, grouped_attention
from rstar_jax.model.config import ModelConfig


def causal_left_padded_mask(lengths: list[int], width: int) -> np.ndarray:
    """[B, T, T] causal mask over left-padded rows; a zero-length row is fully masked."""
    real = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    causal = np.tril(np.ones((width, width), bool))
    return causal[None] & real[:, None, :]


def test_cached_attention_equals_dense_attention_over_cache_then_new_keys():
    rng = np.random.default_rng(1)
    batch, new, slots, kv_heads, groups, dim = 3, 4, 9, 2, 3, 8
    q = jnp.asarray(rng.normal(size=(batch, new, kv_heads, groups, dim)), jnp.float32)
    cache_k, cache_v = (jnp.asarray(rng.normal(size=(batch, kv_heads, slots, dim)), jnp.float32) for _ in range(2))
    new_k, new_v = (jnp.asarray(rng.normal(size=(batch, new, kv_heads, dim)), jnp.float32) for _ in range(2))
    lengths = np.array([5, 0, 9])  # cached tokens per row; row 1 is empty
    cached_mask = np.arange(slots)[None, None, :] < lengths[:, None, None]
    new_mask = causal_left_padded_mask([4, 2, 0], new)  # row 2 has no new token: every score masked
    out = cached_attention(q, cache_k, cache_v, new_k, new_v, jnp.asarray(cached_mask), jnp.asarray(new_mask))
    keys = jnp.concatenate([cache_k.transpose(0, 2, 1, 3), new_k], axis=1)
    values = jnp.concatenate([cache_v.transpose(0, 2, 1, 3), new_v], axis=1)
    mask = np.concatenate([np.broadcast_to(cached_mask, (batch, new, slots)), new_mask], axis=-1)
    np.testing.assert_allclose(out, grouped_attention(q, keys, values, jnp.asarray(mask)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_size", [1, 4])
def test_blockwise_equals_dense_with_gradients(block_size):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, 11, 2, 3, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, 11, 2, 8)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(causal_left_padded_mask([11, 6, 0], 11))
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(impl_block, q, k, v):
        return jnp.sum(grouped_attention(q, k, v, mask, block_size=impl_block) * cotangent)

    dense_out = grouped_attention(q, k, v, mask)
    block_out = grouped_attention(q, k, v, mask, block_size=block_size)
    np.testing.assert_allclose(block_out, dense_out, rtol=1e-5, atol=1e-6)
    dense_grads = jax.grad(loss, argnums=(1, 2, 3))(0, q, k, v)
    block_grads = jax.grad(loss, argnums=(1, 2, 3))(block_size, q, k, v)
    for dense_grad, block_grad in zip(dense_grads, block_grads):
        np.testing.assert_allclose(block_grad, dense_grad, rtol=1e-4, atol=1e-5)


def test_model_with_blockwise_attention_matches_plain_model():
    config = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=12)
    blocked = dataclasses.replace(config, attention_block_size=3)
    params = init_params(config, jax.random.key(0))
    ids = np.random.default_rng(1).integers(0, 64, (2, 10)).astype(np.int32)
    mask = np.ones((2, 10), np.int32)
    mask[1, :4] = 0
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    expected = np.asarray(forward(params, config, ids, positions, mask))
    actual = np.asarray(forward(params, blocked, ids, positions, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(actual[real], expected[real], rtol=1e-5, atol=1e-5)
