"""Pure loss functions of the learner, kept in one registry so a training step can pick its loss by name.

Each loss maps per-token log-probs [B, T] of the target tokens (plus whatever per-token arrays it needs, all
[B, T]) and the loss mask [B, T] to a scalar. Every loss here normalises at the token level: the sum over all
masked tokens of the batch divided by their count (SPEC section 4, step 6; section 5 uses the same for SFT), so a
long response weighs as much per token as a short one. The RL losses are registered beside these.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

LossFn = Callable[..., jax.Array]

LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss function to `LOSSES` under `name`; a second loss of the same name is an error."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"a loss named {name!r} is already registered ({LOSSES[name].__qualname__})")
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name: str) -> LossFn:
    """The registered loss called `name`, with the known names in the error when there is none."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered losses: {sorted(LOSSES)}")
    return LOSSES[name]


def masked_token_mean(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Token-level mean of `values` [B, T] over positions where `loss_mask` is 1 (0.0 when no token is masked in).

    The shared normaliser of every loss here (SPEC section 4, step 6: sum over the batch's response tokens,
    divided by their count).
    """
    if values.shape != loss_mask.shape:
        raise ValueError(f"values shape {values.shape} differs from loss_mask shape {loss_mask.shape}")
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(values.astype(jnp.float32) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@register_loss("nll")
def masked_nll(logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Negative log-likelihood of the target tokens, token-level normalised: the SFT loss (SPEC section 5).

    `logprobs` [B, T] are log p(target) per position; `loss_mask` [B, T] is 1 on trained tokens (assistant
    turns), 0 on prompt, tool responses and padding.
    """
    return masked_token_mean(-logprobs, loss_mask)
