"""The Pallas flash attention (issue 22 item 3, `rstar_jax.kernels.pallas_attention`), run here in Pallas' interpret
mode: outputs and q/k/v gradients equal the dense reference within 1e-5 in float32 (MHA and grouped-query heads,
head dims 8 (padded), 64 and 128, one and two segments per row, padding, several blocks, and the issue's T = 1,024
with 40 query / 8 key-value heads); K and V read in place; the kernels lower to Triton for CUDA; 'auto' resolution
and the 'cpu_fused'-on-a-GPU error; the whole model, remat policy 'dots_attention_saveable' and a sharded mesh."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core as jax_core

from rstar_jax.kernels.pallas_attention import pallas_attention
from rstar_jax.model import ModelConfig, forward, init_params, positions_from_mask
from rstar_jax.model import attention
from rstar_jax.model.attention import causal_attention, grouped_attention, resolve_attention_impl
from rstar_jax.model.segments import causal_segment_mask
from rstar_jax.parallel import make_mesh, use_mesh
from rstar_jax.train.memory_plan import attention_block
from tests.model.test_attention import packed_segments


def two_segments(batch: int, length: int, left_pad: int = 0, right_pad: int = 0) -> np.ndarray:
    """[batch, length] ids: left padding, two packed sequences (the second from ~60% of the row), right padding;
    row 0 is one sequence over the same span."""
    ids = np.zeros((batch, length), np.int32)
    end = length - right_pad
    ids[:, left_pad:end] = 1
    ids[1:, left_pad + (end - left_pad) * 3 // 5:end] = 2
    return ids


def compare_with_dense(segments: np.ndarray, kv_heads: int, groups: int, head_dim: int, seed: int = 0,
                       dtype=jnp.float32) -> dict[str, float]:
    """Outputs (on queries that read a key) and q/k/v gradients of a random-weighted sum: pallas against the dense
    reference on the same inputs; returns each one's largest absolute difference. Asserts the rows that read no key
    are 0 (finite) and, in float32, allclose at 1e-5."""
    rng = np.random.default_rng(seed)
    batch, length = segments.shape
    segments = jnp.asarray(segments)
    q = jnp.asarray(rng.normal(size=(batch, length, kv_heads, groups, head_dim)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), dtype) for _ in range(2))
    mask = causal_segment_mask(segments)
    live = np.asarray(mask.any(axis=-1))
    cotangent = jnp.asarray(rng.normal(size=q.shape) * live[:, :, None, None, None], jnp.float32)

    def loss(reference, q, k, v):
        if reference:  # the dense reference in float32 on the same (possibly bfloat16-rounded) inputs
            out = grouped_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
        else:
            out = pallas_attention(q, k, v, segments)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    gradient = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (_, expected), expected_grads = gradient(True, q, k, v)
    (_, actual), actual_grads = gradient(False, q, k, v)
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.dtype == np.float32 and np.isfinite(actual).all()
    assert not actual[~live].any()  # a query that reads no key gets 0
    errors = {"out": float(np.abs(actual[live] - expected[live]).max())}
    for name, got, want in zip("qkv", actual_grads, expected_grads):
        assert got.dtype == dtype
        errors[f"d{name}"] = float(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max())
    if dtype == jnp.float32:
        np.testing.assert_allclose(actual[live], expected[live], rtol=1e-5, atol=1e-5)
        for name, got, want in zip("qkv", actual_grads, expected_grads):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
    print(f"{segments.shape} Hkv={kv_heads} G={groups} D={head_dim} {jnp.dtype(dtype).name}: max |error| {errors}")
    return errors


@pytest.mark.parametrize("segments,kv_heads,groups,head_dim", [
    pytest.param(two_segments(2, 64, right_pad=9), 2, 1, 64, id="mha-d64-padding-at-end"),
    pytest.param(two_segments(2, 64, left_pad=5), 2, 2, 128, id="gqa2-d128-left-padding"),
    pytest.param(two_segments(2, 200, right_pad=13), 2, 4, 64, id="gqa4-d64-several-blocks"),
    pytest.param(packed_segments(), 2, 3, 8, id="gqa3-d8-packed-rows"),
])
def test_pallas_equals_dense_reference_with_gradients(segments, kv_heads, groups, head_dim):
    """One and two segments per row, padding at either end (left padding: queries that read no key), T = 200
    (4 forward and 7 backward blocks after padding to 256) and T = 21 with head dim 8 (both padded inside)."""
    compare_with_dense(segments, kv_heads, groups, head_dim)


@pytest.mark.slow
def test_pallas_equals_dense_reference_at_the_issues_shape():
    """Issue 22 item 3's shape: T = 1,024, 40 query / 8 key-value heads, head dim 128, two segments per row."""
    segments = np.ones((1, 1024), np.int32)
    segments[0, 600:] = 2
    compare_with_dense(segments, kv_heads=8, groups=5, head_dim=128)


