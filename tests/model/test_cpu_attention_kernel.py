"""The fused XLA:CPU attention kernel (`rstar_jax.kernels`, issue 12) at the shapes its vectorised paths take: head
dims 32, 64, 128 and 48 (padded to whole vector tiles) with grouped query heads, rows longer than one block, packed
segments (tiles it masks, skips and computes unmasked) and padding, against the dense reference within 1e-5; rows
shorter than a block (T = 1, 2, 7, 63, 65), all-padding rows and batches, left padding and only the last token real,
where a query that reads no key gets 0 and passes back no gradient; Python threads calling it at once; what it
refuses; and that remat policy 'dots_attention_saveable' keeps its forward output instead of calling it again in the
backward pass."""

import threading

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


def awkward_segments(length, all_padding):
    """Segment ids [4, length]: a row of padding only, a row whose last token alone is real, left padding before one
    sequence, and left padding, two packed sequences and right padding; or padding everywhere."""
    segments = np.zeros((4, length), np.int32)
    if not all_padding:
        segments[1, -1] = 1
        segments[2, length // 2:] = 1
        segments[3, length // 4:length // 2], segments[3, length // 2:3 * length // 4] = 1, 2
    return jnp.asarray(segments)


def awkward_inputs(rng, length, kv_heads=2, groups=2, head_dim=16):
    q = jnp.asarray(rng.normal(size=(4, length, kv_heads, groups, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, length, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("length, all_padding", [(1, False), (2, False), (7, False), (63, False), (65, False),
                                                 (7, True), (65, True)])
def test_kernel_on_short_rows_and_padding_only_queries(length, all_padding):
    # Rows shorter than one block of 64 (or one token past it); queries before a row's first real token read no key:
    # the kernel gives them 0 and takes no gradient from their cotangent, which the dense reference (a uniform
    # average there) would pass back, so the reference gets the cotangent on live queries only.
    rng = np.random.default_rng(length)
    segments = awkward_segments(length, all_padding)
    q, k, v = awkward_inputs(rng, length)
    mask = causal_segment_mask(segments)
    live = np.asarray(mask.any(axis=-1))
    assert live.any() != all_padding and not live[0].any() and live[1].sum() == (not all_padding)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    live_cotangent = cotangent * live[:, :, None, None, None]

    def loss(fused, q, k, v):
        if fused:
            out = cpu_fused_attention(q, k, v, segments)
            return jnp.sum(out * cotangent), out
        out = grouped_attention(q, k, v, mask)
        return jnp.sum(out * live_cotangent), out

    gradient = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (_, expected), expected_grads = gradient(False, q, k, v)
    (_, actual), actual_grads = gradient(True, q, k, v)
    actual = np.asarray(actual)
    np.testing.assert_allclose(actual[live], np.asarray(expected)[live], rtol=1e-5, atol=1e-5)
    assert not actual[~live].any()  # 0, not NaN
    assert not np.asarray(actual_grads[0])[~live].any()
    for name, got, want in zip("qkv", actual_grads, expected_grads):
        assert np.isfinite(got).all(), f"d{name}"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_threads_calling_the_kernel_at_once_each_get_the_single_threaded_result():
    # Each call splits its pairs over OpenMP threads with per-thread workspaces; calls from several Python threads
    # at once must neither share those buffers nor race on outputs.
    segments = awkward_segments(200, all_padding=False)  # 4 blocks
    call = jax.jit(jax.value_and_grad(lambda q, k, v: (cpu_fused_attention(q, k, v, segments) ** 2).sum(),
                                      argnums=(0, 1, 2)))
    inputs = [awkward_inputs(np.random.default_rng(seed), 200) for seed in range(4)]
    expected = [jax.device_get(call(*x)) for x in inputs]
    start, results = threading.Barrier(len(inputs)), [[] for _ in inputs]

    def worker(i):
        start.wait()
        for _ in range(20):
            results[i].append(jax.device_get(call(*inputs[i])))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for want, got in zip(expected, results):
        assert len(got) == 20
        for result in got:
            jax.tree.map(np.testing.assert_array_equal, result, want)


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
