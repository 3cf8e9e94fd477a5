"""Causal attention over packed rows as Pallas flash-attention kernels (`ModelConfig.attention_impl = 'pallas'`).

Issue 22 item 3 ("fused attention on GPUs"): FlashAttention-2 written for Pallas' GPU (Triton) backend, forward and
backward, with the model's masking rule (causal and `segments.allowed_keys`: a key is read when it is a real token
of the query's segment, or any real token for a padding query).

- Grouped-query heads are read in place. Query head h reads key/value head h // G through the BlockSpec index maps,
  so K and V are never repeated in memory; the dK/dV kernel runs once per key/value head and sums its G query
  heads' contributions in its loop (no [B, T, H, D] key gradient to reduce afterwards).
- Forward: per (row, query head, query block) a loop over the key blocks up to the diagonal (the blocks above it are
  never visited) keeping a running max and normaliser in float32; it writes the output and the log-sum-exp.
  Backward: the probabilities are recomputed from the saved log-sum-exp; one kernel per key block (dK, dV, looping
  over the query blocks from the diagonal down) and one per query block (dQ, looping over key blocks up to it).
- A query that reads no key (padding before a row's first real token) gets output 0 and no gradient, as
  `cpu_fused` does: finite, and never read.
- The forward pass names its output and log-sum-exp (`RESIDUAL_NAMES`), so remat policy 'dots_attention_saveable'
  keeps them instead of running the forward kernel again inside the backward pass.
- On a CPU backend the same kernels run in Pallas' interpret mode (slow; what the tests use). Rows are padded to a
  whole number of blocks and head dims other than 16, 32, 64, 128, ... to the next power of two (Triton's tiles
  need power-of-two sides); head dims 64 and 128, the Qwen ones, are read in place.
- Like `cpu_fused`, one pallas_call has no partitioning rule: under a sharded mesh the caller runs it per shard
  (`attention.causal_attention` does, by `shard_map` over the batch and key/value-head axes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

RESIDUAL_NAMES = ("pallas_attention_output", "pallas_attention_log_normaliser")
MASKED_SCORE = float(np.finfo(np.float32).min)
# (query block, key block) of the forward and backward kernels, sized by their tiles' shared memory at the worst
# case (float32, head dim 128, two pipeline stages: at most ~160 KiB of a Hopper SM's 228), not tuned on a GPU. The
# backward kernels keep twice the forward's tiles, hence the smaller query block. A row shorter than a block takes
# one smaller block.
FORWARD_BLOCKS = (64, 64)
BACKWARD_BLOCKS = (32, 64)
MIN_TILE = 16  # Triton's smallest dot side


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     precision: lax.Precision = lax.Precision.DEFAULT, interpret: bool | None = None) -> jax.Array:
    """Causal attention of q [B, T, Hkv, G, D] over k, v [B, T, Hkv, D] within segments [B, T] -> [B, T, Hkv, G, D]
    (the rule of `segments.allowed_keys`); float32 or bfloat16 inputs, float32 softmax and accumulation.

    `precision` is the dots' (on GPUs DEFAULT lets float32 use TF32, HIGHEST does not); `interpret` None means
    interpret mode exactly when JAX's default backend is the CPU.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    batch, length, kv_heads, groups, head_dim = q.shape
    if k.shape != (batch, length, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"pallas attention takes q [B, T, Hkv, G, D] and k, v [B, T, Hkv, D] of the same tokens, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    padded_dim = max(MIN_TILE, pl.next_power_of_2(head_dim))
    padded_length = _round_up(length, max(_block_sizes(length)))
    q = q.reshape(batch, length, kv_heads * groups, head_dim)  # free: query head h = kv * G + g
    if padded_length != length or padded_dim != head_dim:
        q, k, v = (jnp.pad(x, ((0, 0), (0, padded_length - length), (0, 0), (0, padded_dim - head_dim)))
                   for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded_length - length)))  # padding: reads, is read by none
    options = _Options(groups, head_dim ** -0.5, _block_sizes(length), precision, bool(interpret))
    out = _attention(q, k, v, segment_ids.astype(jnp.int32), options)
    return out[:, :length, :, :head_dim].reshape(batch, length, kv_heads, groups, head_dim)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _block_sizes(length: int) -> tuple[int, ...]:
    """Every block side the kernels use for rows of `length` tokens (powers of two >= MIN_TILE)."""
    cap = max(MIN_TILE, pl.next_power_of_2(length))
    return tuple(min(block, cap) for block in FORWARD_BLOCKS + BACKWARD_BLOCKS)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The static parameters of one attention call (hashable: the custom_vjp's non-differentiable argument).
    blocks: (forward query, forward key, backward query, backward key) block sides."""

    groups: int
    scale: float
    blocks: tuple[int, ...]
    precision: lax.Precision
    interpret: bool

    def compiler_params(self, head_dim: int) -> plgpu.CompilerParams:
        """Triton launch parameters, chosen as JAX's own GPU attention does (not tuned on a GPU): 8 warps for
        128-wide heads, whose [block, 128] float32 accumulators would crowd 4 warps' registers; 2 pipeline stages,
        which keep the float32 head-dim-128 tiles within shared memory (see FORWARD_BLOCKS)."""
        return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], precision: lax.Precision) -> jax.Array:
    """2-D matmul contracting a's axis contract[0] with b's axis contract[1], accumulated in float32."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _allowed(q_start: jax.Array, q_segments: jax.Array, k_start: jax.Array, k_segments: jax.Array) -> jax.Array:
    """[block_q, block_k] True where a query may read a key: causal and `segments.allowed_keys`."""
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (q_segments.shape[0], k_segments.shape[0]), 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (q_segments.shape[0], k_segments.shape[0]), 1)
    query, key = q_segments[:, None], k_segments[None, :]
    return (q_pos >= k_pos) & (key > 0) & ((query == key) | (query == 0))


