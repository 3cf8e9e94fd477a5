"""Building blocks of one Qwen2/Qwen3 decoder layer, numerically matching transformers' implementation.

RMSNorm normalises in float32 and casts back before the scale; RoPE uses the rotate-half convention with
inverse frequencies computed in float32; attention itself is in `rstar_jax.model.attention`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.model.attention import causal_attention, grouped_attention, stacked_cached_attention
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.segments import SegmentIds
from rstar_jax.parallel import constrain

StackedCache = tuple[jax.Array, jax.Array]  # all layers' cached keys, values: each [L, B, kv_heads, max_len, head_dim]
NewKeys = tuple[jax.Array, jax.Array]  # one layer's keys, values of this call's tokens: each [B, T, kv_heads, head_dim]
CacheMasks = tuple[jax.Array, jax.Array]  # (cached_mask [B, T or 1, window], new_mask [B, T, T])
Masks = jax.Array | SegmentIds | CacheMasks  # what a layer's queries may read: see `Attention`
_INIT = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, statistics in float32 (as HF's Qwen2RMSNorm)."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, head_dim] for integer positions [B, T]; frequencies in float32 like HF's default RoPE."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = jnp.asarray(1.0 / (np.float32(theta) ** exponents), dtype=jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, H, D] by the tables [B, T, D] (rotate_half convention: halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Dense(nn.Module):
    """x @ kernel (+ bias) over the last axis, parameters named as `nn.Dense`'s ("kernel" [in, out], "bias").

    The leading axes are flattened into one before the matmul: XLA:CPU ran the kernel gradient of a dot that
    contracts two leading axes (batch and sequence) about 3x slower than the same flat matmul (measured on
    [4, 256, 256] inputs), and the projections' gradients are most of a training step.
    """

    features: int
    use_bias: bool
    dtype: Any
    param_dtype: Any
    precision: jax.lax.Precision

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _INIT, (x.shape[-1], self.features), self.param_dtype)
        flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        y = jnp.dot(flat, kernel.astype(self.dtype), precision=self.precision)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(self.dtype)
        return y.reshape(*x.shape[:-1], self.features)


def dense(config: ModelConfig, features: int, use_bias: bool, name: str) -> Dense:
    """A projection with the config's dtypes, precision and HF-like init (normal(0.02) kernel, zero bias)."""
    return Dense(features, use_bias, config.jnp_dtype, config.jnp_param_dtype, config.jax_precision, name=name)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v (and o) bias and Qwen3's per-head q/k RMSNorm.

    Without a cache the keys are this call's tokens, read causally within `SegmentIds` (the training path, in the
    configured implementation) or under a [B, T, T] `mask`. With the stacked cache (every layer's keys, values)
    and this layer's index, `mask` is (cached_mask, new_mask): the queries read this layer's cached keys and this
    call's own keys (see `stacked_cached_attention`); the cache is only read. Returns the output and this call's
    keys and values (cast through the cache's dtype, exactly as a later call will read them), which the caller
    writes into the cache.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask: Masks,
        cache: StackedCache | None,
        layer: jax.Array,
    ) -> tuple[jax.Array, NewKeys | None]:
        cfg = self.config
        batch, length, _ = x.shape
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = dense(cfg, heads * head_dim, cfg.qkv_bias, "q_proj")(x).reshape(batch, length, heads, head_dim)
        k = dense(cfg, kv_heads * head_dim, cfg.qkv_bias, "k_proj")(x).reshape(batch, length, kv_heads, head_dim)
        v = dense(cfg, kv_heads * head_dim, cfg.qkv_bias, "v_proj")(x).reshape(batch, length, kv_heads, head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype, name="k_norm")(k)
        cos, sin = rope
        q = constrain(apply_rope(q, cos, sin), "batch", "seq", "heads", "head_dim")
        k = constrain(apply_rope(k, cos, sin), "batch", "seq", "kv_heads", "head_dim")
        v = constrain(v, "batch", "seq", "kv_heads", "head_dim")

        grouped_q = q.reshape(batch, length, kv_heads, cfg.num_groups, head_dim)
        if cache is None:
            new_keys = None
            if isinstance(mask, SegmentIds):
                out = causal_attention(grouped_q, k, v, mask.ids, cfg.attention_impl, cfg.jax_precision,
                                       cfg.attention_block_size)
            else:
                out = grouped_attention(grouped_q, k, v, mask, cfg.jax_precision, cfg.attention_block_size)
        else:
            k, v = k.astype(cache[0].dtype), v.astype(cache[1].dtype)
            new_keys = (k, v)
            cached_mask, new_mask = mask
            out = stacked_cached_attention(grouped_q, cache, layer, k.astype(cfg.jnp_dtype), v.astype(cfg.jnp_dtype),
                                           cached_mask, new_mask, cfg.attention_impl, cfg.jax_precision)
        out = out.reshape(batch, length, heads * head_dim)
        out = dense(cfg, cfg.hidden_size, cfg.o_bias, "o_proj")(out)
        return out, new_keys


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        gate = nn.silu(dense(cfg, cfg.intermediate_size, False, "gate_proj")(x))
        hidden = constrain(gate * dense(cfg, cfg.intermediate_size, False, "up_proj")(x), "batch", "seq", "mlp")
        return dense(cfg, cfg.hidden_size, False, "down_proj")(hidden)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). Shaped as a scan body (carry, xs)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask: Masks,
        cache: StackedCache | None,
        layer: jax.Array,
    ) -> tuple[jax.Array, NewKeys | None]:
        cfg = self.config
        norm_args = (cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype)
        attn_out, new_keys = Attention(cfg, name="attn")(RMSNorm(*norm_args, name="input_norm")(x), rope, mask,
                                                         cache, layer)
        x = constrain(x + attn_out, "batch", "seq", "embed")
        x = x + MLP(cfg, name="mlp")(RMSNorm(*norm_args, name="post_attn_norm")(x))
        return constrain(x, "batch", "seq", "embed"), new_keys
