"""The functional causal LM used by the learner: init, full-sequence logits, and per-token log-probs of targets.

Parameters are a plain nested dict (the tree documented in `rstar_jax.model`); every function here is pure and
jitted with the (hashable) config static.
"""

from __future__ import annotations

import functools

import gin
import jax
import jax.numpy as jnp

from rstar_jax.model.backbone import Backbone
from rstar_jax.model.config import ModelConfig
from rstar_jax.parallel import constrain

Params = dict


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Token positions for a padded batch: cumsum(mask) - 1 clipped at 0, so left padding does not shift RoPE."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def causal_padding_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T, T] True where query t may read key s: s <= t and s is a real token."""
    length = attention_mask.shape[-1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    return causal[None] & attention_mask.astype(bool)[:, None, :]


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
    hidden = hidden.astype(config.jnp_dtype)
    if config.tie_word_embeddings:
        embedding = params["embed"]["embedding"].astype(config.jnp_dtype)
        logits = jnp.einsum("bte,ve->btv", hidden, embedding, preferred_element_type=jnp.float32,
                            precision=config.jax_precision)
    else:
        kernel = params["lm_head"]["kernel"].astype(config.jnp_dtype)
        logits = jnp.einsum("bte,ev->btv", hidden, kernel, preferred_element_type=jnp.float32,
                            precision=config.jax_precision)
    return constrain(logits, "batch", "seq", "vocab")


def hidden_states(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
                  attention_mask: jax.Array) -> jax.Array:
    """Final-norm hidden states [B, T, E] of a padded batch under the causal + padding mask."""
    _check_batch(input_ids, positions, attention_mask)
    hidden, _ = Backbone(config).apply({"params": params}, input_ids.astype(jnp.int32), positions.astype(jnp.int32),
                                       causal_padding_mask(attention_mask))
    return hidden


@functools.partial(jax.jit, static_argnums=1)
def forward(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
            attention_mask: jax.Array) -> jax.Array:
    """Training forward pass: float32 logits [B, T, V] (DESIGN "Functional learner"); padded positions are junk."""
    return logits_from_hidden(params, config, hidden_states(params, config, input_ids, positions, attention_mask))


@gin.configurable
def token_logprobs(params: Params, config: ModelConfig, input_ids: jax.Array, positions: jax.Array,
                   attention_mask: jax.Array, targets: jax.Array, chunk_size: int = 512) -> jax.Array:
    """log p(targets[b, t] | input_ids[b, :t+1]) as float32 [B, T], for the GRPO loss (SPEC section 4, step 6).

    The vocabulary projection runs over `chunk_size` positions at a time and is rematerialised in the backward
    pass, so at most [B, chunk_size, V] logits exist at once instead of [B, T, V].
    """
    _check_targets(input_ids, targets, chunk_size)
    return _token_logprobs(params, config, input_ids, positions, attention_mask, targets, chunk_size, False)[0]


@gin.configurable
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
    batch, length, embed = hidden.shape
    chunk = min(chunk_size, length)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    padded_targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    hidden_chunks = hidden.reshape(batch, num_chunks, chunk, embed).swapaxes(0, 1)
    target_chunks = padded_targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_logprobs(pair: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hidden_chunk, target_chunk = pair
        logits = logits_from_hidden(params, config, hidden_chunk)
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, target_chunk[..., None], axis=-1)[..., 0] - normaliser
        if not with_entropy:
            return picked, jnp.zeros_like(picked)
        probs = jax.nn.softmax(logits, axis=-1)
        return picked, normaliser - jnp.sum(probs * logits, axis=-1)

    logprobs, entropy = jax.lax.map(chunk_logprobs, (hidden_chunks, target_chunks))

    def unchunk(values: jax.Array) -> jax.Array:
        return values.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]

    return unchunk(logprobs), (unchunk(entropy) if with_entropy else None)


def _check_batch(input_ids: jax.Array, positions: jax.Array, attention_mask: jax.Array) -> None:
    """Shape errors at trace time, naming the offending argument."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    for name, array in (("positions", positions), ("attention_mask", attention_mask)):
        if array.shape != input_ids.shape:
            raise ValueError(f"{name} shape {array.shape} differs from input_ids shape {input_ids.shape}")
