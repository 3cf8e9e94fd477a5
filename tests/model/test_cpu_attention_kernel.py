"""The fused XLA:CPU attention kernel (`rstar_jax.kernels`, issue 12) at the shapes its vectorised paths take: head
dims 32, 64, 128 and 48 (padded to whole vector tiles) with grouped query heads, rows longer than one block, packed
segments (tiles it masks, skips and computes unmasked) and padding, against the dense reference within 1e-5; what it
refuses; and that remat policy 'dots_attention_saveable' keeps its forward output instead of calling it again in the
backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.kernels.build import cache_dir, load_kernel
from rstar_jax.kernels.cpu_attention import SOURCE, cpu_fused_attention
from rstar_jax.model import ModelConfig, forward, init_params, positions_from_mask
from rstar_jax.model.attention import grouped_attention
from rstar_jax.model.segments import causal_segment_mask


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
def test_kernel_equals_dense_reference_with_gradients(head_dim):
    rng = np.random.default_rng(head_dim)
    batch, length, kv_heads, groups = 4, 150, 2, 2  # 150 tokens: 3 blocks of 64 (the last partial)
    segments = np.ones((batch, length), np.int32)
    segments[1, :40], segments[1, 40:90], segments[1, 90:] = 0, 1, 2  # left padding, then two packed sequences
    segments[2, 100:] = 0  # right padding
    segments[3, 64:] = 2  # sequences on block boundaries: whole blocks of one segment that read or skip others
    segments = jnp.asarray(segments)
    q = jnp.asarray(rng.normal(size=(batch, length, kv_heads, groups, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    mask = causal_segment_mask(segments)
    live = np.asarray(mask.any(axis=-1))
    assert live.sum() == batch * length - 40
    cotangent = jnp.asarray(rng.normal(size=q.shape) * live[:, :, None, None, None], jnp.float32)

    def loss(fused, q, k, v):
        out = cpu_fused_attention(q, k, v, segments) if fused else grouped_attention(q, k, v, mask)
        return jnp.sum(out * cotangent), out

    gradient = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (_, expected), expected_grads = gradient(False, q, k, v)
    (_, actual), actual_grads = gradient(True, q, k, v)
    np.testing.assert_allclose(np.asarray(actual)[live], np.asarray(expected)[live], rtol=1e-5, atol=1e-5)
    assert not np.asarray(actual)[~live].any()  # a query that reads no key gets 0
    for name, got, want in zip("qkv", actual_grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_kernel_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RSTAR_KERNEL_CACHE", str(tmp_path))
    load_kernel.cache_clear()
    try:
        library = load_kernel(SOURCE)
        built = list(tmp_path.glob("cpu_attention-*.so"))
        assert cache_dir() == tmp_path and len(built) == 1 and library._name == str(built[0])
        mtime = built[0].stat().st_mtime_ns
        load_kernel.cache_clear()
        load_kernel(SOURCE)
        assert built[0].stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 1
    finally:
        load_kernel.cache_clear()


def test_kernel_refuses_other_dtypes():
    q = jnp.zeros((1, 4, 1, 1, 32), jnp.bfloat16)
    k = jnp.zeros((1, 4, 1, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="computes in float32"):
        cpu_fused_attention(q, k, k, jnp.ones((1, 4), jnp.int32))


@pytest.mark.parametrize("policy, forward_calls", [("dots_attention_saveable", 1), ("dots_saveable", 2), ("full", 2)])
def test_dots_attention_saveable_keeps_the_kernels_output_instead_of_calling_it_again(policy, forward_calls):
    # The layer body of the gradient program: the forward call once, plus once more where remat recomputes it.
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                         num_kv_heads=2, head_dim=32, attention_impl="cpu_fused", remat_policy=policy)
    params = init_params(config, jax.random.key(0))
    ids = jnp.ones((2, 32), jnp.int32)
    mask = jnp.ones((2, 32), jnp.int32)
    positions = positions_from_mask(mask)
    gradient = jax.jit(jax.grad(lambda p: forward(p, config, ids, positions, mask).sum()))
    program = gradient.lower(params).compile().as_text()
    assert program.count("rstar_cpu_attention_forward") == forward_calls
    assert program.count("rstar_cpu_attention_backward") == 1
