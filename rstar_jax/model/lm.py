"""The functional causal LM used by the learner: init, full-sequence logits, and per-token log-probs of targets.

Parameters are a plain nested dict (the tree documented in `rstar_jax.model`); every function here is pure and
jitted with the (hashable) config static.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rstar_jax.model.backbone import Backbone
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.segments import SegmentIds, causal_segment_mask, segment_positions
from rstar_jax.model.token_head import fused_token_logprobs, head_logits, head_weight

Params = dict


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Token positions for a padded batch: cumsum(mask) - 1 clipped at 0, so left padding does not shift RoPE.

    The mask may also hold segment ids (several sequences packed in a row, `rstar_jax.model.segments`): each
    segment's positions then start at 0."""
    return segment_positions(attention_mask)


def causal_padding_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T, T] True where query t may read key s: s <= t and s is a real token (of t's segment, when the mask
    holds segment ids)."""
    return causal_segment_mask(attention_mask.astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, rng: jax.Array) -> Params:
    """Seeded random parameters, HF-like: normal(0.02) kernels and embeddings, zero biases, unit norm scales."""
    backbone_rng, head_rng = jax.random.split(rng)
    dummy = jnp.zeros((1, 1), jnp.int32)
    params = dict(Backbone(config).init(backbone_rng, dummy, dummy, jnp.ones((1, 1, 1), bool))["params"])
    if not config.tie_word_embeddings:
        kernel = 0.02 * jax.random.normal(head_rng, (config.hidden_size, config.vocab_size), jnp.float32)
        params["lm_head"] = {"kernel": kernel.astype(config.jnp_param_dtype)}
    return params


def logits_from_hidden(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output head: hidden [B, T, E] -> float32 logits [B, T, V] (tied embedding or lm_head), f32 accumulation."""
    return head_logits(head_weight(params, config), config, hidden)


def hidden_states(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
                  attention_mask: jax.Array) -> jax.Array:
    """Final-norm hidden states [B, T, E] of a padded batch under the causal + padding mask (causal within
    segments when `attention_mask` holds segment ids), attention by `config.attention_impl`."""
    _check_batch(input_ids, positions, attention_mask)
    hidden, _ = Backbone(config).apply({"params": params}, input_ids.astype(jnp.int32), positions.astype(jnp.int32),
                                       SegmentIds(attention_mask.astype(jnp.int32)))
    return hidden


@functools.partial(jax.jit, static_argnums=1)
def forward(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    """Training forward pass: float32 logits [B, T, V] (DESIGN "Functional learner"); padded positions are junk."""
    return logits_from_hidden(params, config, hidden_states(params, config, input_ids, positions, attention_mask))


def token_logprobs(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
                   attention_mask: jax.Array, targets: jax.Array, chunk_size: int = 512) -> jax.Array:
    """log p(targets[b, t] | input_ids[b, :t+1]) as float32 [B, T], for the GRPO loss (SPEC section 4, step 6).

    The vocabulary projection is fused with the log-softmax and the gather (`rstar_jax.model.token_head`): it runs
    over `chunk_size` positions at a time, forward and backward, so at most [B, chunk_size, V] logits exist at once
    instead of [B, T, V], and the gradient keeps only a log-sum-exp per token.
    """
    _check_targets(input_ids, targets, chunk_size)
    return _token_logprobs(params, config, input_ids, positions, attention_mask, targets, chunk_size, False)[0]


def token_logprobs_and_entropy(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
                               attention_mask: jax.Array, targets: jax.Array,
                               chunk_size: int = 512) -> tuple[jax.Array, jax.Array]:
    """`token_logprobs` and the entropy [B, T] of each position's next-token distribution (float32), for the
    optional entropy term of the policy loss; computed from the same chunked logits."""
    _check_targets(input_ids, targets, chunk_size)
    return _token_logprobs(params, config, input_ids, positions, attention_mask, targets, chunk_size, True)


def _check_targets(input_ids: jax.Array, targets: jax.Array, chunk_size: int) -> None:
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets shape {targets.shape} differs from input_ids shape {input_ids.shape}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


@functools.partial(jax.jit, static_argnums=(1, 6, 7))
def _token_logprobs(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
                    attention_mask: jax.Array, targets: jax.Array, chunk_size: int,
                    with_entropy: bool) -> tuple[jax.Array, jax.Array | None]:
    hidden = hidden_states(params, config, input_ids, positions, attention_mask)
    logprobs, entropy = fused_token_logprobs(head_weight(params, config), config, hidden, targets, chunk_size,
                                             with_entropy)
    return logprobs, (entropy if with_entropy else None)


def _check_batch(input_ids: jax.Array, positions: jax.Array, attention_mask: jax.Array) -> None:
    """Shape errors at trace time, naming the offending argument."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    for name, array in (("positions", positions), ("attention_mask", attention_mask)):
        if array.shape != input_ids.shape:
            raise ValueError(f"{name} shape {array.shape} differs from input_ids shape {input_ids.shape}")
