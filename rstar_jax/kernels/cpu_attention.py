"""Causal attention over packed rows as one fused XLA:CPU call each way (`ModelConfig.attention_impl = 'cpu_fused'`).

Issue 12: on XLA:CPU the training attention is a chain of small batched dots, masks and softmax passes that each
read and write every score; `cpu_attention.cc` computes it as FlashAttention-2 does (per query block: scores,
online softmax and the weighted values in one pass over the keys, never storing a [T, T] array; the backward pass
recomputes the probabilities from the saved log-sum-exp). Float32, one device: the call has no partitioning rule,
so under a sharded mesh XLA would gather its operands (use the XLA implementations there). The forward pass names
its output and log-sum-exp (`RESIDUAL_NAMES`) so a remat policy can keep them instead of running the forward call
again inside the backward pass (`ModelConfig.remat_policy = 'dots_attention_saveable'` does).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from rstar_jax.kernels.build import load_kernel

SOURCE = Path(__file__).with_name("cpu_attention.cc")
_FORWARD, _BACKWARD = "rstar_cpu_attention_forward", "rstar_cpu_attention_backward"
RESIDUAL_NAMES = ("cpu_attention_output", "cpu_attention_log_normaliser")


@functools.cache
def _register() -> None:
    library = load_kernel(SOURCE)
    for name, symbol in ((_FORWARD, library.RstarCpuAttentionForward), (_BACKWARD, library.RstarCpuAttentionBackward)):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")


def cpu_fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Causal attention of q [B, T, Hkv, G, D] over k, v [B, T, Hkv, D] within segments [B, T] -> [B, T, Hkv, G, D]
    (the rule of `segments.allowed_keys`); float32 only. A query that reads no key gets 0 (its output is never read).
    """
    if not all(x.dtype == jnp.float32 for x in (q, k, v)):
        raise ValueError(f"attention_impl 'cpu_fused' computes in float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    _register()
    batch, length, kv_heads, groups, head_dim = q.shape
    out = _fused(q.reshape(batch, length, kv_heads * groups, head_dim), k, v, segment_ids.astype(jnp.int32))
    return out.reshape(q.shape)


def _scale(q: jax.Array) -> np.float32:
    return np.float32(q.shape[-1] ** -0.5)


def _forward_call(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    batch, length, heads, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((batch, heads, length), jnp.float32))
    return jax.ffi.ffi_call(_FORWARD, shapes)(q, k, v, segment_ids, scale=_scale(q))


@jax.custom_vjp
def _fused(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    return _forward_call(q, k, v, segment_ids)[0]


def _fused_fwd(q: jax.Array, k: jax.Array, v: jax.Array,
               segment_ids: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, log_normaliser = (checkpoint_name(x, name) for x, name in zip(_forward_call(q, k, v, segment_ids),
                                                                       RESIDUAL_NAMES))
    return out, (q, k, v, segment_ids, out, log_normaliser)


def _fused_bwd(residuals: tuple[jax.Array, ...], d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    q, k, v, segment_ids, out, log_normaliser = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    d_q, d_k, d_v = jax.ffi.ffi_call(_BACKWARD, shapes)(q, k, v, segment_ids, out, log_normaliser,
                                                        d_out.astype(jnp.float32), scale=_scale(q))
    return d_q, d_k, d_v, None


_fused.defvjp(_fused_fwd, _fused_bwd)
