"""The functional learner API: init_params' tree, token_logprobs (and entropies, and their gradients) against
log_softmax(forward), invariance to chunking and remat, and mixed precision."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import forward, init_params, positions_from_mask, token_logprobs, token_logprobs_and_entropy
from rstar_jax.model.config import ModelConfig

CONFIG = ModelConfig(family="qwen3", vocab_size=72, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=12, qkv_bias=True, o_bias=True)


def batch(config: ModelConfig, seed: int = 0):
    """Left-padded ids, their positions and mask, and next-token targets (numpy)."""
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, (3, 10)).astype(np.int32)
    mask = np.ones((3, 10), np.int32)
    mask[1, :4] = mask[2, :1] = 0
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)
    return ids, positions, mask, np.roll(ids, -1, axis=1)


def picked_log_softmax(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log_softmax(logits)[..., target] in float64 numpy: the reference for token_logprobs."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def test_init_params_follow_the_fixed_tree():
    params = init_params(CONFIG, jax.random.key(0))
    shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
    L, E, F, V, D = 2, 32, 40, 72, 12
    assert shapes == {
        "embed": {"embedding": (V, E)},
        "layers": {
            "input_norm": {"scale": (L, E)},
            "attn": {"q_proj": {"kernel": (L, E, 4 * D), "bias": (L, 4 * D)},
                     "k_proj": {"kernel": (L, E, 2 * D), "bias": (L, 2 * D)},
                     "v_proj": {"kernel": (L, E, 2 * D), "bias": (L, 2 * D)},
                     "o_proj": {"kernel": (L, 4 * D, E), "bias": (L, E)},
                     "q_norm": {"scale": (L, D)}, "k_norm": {"scale": (L, D)}},
            "post_attn_norm": {"scale": (L, E)},
            "mlp": {"gate_proj": {"kernel": (L, E, F)}, "up_proj": {"kernel": (L, E, F)},
                    "down_proj": {"kernel": (L, F, E)}},
        },
        "final_norm": {"scale": (E,)},
        "lm_head": {"kernel": (E, V)},
    }
    assert isinstance(params, dict) and isinstance(params["layers"], dict)
    host = jax.tree_util.tree_map(np.asarray, params)
    np.testing.assert_array_equal(host["layers"]["input_norm"]["scale"], 1.0)
    assert abs(float(np.std(host["layers"]["mlp"]["up_proj"]["kernel"])) - 0.02) < 0.002
    kernels = host["layers"]["attn"]["q_proj"]["kernel"]
    assert not np.allclose(kernels[0], kernels[1]), "each layer gets its own random draw"
    for again, first in zip(jax.tree_util.tree_leaves(init_params(CONFIG, jax.random.key(0))),
                            jax.tree_util.tree_leaves(host)):
        np.testing.assert_array_equal(np.asarray(again), first)

    tied_qwen2 = dataclasses.replace(CONFIG, family="qwen2", tie_word_embeddings=True, qkv_bias=None, o_bias=False,
                                     qk_norm=None, head_dim=None, param_dtype="bfloat16")
    params = init_params(tied_qwen2, jax.random.key(0))
    assert "lm_head" not in params and "q_norm" not in params["layers"]["attn"]
    assert "bias" in params["layers"]["attn"]["q_proj"] and "bias" not in params["layers"]["attn"]["o_proj"]
    assert params["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 32, 32)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("chunk_size", [3, 10, 64])
def test_token_logprobs_equal_log_softmax_of_forward(chunk_size):
    params = init_params(CONFIG, jax.random.key(1))
    ids, positions, mask, targets = batch(CONFIG)
    expected = picked_log_softmax(np.asarray(forward(params, CONFIG, ids, positions, mask)), targets)
    actual = token_logprobs(params, CONFIG, ids, positions, mask, targets, chunk_size=chunk_size)
    assert actual.shape == (3, 10) and actual.dtype == jnp.float32
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_token_logprobs_gradient_is_invariant_to_chunking_and_remat():
    """The RL loss's gradient: chunked (and rematerialised) log-probs give the forward-based gradient.

    ("full" remat is jax.checkpoint without a policy; dots_saveable covers the policy path. Each gradient costs
    about 6 s of CPU to compile, so the two representative settings are checked.)
    """
    params = init_params(CONFIG, jax.random.key(2))
    ids, positions, mask, targets = batch(CONFIG, seed=1)
    weights = mask.astype(np.float32)

    def via_forward(p):
        logprobs = jax.nn.log_softmax(forward(p, CONFIG, ids, positions, mask))
        return jnp.sum(jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0] * weights)

    expected = jax.jit(jax.grad(via_forward))(params)
    for policy in ("none", "dots_saveable"):
        config = dataclasses.replace(CONFIG, remat_policy=policy)
        grad = jax.jit(jax.grad(lambda p: jnp.sum(
            token_logprobs(p, config, ids, positions, mask, targets, chunk_size=4) * weights)))(params)
        for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grad), jax.tree_util.tree_leaves(expected)):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6, err_msg=f"{policy} {jax.tree_util.keystr(path)}")


def test_left_padding_does_not_change_a_rows_logits():
    params = init_params(CONFIG, jax.random.key(3))
    ids, positions, mask, _ = batch(CONFIG)
    np.testing.assert_array_equal(positions_from_mask(mask), positions)
    np.testing.assert_array_equal(positions[1], [0, 0, 0, 0, 0, 1, 2, 3, 4, 5])
    padded = np.asarray(forward(params, CONFIG, ids, positions, mask))
    alone = ids[1:2, 4:]
    ones = np.ones_like(alone)
    unpadded = np.asarray(forward(params, CONFIG, alone, np.arange(alone.shape[1])[None], ones))
    np.testing.assert_allclose(padded[1, 4:], unpadded[0], rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_argument():
    params = init_params(CONFIG, jax.random.key(0))
    ids, positions, mask, targets = batch(CONFIG)
    with pytest.raises(ValueError, match="attention_mask shape"):
        forward(params, CONFIG, ids, positions, mask[:, :5])
    with pytest.raises(ValueError, match="input_ids must be"):
        forward(params, CONFIG, ids[0], positions[0], mask[0])
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(params, CONFIG, ids, positions, mask, targets[:, :3])


def entropy_of(logits: np.ndarray) -> np.ndarray:
    """-sum p log p over the last axis in float64 numpy."""
    logits = logits.astype(np.float64)
    log_probs = logits - logits.max(axis=-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(axis=-1, keepdims=True))
    return -(np.exp(log_probs) * log_probs).sum(axis=-1)


@pytest.mark.parametrize("tied", [False, True])
def test_fused_logprobs_and_entropy_and_their_gradient_equal_the_forward_based_ones(tied):
    """The fused head (one logits pass forward, one backward, d logits formed by hand) against log_softmax and the
    entropy of `forward`'s logits, values and gradient of a weighted sum of both; chunk 4 does not divide T = 10."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    params = init_params(config, jax.random.key(4))
    ids, positions, mask, targets = batch(config, seed=2)
    logits = np.asarray(forward(params, config, ids, positions, mask))
    logprobs, entropy = token_logprobs_and_entropy(params, config, ids, positions, mask, targets, chunk_size=4)
    np.testing.assert_allclose(logprobs, picked_log_softmax(logits, targets), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, entropy_of(logits), rtol=1e-5, atol=1e-5)
    rng = np.random.default_rng(5)
    w_logprob, w_entropy = (jnp.asarray(rng.normal(size=ids.shape) * mask, jnp.float32) for _ in range(2))

    def via_forward(p):
        out = forward(p, config, ids, positions, mask)
        log_probs = jax.nn.log_softmax(out)
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return jnp.sum(picked * w_logprob + ent * w_entropy)

    def fused(p):
        picked, ent = token_logprobs_and_entropy(p, config, ids, positions, mask, targets, chunk_size=4)
        return jnp.sum(picked * w_logprob + ent * w_entropy)

    expected = jax.jit(jax.grad(via_forward))(params)
    actual = jax.jit(jax.grad(fused))(params)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_mixed_precision_keeps_float32_weights_gradients_and_logprobs():
    """dtype bfloat16 with param_dtype float32 (gin/model/bf16.gin): float32 master weights and gradients, float32
    log-probs (softmax statistics in float32) within bfloat16 rounding of the float32 model's."""
    mixed = dataclasses.replace(CONFIG, dtype="bfloat16")
    params = init_params(CONFIG, jax.random.key(7))
    ids, positions, mask, targets = batch(CONFIG, seed=4)
    exact = token_logprobs(params, CONFIG, ids, positions, mask, targets)
    low = token_logprobs(params, mixed, ids, positions, mask, targets)
    assert low.dtype == jnp.float32
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(low)[real], np.asarray(exact)[real], atol=0.05)
    assert float(np.abs(np.asarray(low) - np.asarray(exact))[real].max()) > 1e-5  # bfloat16 really computed
    grads = jax.grad(lambda p: jnp.sum(token_logprobs(p, mixed, ids, positions, mask, targets) * mask))(params)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(grads))
