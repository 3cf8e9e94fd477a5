"""The output head fused with log-softmax and the target gather: per-token log-probs (and entropies) of a batch
without a [B, T, V] array in the gradient.

The GRPO loss (SPEC section 4, step 6) and the SFT loss (SPEC section 5) need only log p(target) per token, yet
the naive gradient keeps the float32 logits, the log-softmax and a scattered one-hot of the same [B, T, V] shape
(issue 12). Here the forward pass computes each chunk's logits once and keeps only its log-sum-exp [B, T]; the
backward pass recomputes the chunk's logits once and forms d logits = g (onehot(target) - softmax) (plus the
entropy term) in the same elementwise pass, then the two matmuls of the projection. Chunks run over the sequence
axis `chunk` positions at a time (every row in each chunk, so a batch split over devices stays split), at most
[B, chunk, V] float32 logits existing at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rstar_jax.model.config import ModelConfig
from rstar_jax.parallel import constrain


def head_weight(params: dict, config: ModelConfig) -> jax.Array:
    """The output projection's parameter: the embedding [V, E] when tied, else lm_head's kernel [E, V]."""
    return params["embed"]["embedding"] if config.tie_word_embeddings else params["lm_head"]["kernel"]


def head_logits(weight: jax.Array, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, E] -> float32 logits [B, T, V] through `head_weight` in the compute dtype, f32 accumulation."""
    hidden = hidden.astype(config.jnp_dtype)
    spec = "bte,ve->btv" if config.tie_word_embeddings else "bte,ev->btv"
    logits = jnp.einsum(spec, hidden, weight.astype(config.jnp_dtype), preferred_element_type=jnp.float32,
                        precision=config.jax_precision)
    return constrain(logits, "batch", "seq", "vocab")


def fused_token_logprobs(weight: jax.Array, config: ModelConfig, hidden: jax.Array, targets: jax.Array,
                         chunk: int, with_entropy: bool) -> tuple[jax.Array, jax.Array]:
    """(log p(targets) [B, T], entropy [B, T]) in float32 from final hidden states [B, T, E]; the entropy is zeros
    unless `with_entropy`. Differentiable in `weight` and `hidden`."""
    length = hidden.shape[1]
    chunk = min(chunk, length)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length
    hidden_chunks = _to_chunks(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))), chunks)
    target_chunks = _to_chunks(jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad))), chunks)
    logprobs, entropy = _fused(weight, hidden_chunks, target_chunks, config, with_entropy)
    return _from_chunks(logprobs)[:, :length], _from_chunks(entropy)[:, :length]


def _to_chunks(x: jax.Array, chunks: int) -> jax.Array:
    """[B, chunks * C, ...] -> [chunks, B, C, ...]."""
    return x.reshape(x.shape[0], chunks, -1, *x.shape[2:]).swapaxes(0, 1)


def _from_chunks(x: jax.Array) -> jax.Array:
    """[chunks, B, C] -> [B, chunks * C]."""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1)


def _chunk_forward(weight: jax.Array, config: ModelConfig, hidden: jax.Array,
                   targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One chunk's logits [B, C, V] (float32), log-sum-exp and target log-probs [B, C]."""
    logits = head_logits(weight, config, hidden)
    log_normaliser = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return logits, log_normaliser, picked - log_normaliser


def _entropy(logits: jax.Array, log_normaliser: jax.Array) -> jax.Array:
    """-sum p log p from logits and their log-sum-exp: lse - E_p[logits]."""
    probs = jnp.exp(logits - log_normaliser[..., None])
    return log_normaliser - jnp.sum(probs * logits, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(weight: jax.Array, hidden_chunks: jax.Array, target_chunks: jax.Array, config: ModelConfig,
           with_entropy: bool) -> tuple[jax.Array, jax.Array]:
    return _fused_fwd(weight, hidden_chunks, target_chunks, config, with_entropy)[0]


def _fused_fwd(weight: jax.Array, hidden_chunks: jax.Array, target_chunks: jax.Array, config: ModelConfig,
               with_entropy: bool) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    def chunk_outputs(_: None, pair: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, ...]]:
        logits, log_normaliser, logprobs = _chunk_forward(weight, config, *pair)
        entropy = _entropy(logits, log_normaliser) if with_entropy else jnp.zeros_like(logprobs)
        return None, (logprobs, entropy, log_normaliser)

    _, (logprobs, entropy, log_normaliser) = jax.lax.scan(chunk_outputs, None, (hidden_chunks, target_chunks))
    return (logprobs, entropy), (weight, hidden_chunks, target_chunks, log_normaliser, entropy)


def _fused_bwd(config: ModelConfig, with_entropy: bool, residuals: tuple[jax.Array, ...],
               cotangents: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, None]:
    weight, hidden_chunks, target_chunks, log_normaliser, entropy = residuals
    d_logprobs, d_entropy = cotangents
    compute, precision, tied = config.jnp_dtype, config.jax_precision, config.tie_word_embeddings

    def chunk_gradients(d_weight: jax.Array, inputs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        hidden, targets, lse, chunk_entropy, d_logprob, d_chunk_entropy = inputs
        logits = head_logits(weight, config, hidden)
        probs = jnp.exp(logits - lse[..., None])
        one_hot = jnp.arange(logits.shape[-1]) == targets[..., None]
        # d logp(target) / d logits = onehot - p; d entropy / d logits = -p (log p + entropy).
        d_logits = d_logprob[..., None] * (one_hot - probs)
        if with_entropy:
            log_probs = logits - lse[..., None]
            d_logits = d_logits - d_chunk_entropy[..., None] * probs * (log_probs + chunk_entropy[..., None])
        # Flat [B*C, .] matmuls: XLA:CPU runs a weight gradient that contracts two leading axes far slower.
        flat_d_logits = d_logits.astype(compute).reshape(-1, d_logits.shape[-1])
        flat_hidden = hidden.astype(compute).reshape(-1, hidden.shape[-1])
        kernel = weight.astype(compute)
        if tied:  # logits = hidden @ embedding.T
            d_hidden = jnp.dot(flat_d_logits, kernel, preferred_element_type=jnp.float32, precision=precision)
            d_weight = d_weight + jnp.dot(flat_d_logits.T, flat_hidden, preferred_element_type=jnp.float32,
                                          precision=precision)
        else:  # logits = hidden @ kernel
            d_hidden = jnp.dot(flat_d_logits, kernel.T, preferred_element_type=jnp.float32, precision=precision)
            d_weight = d_weight + jnp.dot(flat_hidden.T, flat_d_logits, preferred_element_type=jnp.float32,
                                          precision=precision)
        d_hidden = d_hidden.reshape(hidden.shape)
        return d_weight, d_hidden.astype(hidden.dtype)

    d_weight, d_hidden = jax.lax.scan(
        chunk_gradients, jnp.zeros(weight.shape, jnp.float32),
        (hidden_chunks, target_chunks, log_normaliser, entropy, d_logprobs, d_entropy))
    return d_weight.astype(weight.dtype), d_hidden, None


_fused.defvjp(_fused_fwd, _fused_bwd)
