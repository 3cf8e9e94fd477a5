"""Blockwise attention gives the dense attention's outputs and gradients (it only changes memory); attention over a
head-major cache plus the call's own keys gives the dense attention over both written into one key sequence; every
training attention implementation (issue 12), the fused C++ kernel included, equals the dense reference within 1e-5
in float32 on packed rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import forward, init_params
from rstar_jax.model.attention import cached_attention, causal_attention, fused_implementation, grouped_attention
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.segments import causal_segment_mask


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


def packed_segments() -> np.ndarray:
    """[4, 21] segment ids: one full row; three packed sequences then padding; left padding; a row whose only key
    for its first queries is itself (segments of length 1)."""
    ids = np.zeros((4, 21), np.int32)
    ids[0] = 1
    ids[1, :7], ids[1, 7:15], ids[1, 15:19] = 1, 2, 3
    ids[2, 5:] = 1
    ids[3] = np.arange(1, 22) // 2 + 1
    return ids


IMPLEMENTATIONS = [("causal_blockwise", 3), ("causal_blockwise", 8), ("causal_blockwise", 20),
                   ("causal_blockwise", 21), ("dot_product", 0), ("dense", 5), ("cpu_fused", 0)]


@pytest.mark.parametrize("impl,block_size", IMPLEMENTATIONS)
def test_training_attention_equals_dense_reference_with_gradients(impl, block_size):
    """Outputs and q/k/v gradients within 1e-5 of `grouped_attention` under the causal segment mask, on every query
    that reads at least one key (the left-padding queries of row 2 read none; their output is never used).
    Block sizes that do not divide T (padded up to 7 and 3 blocks, and 2 blocks of 20 for 21 tokens) and the
    one-block row (21: the dense form) are included."""
    rng = np.random.default_rng(3)
    segments = jnp.asarray(packed_segments())
    q = jnp.asarray(rng.normal(size=(4, 21, 2, 3, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, 21, 2, 8)), jnp.float32) for _ in range(2))
    mask = causal_segment_mask(segments)
    live = np.asarray(mask.any(axis=-1))
    assert not live.all() and live.sum() == 4 * 21 - 5
    cotangent = jnp.asarray(rng.normal(size=q.shape) * live[:, :, None, None, None], jnp.float32)

    def loss(use_reference, q, k, v):
        out = (grouped_attention(q, k, v, mask) if use_reference
               else causal_attention(q, k, v, segments, impl, block_size=block_size))
        return jnp.sum(out * cotangent), out

    gradient = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (_, expected), expected_grads = gradient(True, q, k, v)
    (_, actual), actual_grads = gradient(False, q, k, v)
    assert np.isfinite(np.asarray(actual)).all()
    np.testing.assert_allclose(np.asarray(actual)[live], np.asarray(expected)[live], rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", actual_grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_a_packed_sequence_attends_as_if_alone():
    """Segment 2 of row 1 (positions 7..14) gives the outputs of the same queries and keys run as their own row."""
    rng = np.random.default_rng(4)
    segments = jnp.asarray(packed_segments())
    q = jnp.asarray(rng.normal(size=(4, 21, 2, 3, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, 21, 2, 8)), jnp.float32) for _ in range(2))
    attention = jax.jit(lambda q, k, v, segments: causal_attention(q, k, v, segments, "causal_blockwise",
                                                                  block_size=4))
    packed = attention(q, k, v, segments)
    alone = attention(q[1:2, 7:15], k[1:2, 7:15], v[1:2, 7:15], jnp.ones((1, 8), jnp.int32))
    np.testing.assert_allclose(packed[1, 7:15], alone[0], rtol=1e-5, atol=1e-6)


def test_unknown_implementation_and_missing_block_size_are_refused():
    q = jnp.zeros((1, 4, 1, 1, 2))
    k = jnp.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        causal_attention(q, k, k, jnp.ones((1, 4), jnp.int32), "flash")
    with pytest.raises(ValueError, match="positive block size"):
        causal_attention(q, k, k, jnp.ones((1, 4), jnp.int32), "causal_blockwise", block_size=0)
    with pytest.raises(ValueError, match="needs attention_block_size > 0"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    attention_impl="causal_blockwise")


@pytest.mark.parametrize("dtype,platform,expected", [
    ("bfloat16", "cuda 12080", "cudnn"), ("float16", "cuda 12080", "cudnn"), ("float32", "cuda 12080", "xla"),
    ("bfloat16", "rocm 60300", "xla"), ("bfloat16", "cpu", "xla")])
def test_fused_attention_uses_cudnn_only_on_cuda_for_16_bit_inputs(dtype, platform, expected):
    assert fused_implementation(dtype, platform) == expected


def test_fused_attention_on_this_backend_is_xla():
    assert fused_implementation(jnp.bfloat16) == "xla"  # the CPU test machine


@pytest.mark.parametrize("impl,block_size", [("dense", 3), ("causal_blockwise", 4), ("dot_product", 0),
                                             ("cpu_fused", 0)])
def test_model_with_each_training_attention_matches_plain_model(impl, block_size):
    """The whole model's logits on real tokens (a left-padded row included): key-streamed dense attention, the
    causal blockwise form, jax.nn.dot_product_attention and the fused C++ kernel against plain dense attention."""
    config = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=12)
    other = dataclasses.replace(config, attention_impl=impl, attention_block_size=block_size)
    params = init_params(config, jax.random.key(0))
    ids = np.random.default_rng(1).integers(0, 64, (2, 10)).astype(np.int32)
    mask = np.ones((2, 10), np.int32)
    mask[1, :4] = 0
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    expected = np.asarray(forward(params, config, ids, positions, mask))
    actual = np.asarray(forward(params, other, ids, positions, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(actual[real], expected[real], rtol=1e-5, atol=1e-5)
