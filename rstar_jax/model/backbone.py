"""The decoder trunk: token embedding, the layer stack scanned over a leading layer axis, final RMSNorm.

Layers are one `nn.scan` over `DecoderLayer`, so parameters are stacked [L, ...] and compile time does not grow
with depth; the optional remat policy wraps each layer for training. The scan's gradient keeps every layer's
residuals in stacked [L, ...] buffers (zero-filled, written, sliced again each step); a remat policy that keeps
fewer of them is often faster on XLA:CPU as well as smaller (issue 12, measured: "dots_saveable" took the wide
benchmark model's loss step from 10.9 to 10.0 s and the tiny model's at 256 tokens from 208 to 191 ms). The
output head is not here: it is a pure function of the hidden states (see
`rstar_jax.model.lm`) so log-probs can be computed chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rstar_jax.kernels.cpu_attention import RESIDUAL_NAMES as CPU_RESIDUAL_NAMES
from rstar_jax.kernels.pallas_attention import RESIDUAL_NAMES as PALLAS_RESIDUAL_NAMES
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.layers import DecoderLayer, Masks, NewKeys, RMSNorm, StackedCache, rope_tables
from rstar_jax.parallel import constrain

_REMAT_POLICIES: dict[str, Any] = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    # Also the fused attention's output and log-sum-exp (cpu_fused's or pallas'), which its backward call reads:
    # under dots_saveable the backward pass runs the forward call again (its output is not a dot). 0.96x the step at
    # the drill shape (cpu_fused).
    "dots_attention_saveable": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names(*CPU_RESIDUAL_NAMES, *PALLAS_RESIDUAL_NAMES)),
}


def _layer_stack(config: ModelConfig) -> type[nn.Module]:
    """DecoderLayer scanned over `num_layers`, each layer rematerialised per `config.remat_policy`."""
    body: type[nn.Module] = DecoderLayer
    if config.remat_policy != "none":
        body = nn.remat(DecoderLayer, policy=_REMAT_POLICIES[config.remat_policy], prevent_cse=False)
    return nn.scan(
        body,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),  # rope, mask, the stacked cache; the layer index
        out_axes=0,
        length=config.num_layers,
    )


class Backbone(nn.Module):
    """input ids [B, T] -> final hidden states [B, T, E] (and, given a KV cache, this call's keys and values).

    Without a cache `mask` is the rows' `SegmentIds` (causal attention within segments: the training path) or a
    [B, T, T] mask of the keys each query may read. With one (keys, values, each stacked
    [L, B, Hkv, max_len, D]), `mask` is (cached_mask, new_mask) of `cached_attention`; the cache is only read (each
    layer gets all of it and its own index, so a kernel can read its keys in place: the scan would slice a copy),
    and the new keys and values come back stacked [L, B, T, Hkv, D] for the caller to write (see
    `kv_cache.extend`).
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                              embedding_init=nn.initializers.normal(stddev=0.02))
        self.layers = _layer_stack(cfg)(cfg)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype)

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        mask: Masks,
        cache: StackedCache | None = None,
    ) -> tuple[jax.Array, NewKeys | None]:
        cfg = self.config
        x = constrain(self.embed(input_ids), "batch", "seq", "embed")
        rope = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.jnp_dtype)
        x, new_keys = self.layers(x, rope, mask, cache, jnp.arange(cfg.num_layers, dtype=jnp.int32))
        return self.final_norm(x), new_keys
