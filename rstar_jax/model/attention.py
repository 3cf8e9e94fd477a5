"""Masked grouped-query softmax attention: dense or blockwise over keys (same numbers, less memory), over a KV cache
plus the call's own new keys, and the training attention over packed rows in each implementation gin selects.

Queries are grouped per key/value head ([B, T, Hkv, G, D]) instead of repeating keys, the same arithmetic as HF's
repeat_kv (query head h reads key/value head h // G). Scores and softmax are float32. A fully masked query row
(padding) never produces NaN: the XLA forms average the values uniformly, the fused kernels give 0.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rstar_jax.kernels.build import KernelBuildError, load_kernel
from rstar_jax.kernels.cpu_attention import SOURCE as CPU_KERNEL_SOURCE
from rstar_jax.kernels.cpu_attention import cpu_fused_attention
from rstar_jax.kernels.cpu_cached_attention import cpu_cached_attention
from rstar_jax.kernels.pallas_attention import pallas_attention
from rstar_jax.model.causal_blockwise import MASKED_SCORE, causal_blockwise_attention
from rstar_jax.model.config import ATTENTION_IMPLS
from rstar_jax.model.segments import allowed_keys, causal_segment_mask
from rstar_jax.parallel import activation_sharding, active_mesh

GPU_PLATFORMS: tuple[str, ...] = ("gpu", "cuda", "rocm")
AUTO_BLOCK_SIZE = 512  # 'auto' falling back to causal_blockwise with attention_block_size 0 takes this block


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
    return _heads_last(jnp.einsum("bkgts,bskd->bkgtd", probs, v, precision=precision))


def _heads_last(out: jax.Array) -> jax.Array:
    """[B, Hkv, G, T, D] -> [B, T, Hkv, G, D]. The probs-values dot keeps the heads leading and the result is moved
    afterwards: asking the dot for [B, T, Hkv, G, D] directly ran 7x slower on XLA:CPU (measured, T = S = 512)."""
    return out.transpose(0, 3, 1, 2, 4)


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
    return _heads_last(out).astype(v.dtype)


def cached_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, new_k: jax.Array, new_v: jax.Array,
                     cached_mask: jax.Array, new_mask: jax.Array,
                     precision: jax.lax.Precision = jax.lax.Precision.DEFAULT) -> jax.Array:
    """Attention of q [B, T, Hkv, G, D] over a cache (cache_k/v [B, Hkv, S, D], head-major) and this call's own
    keys (new_k/v [B, T, Hkv, D]) -> [B, T, Hkv, G, D]; cached_mask [B, T or 1, S] and new_mask [B, T, T] say
    which keys each query reads.

    One softmax over both score blocks: the same numbers as writing the new keys into the cache first and
    attending over it, but the cache is only read (never copied or transposed: its [S, D] matrix per batch and
    head is what the dot consumes), so a decode step's cost is one pass over the live cache. The caller writes the
    new keys afterwards, in place.
    """
    scale = q.shape[-1] ** -0.5
    old_scores = jnp.einsum("btkgd,bksd->bkgts", q, cache_k, preferred_element_type=jnp.float32,
                            precision=precision) * scale
    new_scores = jnp.einsum("btkgd,bskd->bkgts", q, new_k, preferred_element_type=jnp.float32,
                            precision=precision) * scale
    old_scores = jnp.where(cached_mask[:, None, None, :, :], old_scores, MASKED_SCORE)
    new_scores = jnp.where(new_mask[:, None, None, :, :], new_scores, MASKED_SCORE)
    probs = jax.nn.softmax(jnp.concatenate([old_scores, new_scores], axis=-1), axis=-1)
    cached = cache_k.shape[2]
    old_probs, new_probs = probs[..., :cached].astype(cache_v.dtype), probs[..., cached:].astype(new_v.dtype)
    return _heads_last(jnp.einsum("bkgts,bksd->bkgtd", old_probs, cache_v, precision=precision)
                       + jnp.einsum("bkgts,bskd->bkgtd", new_probs, new_v, precision=precision))


def stacked_cached_attention(q: jax.Array, cache: tuple[jax.Array, jax.Array], layer: jax.Array, new_k: jax.Array,
                             new_v: jax.Array, cached_mask: jax.Array, new_mask: jax.Array, impl: str,
                             precision: jax.lax.Precision = jax.lax.Precision.DEFAULT) -> jax.Array:
    """`cached_attention` over layer `layer` of the stacked cache (keys, values [L, B, Hkv, max_len, D]), reading its
    first W positions (W: cached_mask's width).

    A decode step (one query a row) of a float32 model whose training attention runs as 'cpu_fused' (`impl`,
    ModelConfig.attention_impl, resolved as `causal_attention` does) reads the cache in place through
    `kernels.cpu_cached_attention`: XLA:CPU would copy the layer's window out of the stacked cache for its dots
    (issue 26 item 4). Otherwise the window is sliced here, per layer, where XLA fuses the layer and window slices
    into one; longer calls (prefills, turn suffixes) keep the batched dots, against which that copy costs little.
    """
    keys, values = cache
    one_query = q.shape[1] == 1
    if one_query and all(x.dtype == jnp.float32 for x in (q, keys, new_k)) and _resolved(impl, q.dtype) == "cpu_fused":
        return cpu_cached_attention(q, keys, values, layer, new_k, new_v, cached_mask, new_mask)
    window = cached_mask.shape[-1]
    cache_k = jax.lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False)[:, :, :window]
    cache_v = jax.lax.dynamic_index_in_dim(values, layer, 0, keepdims=False)[:, :, :window]
    return cached_attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), new_k, new_v, cached_mask, new_mask,
                            precision)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, impl: str,
                     precision: jax.lax.Precision = jax.lax.Precision.DEFAULT, block_size: int = 0) -> jax.Array:
    """Training self-attention of q [B, T, Hkv, G, D] over k, v [B, T, Hkv, D] of the same tokens: causal, within
    each row's segments (`segments.allowed_keys`; a 0/1 attention mask is one segment per row) -> [B, T, Hkv, G, D].

    `impl` (ModelConfig.attention_impl, issue 12) picks how; every one gives the same numbers on every query that
    reads at least one key:
    - "dense": `grouped_attention` under the [B, T, T] mask (the reference; `block_size` > 0 streams its keys);
    - "causal_blockwise": `causal_blockwise_attention` in `block_size` blocks, the blocks above the diagonal
      skipped and no [T, T] array kept for the backward pass; a row of at most one block has nothing to skip
      and takes the dense form, which keeps its [T, T] <= [block, block] probabilities instead of recomputing
      them (faster on XLA:CPU: 10.9 against 12.2 ms per layer of the tiny model at 256 tokens, measured);
    - "dot_product": `jax.nn.dot_product_attention`, cuDNN's fused kernel where the backend and dtype allow it
      (`fused_implementation`), XLA's otherwise;
    - "cpu_fused": `kernels.cpu_attention.cpu_fused_attention`, FlashAttention-2 as one C++ call each way through
      XLA's FFI (CPU, float32, one device; built with g++ on first use);
    - "pallas": `kernels.pallas_attention.pallas_attention`, FlashAttention-2 in Pallas for GPUs (interpret mode on
      a CPU); under an active mesh it runs per shard of the batch and key/value heads (`shard_map`: one kernel
      call has no partitioning rule, and XLA would gather every operand to every device);
    - "auto": one of the above for this backend, chosen when traced (`resolve_attention_impl`).
    """
    requested = impl
    impl = _resolved(impl, q.dtype)
    if requested == "auto" and impl == "causal_blockwise" and block_size <= 0:
        block_size = AUTO_BLOCK_SIZE
    if impl == "dense" or (impl == "causal_blockwise" and q.shape[1] <= block_size):
        return grouped_attention(q, k, v, causal_segment_mask(segment_ids), precision,
                                 block_size if impl == "dense" else 0)
    if impl == "causal_blockwise":
        return causal_blockwise_attention(q, k, v, segment_ids, block_size, precision)
    if impl == "dot_product":
        return dot_product_attention(q, k, v, segment_ids, fused_implementation(q.dtype))
    if impl == "cpu_fused":
        return cpu_fused_attention(q, k, v, segment_ids)
    if impl == "pallas":
        kernel = functools.partial(pallas_attention, precision=precision, interpret=_platform() == "cpu")
        return _per_shard(kernel, q, k, v, segment_ids)
    raise ValueError(f"unknown attention implementation {impl!r}; choose from {ATTENTION_IMPLS}")


def resolve_attention_impl(impl: str, platform: str, cpu_kernel_problem: str | None = None,
                           dtype: jax.typing.DTypeLike = jnp.float32) -> str:
    """The attention implementation `impl` (ModelConfig.attention_impl) runs as on backend `platform`
    (`jax.default_backend()`: "cpu", "gpu", ...; "cuda" and "rocm" count as GPUs too), issue 22 item 3.

    "auto" is "pallas" on a GPU; on a CPU "cpu_fused" when its kernel builds (`cpu_kernel_problem` None: the
    caller's `load_kernel` succeeded; else why not, e.g. no g++) and the compute dtype is float32, the only one it
    takes; "causal_blockwise" otherwise, with one warning naming why. Other names pass through, except two that
    cannot run here: "cpu_fused" on a GPU (its FFI target exists only for XLA:CPU) and "pallas" on a backend other
    than a GPU or the CPU (its kernels are written for Triton; the CPU interprets them), each a ValueError naming
    the fix instead of a failure inside XLA's lowering.
    """
    gpu = platform in GPU_PLATFORMS
    if impl == "cpu_fused" and gpu:
        raise ValueError(f"attention_impl 'cpu_fused' is an XLA:CPU kernel and cannot run on the {platform} backend; "
                         "use 'pallas' (the fused GPU kernel) or 'auto'")
    if impl == "pallas" and not (gpu or platform == "cpu"):
        raise ValueError(f"attention_impl 'pallas' is written for GPUs (Triton) and cannot run on the {platform} "
                         "backend; use 'auto' or 'causal_blockwise'")
    if impl != "auto":
        return impl
    if gpu:
        return "pallas"
    if platform != "cpu":
        problem = f"no fused attention kernel for the {platform} backend"
    elif jnp.dtype(dtype) != jnp.float32:
        problem = f"'cpu_fused' computes in float32, the model computes in {jnp.dtype(dtype).name}"
    elif cpu_kernel_problem is not None:
        problem = cpu_kernel_problem
    else:
        return "cpu_fused"
    _warn_once(f"attention_impl 'auto' runs as 'causal_blockwise' on the {platform} backend: {problem}")
    return "causal_blockwise"


def _resolved(impl: str, dtype: jax.typing.DTypeLike) -> str:
    """`resolve_attention_impl` on this process's backend (the CPU kernel's build is tried only for "auto")."""
    return resolve_attention_impl(impl, _platform(), _cpu_kernel_problem() if impl == "auto" else None, dtype)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@functools.cache
def _platform() -> str:
    """JAX's default backend, read once (it cannot change within a process)."""
    return jax.default_backend()


@functools.cache
def _cpu_kernel_problem() -> str | None:
    """None when the C++ attention kernel builds (or is built) here, else why not; tried once per process."""
    if _platform() != "cpu":
        return None
    try:
        load_kernel(CPU_KERNEL_SOURCE)
    except KernelBuildError as error:
        return str(error).splitlines()[0]
    return None


def _per_shard(attention, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`attention(q, k, v, segment_ids)` run per shard under the active mesh (`parallel.use_mesh`), else once.

    Rows and key/value heads are independent, so each device attends over its own: the batch axis splits as the
    activations' "batch" axis and the head axis as "kv_heads" (as `constrain` splits k and v; a query head's group
    stays on its key/value head's device); sequence and head_dim stay whole.
    """
    mesh = active_mesh()
    if mesh is None or mesh.size == 1:
        return attention(q, k, v, segment_ids)
    rows, _, heads, _ = activation_sharding(mesh, k.shape, "batch", "seq", "kv_heads", "head_dim").spec
    kv_spec = PartitionSpec(rows, None, heads, None)
    q_spec = PartitionSpec(rows, None, heads, None, None)
    return jax.shard_map(attention, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(rows, None)),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)


def fused_implementation(dtype: jax.typing.DTypeLike, platform_version: str | None = None) -> str:
    """`jax.nn.dot_product_attention`'s implementation for `dtype`: "cudnn" (fused flash attention) on a CUDA
    backend for 16-bit inputs, the only ones cuDNN takes; "xla" everywhere else (CPU, ROCm, TPU, float32).
    `platform_version` is the backend's (default: JAX's default backend; CUDA's reads "cuda <version>")."""
    if platform_version is None:
        platform_version = jax.extend.backend.get_backend().platform_version
    cuda = platform_version.lower().startswith("cuda")
    return "cudnn" if cuda and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                          implementation: str) -> jax.Array:
    """`causal_attention` through `jax.nn.dot_product_attention` (GQA by its own head grouping: query head
    h = kv * G + g reads key/value head kv, as here). Causality is its `is_causal` (cuDNN then skips the blocks
    above the diagonal itself); the segment rule is a [B, 1, T, T] mask, which cuDNN turns into an additive bias."""
    batch, length, kv_heads, groups, head_dim = q.shape
    segments_mask = allowed_keys(segment_ids, segment_ids)[:, None]
    out = jax.nn.dot_product_attention(q.reshape(batch, length, kv_heads * groups, head_dim), k, v,
                                       mask=segments_mask, is_causal=True, implementation=implementation)
    return out.reshape(q.shape)