def test_pallas_in_bfloat16_stays_near_the_float32_reference():
    """bfloat16 inputs, float32 softmax and accumulation: within bfloat16 rounding of the float32 reference."""
    errors = compare_with_dense(two_segments(2, 128, right_pad=7), 2, 2, 64, dtype=jnp.bfloat16)
    assert errors["out"] < 2e-2 and max(errors["dq"], errors["dk"], errors["dv"]) < 0.1


def pallas_calls(jaxpr: jax_core.Jaxpr) -> list[jax_core.JaxprEqn]:
    """Every pallas_call in `jaxpr` and the jaxprs nested in it (custom_vjp, jit, ...)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            found.extend(pallas_calls(sub))
    return found


def test_keys_and_values_are_read_in_place_not_repeated_per_query_head():
    """Every kernel, forward and backward, takes k and v at their [B, T, Hkv, D] shape (a kernel fed K/V repeated
    to the query heads would take [B, T, H, D] ones), and the dK/dV kernel writes [B, T, Hkv, D]: the G query heads
    are summed inside it, not in a [B, T, H, D] gradient reduced afterwards."""
    batch, length, kv_heads, groups, head_dim = 1, 64, 2, 4, 64
    q = jnp.zeros((batch, length, kv_heads, groups, head_dim))
    k = jnp.zeros((batch, length, kv_heads, head_dim))
    segments = jnp.ones((batch, length), jnp.int32)
    program = jax.make_jaxpr(jax.grad(lambda q, k, v: pallas_attention(q, k, v, segments).sum(),
                                      argnums=(0, 1, 2)))(q, k, k)
    calls = {eqn.params["name"]: eqn for eqn in pallas_calls(program.jaxpr)}
    assert set(calls) == {"pallas_attention_forward", "pallas_attention_backward_dkv", "pallas_attention_backward_dq"}
    kv_shape, query_shape = (batch, length, kv_heads, head_dim), (batch, length, kv_heads * groups, head_dim)
    for name, eqn in calls.items():
        shapes = [tuple(var.aval.shape) for var in eqn.invars]
        assert shapes.count(kv_shape) == 2, (name, shapes)
        assert shapes.count(query_shape) == (1 if name == "pallas_attention_forward" else 2), (name, shapes)
    assert [tuple(var.aval.shape) for var in calls["pallas_attention_backward_dkv"].outvars] == [kv_shape, kv_shape]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_triton_for_cuda(dtype):
    """The same kernels compiled (not interpreted) lower to three Triton calls for a CUDA GPU, forward and
    gradient, at head dims 64 and 128 and 5 query heads per key/value head: every tile is a power of two and every
    operation has a Triton lowering. (No GPU here: this stops short of Triton's own compile to PTX.)"""
    for head_dim in (64, 128):
        q = jax.ShapeDtypeStruct((1, 256, 2, 5, head_dim), dtype)
        k = jax.ShapeDtypeStruct((1, 256, 2, head_dim), dtype)
        segments = jax.ShapeDtypeStruct((1, 256), jnp.int32)
        gradient = jax.grad(lambda q, k, v, s: pallas_attention(q, k, v, s, interpret=False).astype(
            jnp.float32).sum(), argnums=(0, 1, 2))
        text = jax.jit(gradient).trace(q, k, k, segments).lower(lowering_platforms=("cuda",)).as_text()
        assert sorted(re.findall(r'name = "(pallas_attention_\w+)"', text)) == [
            "pallas_attention_backward_dkv", "pallas_attention_backward_dq", "pallas_attention_forward"]


@pytest.mark.parametrize("impl,platform,problem,dtype,expected", [
    ("auto", "gpu", None, jnp.bfloat16, "pallas"),
    ("auto", "cuda", None, jnp.float32, "pallas"),
    ("auto", "rocm", None, jnp.float32, "pallas"),
    ("auto", "cpu", None, jnp.float32, "cpu_fused"),
    ("pallas", "gpu", None, jnp.float32, "pallas"),
    ("pallas", "cpu", None, jnp.float32, "pallas"),
    ("cpu_fused", "cpu", None, jnp.float32, "cpu_fused"),
    ("dot_product", "gpu", None, jnp.float32, "dot_product"),
    ("causal_blockwise", "cpu", "no compiler", jnp.float32, "causal_blockwise"),
])
def test_resolution_without_warning(impl, platform, problem, dtype, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_attention_impl(impl, platform, problem, dtype) == expected


@pytest.mark.parametrize("platform,problem,dtype,reason", [
    ("cpu", "no C++ compiler (g++ or $CXX) to build cpu_attention.cc", jnp.float32, "no C\\+\\+ compiler"),
    ("cpu", None, jnp.bfloat16, "'cpu_fused' computes in float32, the model computes in bfloat16"),
    ("tpu", None, jnp.float32, "no fused attention kernel for the tpu backend"),
])
def test_auto_falls_back_to_causal_blockwise_with_one_warning_naming_why(platform, problem, dtype, reason):
    attention._warn_once.cache_clear()
    with pytest.warns(UserWarning, match=f"runs as 'causal_blockwise' on the {platform} backend: {reason}") as caught:
        for _ in range(3):
            assert resolve_attention_impl("auto", platform, problem, dtype) == "causal_blockwise"
    assert len(caught) == 1


def test_auto_without_a_compiler_runs_blockwise_in_default_blocks(monkeypatch):
    """What `causal_attention` does with 'auto' on a CPU where the C++ kernel cannot be built (no g++): the
    blockwise form, in blocks of 512 when attention_block_size is 0, with the dense numbers."""
    monkeypatch.setattr(attention, "_cpu_kernel_problem", lambda: "no C++ compiler (g++ or $CXX)")
    calls = []
    monkeypatch.setattr(attention, "causal_blockwise_attention", lambda *args: calls.append(args[4]) or args[0])
    attention._warn_once.cache_clear()
    q = jnp.zeros((1, 600, 1, 1, 4))
    k = jnp.zeros((1, 600, 1, 4))
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        causal_attention(q, k, k, jnp.ones((1, 600), jnp.int32), "auto")
    assert calls == [attention.AUTO_BLOCK_SIZE]


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_cpu_fused_on_a_gpu_is_a_clear_error(platform):
    with pytest.raises(ValueError, match="'cpu_fused' is an XLA:CPU kernel .* use 'pallas' .* or 'auto'"):
        resolve_attention_impl("cpu_fused", platform)


def test_pallas_on_a_tpu_is_a_clear_error():
    with pytest.raises(ValueError, match="'pallas' is written for GPUs"):
        resolve_attention_impl("pallas", "tpu")


def test_memory_plan_sizes_pallas_and_auto_as_flash_attention():
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1, attention_impl="causal_blockwise", attention_block_size=256)
    assert attention_block(config, 4096) == 256
    for impl in ("pallas", "auto"):
        assert attention_block(dataclasses.replace(config, attention_impl=impl), 4096) == 1


TINY = ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=40, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)


