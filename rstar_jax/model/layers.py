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

from rstar_jax.model.attention import grouped_attention
from rstar_jax.model.config import ModelConfig
from rstar_jax.parallel import constrain

LayerCache = tuple[jax.Array, jax.Array]  # (keys, values), each [B, max_len, kv_heads, head_dim]
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


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, H, D] by the tables [B, T, D] (rotate_half convention: halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def dense(config: ModelConfig, features: int, use_bias: bool, name: str) -> nn.Dense:
    """A projection with the config's dtypes, precision and HF-like init (normal(0.02) kernel, zero bias)."""
    return nn.Dense(features, use_bias=use_bias, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
                    precision=config.jax_precision, kernel_init=_INIT, name=name)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v (and o) bias and Qwen3's per-head q/k RMSNorm.

    Without a cache the keys are this call's tokens. With a cache (keys, values) the new keys/values are first
    written at `write_index` [B, T] (an index >= max_len drops the write, used for padding), then the queries
    attend over the whole cache under `mask`.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask: jax.Array,
        write_index: jax.Array | None,
        cache: LayerCache | None,
    ) -> tuple[jax.Array, LayerCache | None]:
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

        if cache is not None:
            cache_k, cache_v = cache
            rows = jnp.arange(batch)[:, None]
            cache_k = cache_k.at[rows, write_index].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[rows, write_index].set(v.astype(cache_v.dtype), mode="drop")
            cache = (cache_k, cache_v)
            k, v = cache_k.astype(cfg.jnp_dtype), cache_v.astype(cfg.jnp_dtype)

        grouped_q = q.reshape(batch, length, kv_heads, cfg.num_groups, head_dim)
        out = grouped_attention(grouped_q, k, v, mask, cfg.jax_precision, cfg.attention_block_size)
        out = out.reshape(batch, length, heads * head_dim)
        out = dense(cfg, cfg.hidden_size, cfg.o_bias, "o_proj")(out)
        return out, cache


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
        mask: jax.Array,
        write_index: jax.Array | None,
        cache: LayerCache | None,
    ) -> tuple[jax.Array, LayerCache | None]:
        cfg = self.config
        norm_args = (cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype)
        attn_out, cache = Attention(cfg, name="attn")(RMSNorm(*norm_args, name="input_norm")(x), rope, mask,
                                                      write_index, cache)
        x = constrain(x + attn_out, "batch", "seq", "embed")
        x = x + MLP(cfg, name="mlp")(RMSNorm(*norm_args, name="post_attn_norm")(x))
        return constrain(x, "batch", "seq", "embed"), cache
