"""Attention over a stacked KV cache read in place, as one XLA:CPU call (issue 26 item 4).

`model.attention.cached_attention` reads one layer's window of the cache as dot operands, and XLA:CPU copies such a
slice of the stacked [L, B, Hkv, S, D] cache into a dense buffer first: in the demo model's decode steps those
copies took about a third of the time (a profile of `decode_and_sample`, 16 slots, window 256). `cpu_cached_attention`
passes the whole stacked cache and the layer index to `cpu_cached_attention.cc`, which reads the keys and values
where they lie. Same arithmetic as `cached_attention` up to float rounding; float32, one device, no gradient (it
serves decoding only).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.kernels.build import load_kernel

SOURCE = Path(__file__).with_name("cpu_cached_attention.cc")
_TARGET = "rstar_cpu_cached_attention"


@functools.cache
def _register() -> None:
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(load_kernel(SOURCE).RstarCpuCachedAttention),
                                platform="cpu")


def cpu_cached_attention(q: jax.Array, keys: jax.Array, values: jax.Array, layer: jax.Array, new_k: jax.Array,
                         new_v: jax.Array, cached_mask: jax.Array, new_mask: jax.Array) -> jax.Array:
    """Attention of q [B, T, Hkv, G, D] over layer `layer` of the stacked cache (keys, values [L, B, Hkv, S, D])
    where cached_mask [B, 1 or T, W] (W <= S) is True, and over this call's keys (new_k, new_v [B, T, Hkv, D])
    where new_mask [B, T, T] is True -> [B, T, Hkv, G, D] float32. A query that may read nothing gets 0."""
    if not all(x.dtype == jnp.float32 for x in (q, keys, values, new_k, new_v)):
        raise ValueError(f"cpu_cached_attention computes in float32, got q {q.dtype}, cache {keys.dtype}, "
                         f"new keys {new_k.dtype}")
    _register()
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, keys, values, jnp.asarray(layer, jnp.int32), cached_mask.astype(jnp.int32), new_k, new_v,
        new_mask.astype(jnp.int32), scale=np.float32(q.shape[-1] ** -0.5))