def _forward_kernel(q_ref, k_ref, v_ref, segment_ref, out_ref, lse_ref, *, options: _Options, block_k: int):
    block_q = q_ref.shape[0]
    q_start = pl.program_id(2) * block_q
    q = q_ref[...]
    q_segments = segment_ref[pl.ds(q_start, block_q)]

    def step(j, carry):
        accumulated, running_max, normaliser = carry
        k_start = j * block_k
        allowed = _allowed(q_start, q_segments, k_start, segment_ref[pl.ds(k_start, block_k)])
        scores = _dot(q, k_ref[pl.ds(k_start, block_k), :], (1, 1), options.precision) * options.scale
        scores = jnp.where(allowed, scores, MASKED_SCORE)
        new_max = jnp.maximum(running_max, scores.max(axis=1))
        weights = jnp.where(allowed, jnp.exp(scores - new_max[:, None]), 0.0)
        rescale = jnp.exp(running_max - new_max)
        values = v_ref[pl.ds(k_start, block_k), :]
        accumulated = accumulated * rescale[:, None] + _dot(weights.astype(values.dtype), values, (1, 0),
                                                            options.precision)
        return accumulated, new_max, normaliser * rescale + weights.sum(axis=1)

    init = (jnp.zeros(q_ref.shape, jnp.float32), jnp.full((block_q,), MASKED_SCORE, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    key_blocks = lax.div(q_start + block_q + block_k - 1, np.int32(block_k))  # causal: stop at the diagonal
    accumulated, running_max, normaliser = lax.fori_loop(0, key_blocks, step, init)
    read_any = normaliser > 0
    out_ref[...] = (accumulated / jnp.where(read_any, normaliser, 1.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(read_any, running_max + jnp.log(jnp.where(read_any, normaliser, 1.0)), 0.0)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
             options: _Options) -> tuple[jax.Array, jax.Array]:
    """Output [B, T, H, D] (q's dtype) and log-sum-exp [B, H, T] (float32) of padded q [B, T, H, D], k, v
    [B, T, Hkv, D]: grid (row, query head, query block); K, V and the segment ids are whole-row blocks (the
    kernel walks them), at key/value head h // G."""
    batch, length, heads, head_dim = q.shape
    block_q, block_k = options.blocks[:2]
    groups = options.groups
    row = pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, h // groups, 0))
    query_block = pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, options=options, block_k=block_k),
        grid=(batch, heads, length // block_q),
        in_specs=[query_block, row, row, pl.BlockSpec((None, length), lambda b, h, i: (b, 0))],
        out_specs=[query_block, pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
        compiler_params=options.compiler_params(head_dim),
        interpret=options.interpret,
        name="pallas_attention_forward",
    )(q, k, v, segment_ids)


def _probabilities(q, k, lse, q_start, q_segments, k_start, k_segments, options: _Options) -> jax.Array:
    """A [block_q, block_k] tile of the softmax, recomputed from the saved log-sum-exp (0 where not allowed)."""
    scores = _dot(q, k, (1, 1), options.precision) * options.scale
    allowed = _allowed(q_start, q_segments, k_start, k_segments)
    return jnp.where(allowed, jnp.exp(scores - lse[:, None]), 0.0)


def _key_value_grad_kernel(q_ref, k_ref, v_ref, segment_ref, d_out_ref, lse_ref, row_term_ref, d_k_ref, d_v_ref,
                           *, options: _Options, block_q: int):
    """dK, dV of one key block of one key/value head: a sum over its G query heads and the query blocks on and
    below the diagonal. q_ref, d_out_ref [T, G, D]; lse_ref, row_term_ref [G, T]."""
    block_k = k_ref.shape[0]
    length = segment_ref.shape[0]
    k_start = pl.program_id(2) * block_k
    k, v = k_ref[...], v_ref[...]
    k_segments = segment_ref[pl.ds(k_start, block_k)]

    def query_block(i, carry, g):
        d_k, d_v = carry
        q_start = i * block_q
        rows = pl.ds(q_start, block_q)
        q, d_out = q_ref[rows, g, :], d_out_ref[rows, g, :]
        probs = _probabilities(q, k, lse_ref[g, rows], q_start, segment_ref[rows], k_start, k_segments, options)
        d_v = d_v + _dot(probs.astype(d_out.dtype), d_out, (0, 0), options.precision)
        d_probs = _dot(d_out, v, (1, 1), options.precision)
        d_scores = probs * (d_probs - row_term_ref[g, rows][:, None])
        return d_k + _dot(d_scores.astype(q.dtype), q, (0, 0), options.precision), d_v

    def head(g, carry):
        first = lax.div(k_start, np.int32(block_q))  # causal: the query blocks above the diagonal never read it
        return lax.fori_loop(first, length // block_q, functools.partial(query_block, g=g), carry)

    zeros = jnp.zeros(k_ref.shape, jnp.float32)
    d_k, d_v = lax.fori_loop(0, options.groups, head, (zeros, zeros))
    d_k_ref[...] = (d_k * options.scale).astype(d_k_ref.dtype)
    d_v_ref[...] = d_v.astype(d_v_ref.dtype)


def _query_grad_kernel(q_ref, k_ref, v_ref, segment_ref, d_out_ref, lse_ref, row_term_ref, d_q_ref,
                       *, options: _Options, block_k: int):
    """dQ of one query block of one query head: a sum over the key blocks up to the diagonal."""
    block_q = q_ref.shape[0]
    q_start = pl.program_id(2) * block_q
    q, d_out, lse, row_term = q_ref[...], d_out_ref[...], lse_ref[...], row_term_ref[...]
    q_segments = segment_ref[pl.ds(q_start, block_q)]

    def step(j, d_q):
        k_start = j * block_k
        columns = pl.ds(k_start, block_k)
        k, v = k_ref[columns, :], v_ref[columns, :]
        probs = _probabilities(q, k, lse, q_start, q_segments, k_start, segment_ref[columns], options)
        d_scores = probs * (_dot(d_out, v, (1, 1), options.precision) - row_term[:, None])
        return d_q + _dot(d_scores.astype(k.dtype), k, (1, 0), options.precision)

    key_blocks = lax.div(q_start + block_q + block_k - 1, np.int32(block_k))
    d_q = lax.fori_loop(0, key_blocks, step, jnp.zeros(q_ref.shape, jnp.float32))
    d_q_ref[...] = (d_q * options.scale).astype(d_q_ref.dtype)


def _backward(q, k, v, segment_ids, out, lse, d_out, options: _Options) -> tuple[jax.Array, jax.Array, jax.Array]:
    batch, length, heads, head_dim = q.shape
    kv_heads, groups = k.shape[2], options.groups
    block_q, block_k = options.blocks[2:]
    # D_i = sum_d dO_id O_id, the softmax Jacobian's row term, once per query: [B, H, T] like the log-sum-exp.
    row_term = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    segments = pl.BlockSpec((None, length), lambda b, h, i: (b, 0))
    common = dict(compiler_params=options.compiler_params(head_dim), interpret=options.interpret)

    # dK, dV: grid (row, key/value head, key block); the head's G query heads are one [T, G, D] block of q.
    group_rows = pl.BlockSpec((None, length, groups, head_dim), lambda b, h, j: (b, 0, h, 0))
    group_stats = pl.BlockSpec((None, groups, length), lambda b, h, j: (b, h, 0))
    key_block = pl.BlockSpec((None, block_k, None, head_dim), lambda b, h, j: (b, j, h, 0))
    d_k, d_v = pl.pallas_call(
        functools.partial(_key_value_grad_kernel, options=options, block_q=block_q),
        grid=(batch, kv_heads, length // block_k),
        in_specs=[group_rows, key_block, key_block, segments, group_rows, group_stats, group_stats],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="pallas_attention_backward_dkv", **common,
    )(q, k, v, segment_ids, d_out, lse, row_term)

    # dQ: grid (row, query head, query block), K and V whole rows at key/value head h // G as in the forward.
    query_block = pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    stats_block = pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))
    row = pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, h // groups, 0))
    d_q = pl.pallas_call(
        functools.partial(_query_grad_kernel, options=options, block_k=block_k),
        grid=(batch, heads, length // block_q),
        in_specs=[query_block, row, row, segments, query_block, stats_block, stats_block],
        out_specs=query_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="pallas_attention_backward_dq", **common,
    )(q, k, v, segment_ids, d_out, lse, row_term)
    return d_q, d_k, d_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, options: _Options) -> jax.Array:
    return _forward(q, k, v, segment_ids, options)[0]


def _attention_fwd(q, k, v, segment_ids, options: _Options):
    out, lse = (checkpoint_name(x, name) for x, name in zip(_forward(q, k, v, segment_ids, options), RESIDUAL_NAMES))
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(options: _Options, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    return (*_backward(q, k, v, segment_ids, out, lse, d_out, options), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
