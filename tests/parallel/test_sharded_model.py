"""The real model under the partition rules on 8 simulated CPU devices (issue 2 item 5).

Forward logits and the gradient of a scalar loss (mean next-token log-prob) computed with parameters split over a
(data, fsdp, tensor) mesh must equal the single-device results within 1e-5, the jitted functions must return
arrays with the requested shardings, and the parameters must really be split (per-device shards smaller than the
full arrays).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rstar_jax.model.config import ModelConfig
from rstar_jax.model.kv_cache import decode_step, init_cache, prefill
from rstar_jax.model.lm import forward, init_params, positions_from_mask
from rstar_jax.parallel import (
    activation_sharding,
    cache_shardings,
    make_mesh,
    param_shardings,
    param_specs,
    shard_params,
    use_mesh,
)

BATCH, LENGTH = 8, 12
TOLERANCE = 1e-5

QWEN3 = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, family="qwen3")
QWEN2_TIED = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, family="qwen2", tie_word_embeddings=True)
# Uneven for a (fsdp 4, tensor 2) mesh: vocab 101 and mlp 45 are odd, hidden 30 is not a multiple of 4; only the
# head dimensions (3 * 10 and 1 * 10) split over tensor. The rest falls back to replication.
ODD = ModelConfig(vocab_size=101, hidden_size=30, intermediate_size=45, num_layers=2, num_heads=3,
                  num_kv_heads=1, head_dim=10, family="qwen3")

MESHES = {
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "fsdp8": dict(data=1, fsdp=8, tensor=1),
    "data2_tensor4": dict(data=2, fsdp=1, tensor=4),
}  # fsdp 4 x tensor 2 runs in the uneven-config test below


def padded_batch(config, seed=0):
    """Token ids with left padding on two rows, their mask and positions (as the learner feeds them)."""
    ids = jax.random.randint(jax.random.key(seed), (BATCH, LENGTH), 0, config.vocab_size)
    mask = jnp.ones((BATCH, LENGTH), jnp.int32).at[1, :3].set(0).at[5, :5].set(0)
    return ids, positions_from_mask(mask), mask


def mean_next_token_logprob(params, config, ids, positions, mask):
    """Mean log p(token t+1 | tokens <= t) over real target tokens (the scalar whose gradient is compared), and
    the forward logits it came from."""
    logits = forward(params, config, ids, positions, mask)
    logprobs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logprobs, ids[:, 1:, None], axis=-1)[..., 0]
    weights = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(picked * weights) / jnp.sum(weights), logits


def loss_logits_and_grad(config):
    """((loss, logits), gradient) of `mean_next_token_logprob`: one compiled program checks forward and backward."""
    return jax.value_and_grad(lambda p, *batch: mean_next_token_logprob(p, config, *batch), has_aux=True)


def sharded_step(config, mesh, params):
    """`loss_logits_and_grad` jitted with explicit in/out shardings and traced under `use_mesh`."""
    shardings = param_shardings(params, mesh)
    batch_sharding = activation_sharding(mesh, (BATCH, LENGTH), "batch", "seq")
    logits_sharding = activation_sharding(mesh, (BATCH, LENGTH, config.vocab_size), "batch", "seq", "vocab")
    step = loss_logits_and_grad(config)

    def under_mesh(*args):
        with use_mesh(mesh):
            return step(*args)

    jitted = jax.jit(
        under_mesh,
        in_shardings=(shardings, batch_sharding, batch_sharding, batch_sharding),
        out_shardings=((NamedSharding(mesh, P()), logits_sharding), shardings),
    )
    return jitted, shardings, batch_sharding


def assert_trees_close(actual, expected):
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=TOLERANCE, rtol=TOLERANCE,
                                   err_msg=jax.tree_util.keystr(path))


@functools.cache
def reference(config):
    """Single-device parameters, batch and ((loss, logits), gradient)."""
    params = init_params(config, jax.random.key(0))
    batch = padded_batch(config)
    return params, batch, jax.jit(loss_logits_and_grad(config))(params, *batch)


def assert_sharded_step_matches_reference(config, mesh):
    """Run the sharded step on parameters placed by the rules and compare everything with the single device."""
    params, batch, ((ref_loss, ref_logits), ref_grad) = reference(config)
    step, shardings, batch_sharding = sharded_step(config, mesh, params)
    sharded = shard_params(params, mesh)
    for (path, array), sharding in zip(jax.tree_util.tree_leaves_with_path(sharded),
                                       jax.tree_util.tree_leaves(shardings)):
        assert array.sharding == sharding, jax.tree_util.keystr(path)

    (loss, logits), grad = step(sharded, *jax.device_put(batch, batch_sharding))
    vocab_split = "tensor" if config.vocab_size % mesh.shape["tensor"] == 0 else None
    assert logits.sharding.spec == P(("data", "fsdp"), None, vocab_split)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(float(loss), float(ref_loss), atol=TOLERANCE, rtol=TOLERANCE)
    assert_trees_close(grad, ref_grad)
    assert jax.tree_util.tree_map(lambda g: g.sharding.spec, grad) == param_specs(params, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_forward_and_gradient_equal_single_device(mesh_name):
    assert_sharded_step_matches_reference(QWEN3, make_mesh(**MESHES[mesh_name]))


@pytest.mark.slow
def test_tied_qwen2_with_biases_matches_on_the_3d_mesh():
    params = reference(QWEN2_TIED)[0]
    assert "lm_head" not in params and "bias" in params["layers"]["attn"]["q_proj"]
    assert_sharded_step_matches_reference(QWEN2_TIED, make_mesh(data=2, fsdp=2, tensor=2))


@pytest.mark.slow
def test_parameters_are_really_split_on_the_3d_mesh():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    params = shard_params(reference(QWEN3)[0], mesh)
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    expected = {
        "embed/embedding": (params["embed"]["embedding"], P("tensor", "fsdp"), (64, 32)),
        "q_proj/kernel": (attn["q_proj"]["kernel"], P(None, "fsdp", "tensor"), (2, 32, 32)),
        "k_proj/kernel": (attn["k_proj"]["kernel"], P(None, "fsdp", "tensor"), (2, 32, 16)),
        "o_proj/kernel": (attn["o_proj"]["kernel"], P(None, "tensor", "fsdp"), (2, 32, 32)),
        "gate_proj/kernel": (mlp["gate_proj"]["kernel"], P(None, "fsdp", "tensor"), (2, 32, 48)),
        "down_proj/kernel": (mlp["down_proj"]["kernel"], P(None, "tensor", "fsdp"), (2, 48, 32)),
        "lm_head/kernel": (params["lm_head"]["kernel"], P("fsdp", "tensor"), (32, 64)),
        "q_norm/scale": (attn["q_norm"]["scale"], P(None, None), (2, 16)),
    }
    for name, (array, spec, local_shape) in expected.items():
        assert array.sharding.spec == spec, name
        assert array.addressable_shards[0].data.shape == local_shape, name
        assert len(array.addressable_shards) == 8, name


@pytest.mark.slow
def test_odd_config_falls_back_to_replication_and_still_matches():
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    specs = param_specs(reference(ODD)[0], mesh)
    assert specs["embed"]["embedding"] == P(None, None)
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == P(None, None, "tensor")
    assert specs["layers"]["attn"]["k_proj"]["kernel"] == P(None, None, "tensor")
    assert specs["layers"]["mlp"]["gate_proj"]["kernel"] == P(None, None, None)
    assert specs["layers"]["mlp"]["down_proj"]["kernel"] == P(None, None, None)
    assert specs["lm_head"]["kernel"] == P(None, None)
    assert shard_params(reference(ODD)[0], mesh)["layers"]["attn"]["q_proj"]["kernel"].addressable_shards[
        0].data.shape == (2, 30, 15)
    assert_sharded_step_matches_reference(ODD, mesh)


def prefill_then_decode(params, config, cache, ids, mask, next_tokens):
    """Prefill a padded batch into the cache, then decode one token per slot: both logits and the final cache."""
    prompt_logits, cache = prefill(params, config, cache, ids, mask)
    step_logits, cache = decode_step(params, config, cache, next_tokens)
    return prompt_logits, step_logits, cache


@pytest.mark.slow
def test_sharded_kv_cache_prefill_and_decode_equal_single_device():
    config, mesh, max_len = QWEN3, make_mesh(data=2, fsdp=2, tensor=2), 16
    params, (ids, _, mask), _ = reference(config)
    next_tokens = ids[:, 0]
    expected = jax.jit(prefill_then_decode, static_argnums=1)(
        params, config, init_cache(config, BATCH, max_len), ids, mask, next_tokens)

    cache = init_cache(config, BATCH, max_len)
    cache_placement = cache_shardings(cache, mesh)
    batch_sharding = activation_sharding(mesh, (BATCH, LENGTH), "batch", "seq")
    vocab = config.vocab_size

    def under_mesh(*args):
        with use_mesh(mesh):
            return prefill_then_decode(args[0], config, *args[1:])

    step = jax.jit(
        under_mesh,
        in_shardings=(param_shardings(params, mesh), cache_placement, batch_sharding, batch_sharding,
                      activation_sharding(mesh, (BATCH,), "batch")),
        out_shardings=(activation_sharding(mesh, (BATCH, LENGTH, vocab), "batch", "seq", "vocab"),
                       activation_sharding(mesh, (BATCH, vocab), "batch", "vocab"), cache_placement),
    )
    prompt_logits, step_logits, new_cache = step(shard_params(params, mesh), jax.device_put(cache, cache_placement),
                                                 ids, mask, next_tokens)
    assert new_cache.keys.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    assert new_cache.keys.addressable_shards[0].data.shape == (2, 2, 1, max_len, 16)
    for actual, reference_value in zip((prompt_logits, step_logits, *new_cache), (*expected[:2], *expected[2])):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(reference_value), atol=TOLERANCE, rtol=TOLERANCE)