def model_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two rows of 24 tokens: two packed sequences and right padding; left padding then one sequence."""
    ids = np.random.default_rng(1).integers(0, 64, (2, 24)).astype(np.int32)
    segments = np.zeros((2, 24), np.int32)
    segments[0, :10], segments[0, 10:20] = 1, 2
    segments[1, 4:] = 1
    return ids, np.asarray(positions_from_mask(jnp.asarray(segments))), segments


def test_model_with_pallas_attention_matches_dense_loss_and_gradient():
    """The whole model: the loss (a weighted sum of real tokens' logits) and its parameter gradient with 'pallas'
    equal 'dense' within 1e-5, relative to each gradient's largest entry (the embedding gradient's entries reach
    ~10; float32 rounding through two layers moves them by ~1e-5 absolute)."""
    ids, positions, segments = model_batch()
    params = init_params(TINY, jax.random.key(0))
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(2, 24, 64)) * (segments > 0)[..., None], jnp.float32)

    def loss(config, params):
        return jnp.sum(forward(params, config, ids, positions, segments) * weights)

    grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
    expected_loss, expected_grads = grad(TINY, params)
    actual_loss, actual_grads = grad(dataclasses.replace(TINY, attention_impl="pallas"), params)
    np.testing.assert_allclose(actual_loss, expected_loss, rtol=1e-5)
    for path, got in jax.tree_util.tree_leaves_with_path(actual_grads):
        want = dict(jax.tree_util.tree_leaves_with_path(expected_grads))[path]
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("policy,recomputed", [("dots_attention_saveable", False), ("dots_saveable", True)])
def test_dots_attention_saveable_keeps_the_kernels_output_instead_of_running_it_again(policy, recomputed):
    """In the compiled gradient program, the forward kernel appears inside remat's recomputation under
    dots_saveable and not under dots_attention_saveable (its output and log-sum-exp are kept by name)."""
    config = dataclasses.replace(TINY, num_layers=1, attention_impl="pallas", remat_policy=policy)
    params = init_params(config, jax.random.key(0))
    ids, positions, segments = model_batch()
    gradient = jax.jit(jax.grad(lambda p: forward(p, config, ids, positions, segments).sum()))
    program = gradient.lower(params).compile().as_text()
    assert "pallas_attention_forward" in program
    assert bool(re.search(r"rematted_computation/[^\"]*pallas_attention_forward", program)) == recomputed


@pytest.mark.slow
def test_pallas_under_a_sharded_mesh_runs_per_shard_with_the_dense_numbers():
    """Under a data x fsdp x tensor mesh of 8 devices the kernel runs per shard of the batch and key/value heads
    (shard_map), with the unsharded dense numbers."""
    ids, positions, segments = model_batch()
    ids, positions, segments = (np.tile(x, (2, 1)) for x in (ids, positions, segments))
    params = init_params(TINY, jax.random.key(0))
    expected = forward(params, TINY, ids, positions, segments)
    config = dataclasses.replace(TINY, attention_impl="pallas")
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with use_mesh(mesh):
        program = jax.jit(forward, static_argnums=1).trace(params, config, ids, positions, segments).jaxpr
        actual = jax.jit(forward, static_argnums=1)(params, config, ids, positions, segments)
    assert "shard_map" in str(program)
    real = segments > 0
    np.testing.assert_allclose(np.asarray(actual)[real], np.asarray(expected)[real], rtol=1e-5, atol=1e-5)
