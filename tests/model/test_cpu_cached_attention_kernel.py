"""The C++ kernel that attends over a stacked KV cache in place (`kernels.cpu_cached_attention`, issue 26 item 4),
against `attention.cached_attention` over the same layer's sliced window within 1e-5: every layer of the stack,
grouped query heads, rows holding 0 to W cached tokens, one query a row (a decode step) and several (each with its
own cached mask or one shared), a query that may read nothing (0), what it refuses, and that a float32 'cpu_fused'
model's decode step calls it while 'dense' and longer calls keep the XLA form; Python threads calling it at once."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.kernels.cpu_cached_attention import cpu_cached_attention
from rstar_jax.model.attention import cached_attention, stacked_cached_attention

LAYERS, BATCH, KV_HEADS, SLOT_LEN, WINDOW = 3, 4, 2, 64, 40
LENGTHS = np.array([0, 5, 40, 17])  # cached tokens per row: none, a few, the whole window, some


def operands(length: int, groups: int, head_dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return {"q": normal(BATCH, length, KV_HEADS, groups, head_dim),
            "keys": normal(LAYERS, BATCH, KV_HEADS, SLOT_LEN, head_dim),
            "values": normal(LAYERS, BATCH, KV_HEADS, SLOT_LEN, head_dim),
            "new_k": normal(BATCH, length, KV_HEADS, head_dim), "new_v": normal(BATCH, length, KV_HEADS, head_dim)}


def reference(x: dict[str, np.ndarray], layer: int, cached_mask: np.ndarray, new_mask: np.ndarray) -> np.ndarray:
    window = cached_mask.shape[-1]
    return np.asarray(cached_attention(x["q"], x["keys"][layer][:, :, :window], x["values"][layer][:, :, :window],
                                       x["new_k"], x["new_v"], cached_mask, new_mask, jax.lax.Precision.HIGHEST))


def kernel(x: dict[str, np.ndarray], layer: int, cached_mask: np.ndarray, new_mask: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(cpu_cached_attention)(x["q"], x["keys"], x["values"], layer, x["new_k"], x["new_v"],
                                                    cached_mask, new_mask))


@pytest.mark.parametrize("groups, head_dim", [(1, 32), (2, 12), (4, 64)])
def test_a_decode_step_equals_the_xla_form_on_every_layer(groups, head_dim):
    x = operands(1, groups, head_dim)
    cached_mask = np.arange(WINDOW)[None, None, :] < LENGTHS[:, None, None]
    new_mask = np.ones((BATCH, 1, 1), bool)
    for layer in range(LAYERS):
        np.testing.assert_allclose(kernel(x, layer, cached_mask, new_mask), reference(x, layer, cached_mask, new_mask),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared_mask", [True, False])
def test_several_queries_a_row_read_their_own_masks(shared_mask):
    length = 3
    x = operands(length, 2, 32, seed=1)
    rng = np.random.default_rng(2)
    rows = 1 if shared_mask else length
    cached_mask = rng.random((BATCH, rows, WINDOW)) < 0.5  # any positions, not only a prefix
    new_mask = np.tril(np.ones((length, length), bool))[None].repeat(BATCH, 0)
    new_mask[1, :, 0] = False  # a padding token in row 1
    np.testing.assert_allclose(kernel(x, 1, cached_mask, new_mask), reference(x, 1, cached_mask, new_mask),
                               atol=1e-5, rtol=1e-5)


def test_a_query_that_may_read_nothing_gets_zero():
    x = operands(1, 2, 32)
    cached_mask = np.zeros((BATCH, 1, WINDOW), bool)
    new_mask = np.zeros((BATCH, 1, 1), bool)
    new_mask[2] = True  # row 2 reads its own new key only: its value
    out = kernel(x, 0, cached_mask, new_mask)
    np.testing.assert_array_equal(out[[0, 1, 3]], 0.0)
    np.testing.assert_allclose(out[2, 0], np.repeat(x["new_v"][2, 0][:, None, :], 2, axis=1), rtol=1e-6)


def test_the_kernel_refuses_other_dtypes_and_layers_outside_the_stack():
    x = operands(1, 1, 32)
    cached_mask, new_mask = np.ones((BATCH, 1, WINDOW), bool), np.ones((BATCH, 1, 1), bool)
    with pytest.raises(ValueError, match="float32"):
        cpu_cached_attention(x["q"].astype(jnp.bfloat16), x["keys"], x["values"], 0, x["new_k"], x["new_v"],
                             cached_mask, new_mask)
    with pytest.raises(Exception, match=r"layer must be one index in \[0, L\)"):
        kernel(x, LAYERS, cached_mask, new_mask)


@pytest.mark.parametrize("impl, length, calls_kernel", [("cpu_fused", 1, True), ("auto", 1, True),
                                                         ("dense", 1, False), ("cpu_fused", 3, False)])
def test_only_a_cpu_fused_decode_step_runs_the_kernel(impl, length, calls_kernel):
    x = operands(length, 2, 32)
    cached_mask = np.arange(WINDOW)[None, None, :] < LENGTHS[:, None, None]
    new_mask = np.tril(np.ones((length, length), bool))[None].repeat(BATCH, 0)
    attend = jax.jit(lambda layer: stacked_cached_attention(x["q"], (x["keys"], x["values"]), layer, x["new_k"],
                                                            x["new_v"], cached_mask, new_mask, impl))
    assert ("rstar_cpu_cached_attention" in attend.lower(np.int32(2)).as_text()) == calls_kernel
    np.testing.assert_allclose(attend(np.int32(2)), reference(x, 2, cached_mask, new_mask), atol=1e-5, rtol=1e-5)


def test_threads_calling_the_kernel_at_once_each_get_the_single_threaded_result():
    # Two engines in one process (the demo's) call it from their stepping threads at once; each call shares out its
    # (row, head) pairs over XLA's intra-op threads.
    x = operands(1, 2, 32)
    cached_mask = np.arange(WINDOW)[None, None, :] < LENGTHS[:, None, None]
    new_mask = np.ones((BATCH, 1, 1), bool)
    expected = [kernel(x, layer, cached_mask, new_mask) for layer in range(LAYERS)]
    failures: list[str] = []

    def call(layer: int) -> None:
        for _ in range(20):
            if not np.array_equal(kernel(x, layer, cached_mask, new_mask), expected[layer]):
                failures.append(f"layer {layer}")

    threads = [threading.Thread(target=call, args=(layer,)) for layer in range(LAYERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
