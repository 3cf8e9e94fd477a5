"""A (config, params) pair callable like a Hugging Face model: ids (+ mask) in, float32 logits out."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from rstar_jax.model.config import ModelConfig
from rstar_jax.model.lm import Params, forward, positions_from_mask


@dataclasses.dataclass
class CausalLM:
    """A Qwen2/Qwen3 model with its weights; `model(input_ids, attention_mask=None)` -> logits [B, T, V] float32.

    Positions follow the mask (cumsum(mask) - 1), so a left-padded row gets the same logits as unpadded.
    """

    config: ModelConfig
    params: Params

    def __call__(self, input_ids: Any, attention_mask: Any = None) -> jax.Array:
        """Float32 logits for a batch of int32/int64 token ids [B, T] (numpy or jax); mask 1 marks real tokens."""
        ids = _as_token_batch(input_ids, self.config.vocab_size)
        if attention_mask is None:
            mask = np.ones(ids.shape, np.int32)
        else:
            mask = np.asarray(attention_mask)
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask shape {mask.shape} differs from input_ids shape {ids.shape}")
            if not np.isin(mask, (0, 1)).all():
                raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
            mask = mask.astype(np.int32)
        return _logits(self.params, self.config, ids, mask)


@functools.partial(jax.jit, static_argnums=1)
def _logits(params: Params, config: ModelConfig, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """forward() with positions derived from the mask, compiled once per shape."""
    return forward(params, config, input_ids, positions_from_mask(attention_mask), attention_mask)


def _as_token_batch(input_ids: Any, vocab_size: int) -> np.ndarray:
    """Validated int32 ids [B, T]: integer dtype, rank 2, every id inside the vocabulary."""
    ids = np.asarray(input_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got dtype {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, {vocab_size}), got values in [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32)
