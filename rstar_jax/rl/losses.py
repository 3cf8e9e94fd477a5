"""Every loss of the learner as a small pure function of per-token arrays, in one module.

A loss maps per-token log-probs [B, T] of the target tokens (plus whatever per-token arrays it needs) and the loss
mask [B, T] to a scalar. Normalisation is by weights: `loss_weights` turns the mask into per-token weights whose
weighted sum is the loss, which is also how gradient accumulation stays exact (each micro-batch is weighted by the
whole batch's token or sequence count, so the micro-batches' losses add up to the big batch's loss).
- `masked_nll`: the SFT loss (SPEC section 5).
- `policy_loss`: the clipped surrogate with Clip-Higher of GRPO-RoC (SPEC section 4, step 6), its variants (dual clip,
  normalisation, KL and entropy terms) selected by `PolicyLossOptions` from gin.
The two have different inputs and callers (`train.sft`, `train.rl_step`), so there is no registry: a new RL loss is
an option of `PolicyLossOptions` that `policy_loss` reads.
"""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp

from rstar_jax.model.segments import per_segment

NORMALIZATIONS = ("token_mean", "sequence_mean")
KL_ESTIMATORS = ("k1", "k3")


def loss_weights(loss_mask: jax.Array, normalization: str = "token_mean", total_tokens: jax.Array | None = None,
                 total_sequences: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """Per-token weights [B, T] whose weighted sum of per-token values is the normalised loss.

    "token_mean" (SPEC 4.6): every unmasked token of the batch counts once, so the loss is the sum over response
    tokens divided by their count. "sequence_mean": each sequence's token mean, averaged over sequences with at
    least one unmasked token; a sequence is a row, or with `segment_ids` [B, T] (packed rows, `model.segments`) a
    row's segment. `total_tokens` / `total_sequences` are the whole batch's counts when this is one micro-batch of it
    (default: this batch's own).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown loss normalization {normalization!r}; choose from {NORMALIZATIONS}")
    mask = loss_mask.astype(jnp.float32)
    if normalization == "token_mean":
        count = jnp.sum(mask) if total_tokens is None else jnp.asarray(total_tokens, jnp.float32)
        return mask / jnp.maximum(count, 1.0)
    if segment_ids is None:
        lengths = jnp.sum(mask, axis=-1, keepdims=True)
    else:
        lengths = per_segment(mask, segment_ids, jax.ops.segment_sum)  # each token's own trajectory's
    if total_sequences is None:
        sequences = jnp.round(jnp.sum(jnp.where(mask > 0, 1.0 / jnp.maximum(lengths, 1.0), 0.0)))  # each adds 1
    else:
        sequences = jnp.asarray(total_sequences, jnp.float32)
    return mask / jnp.maximum(lengths, 1.0) / jnp.maximum(sequences, 1.0)


def masked_token_mean(values: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Token-level mean of `values` [B, T] over positions where `loss_mask` is 1 (0.0 when no token is masked in)."""
    if values.shape != loss_mask.shape:
        raise ValueError(f"values shape {values.shape} differs from loss_mask shape {loss_mask.shape}")
    return jnp.sum(values.astype(jnp.float32) * loss_weights(loss_mask))


def masked_nll(logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Negative log-likelihood of the target tokens, token-level normalised: the SFT loss (SPEC section 5).

    `logprobs` [B, T] are log p(target) per position; `loss_mask` [B, T] is 1 on trained tokens (assistant
    turns), 0 on prompt, tool responses and padding.
    """
    return masked_token_mean(-logprobs, loss_mask)


def clipped_surrogate(log_ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float,
                      dual_clip: float | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token PPO loss with Clip-Higher and an optional dual clip (SPEC 4.6); returns it and 0/1 clip indicators.

    With ratio r = exp(log_ratio) and advantage A (broadcast over tokens): max(-r A, -clip(r, 1 - eps_low,
    1 + eps_high) A). The asymmetric range lets unlikely tokens with positive advantage grow further than likely
    ones shrink (DAPO's Clip-Higher). The dual clip (the release uses verl's 3.0) caps the loss of a negative-advantage
    token at -dual_clip * A, so a huge ratio on a bad token cannot blow up the update.
    """
    ratio = jnp.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = jnp.maximum(unclipped, clipped)
    indicators = {"clipped_fraction": (clipped > unclipped).astype(jnp.float32)}
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = jnp.where(dual, cap, loss)
        indicators["dual_clipped_fraction"] = dual.astype(jnp.float32)
    return loss, indicators


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(policy || reference) from sampled tokens: "k1" log(p/q), "k3" q/p - log(q/p) - 1
    (unbiased and non-negative; Schulman's estimators)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose from {KL_ESTIMATORS}")
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    return jnp.exp(log_ratio) - log_ratio - 1.0


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, loss_mask: jax.Array, *,
                eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = None,
                normalization: str = "token_mean", kl_coef: float = 0.0, kl_estimator: str = "k3",
                ref_logprobs: jax.Array | None = None, entropy_coef: float = 0.0, entropy: jax.Array | None = None,
                total_tokens: jax.Array | None = None, total_sequences: jax.Array | None = None,
                segment_ids: jax.Array | None = None,
                with_metrics: bool = False) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO-RoC policy loss (SPEC 4.6): clipped surrogate with Clip-Higher, token-mean over the batch.

    logprobs / old_logprobs / loss_mask [B, T]: the current and the rollout policy's log p of each target token, and
    1 on the model's own tokens (tool responses, prompt and padding 0); advantages [B], one per row, or [B, T], each
    token's sequence's (packed rows; `segment_ids` then tells "sequence_mean" their sequences). SPEC 4.6
    has no KL and no entropy term: `kl_coef` (with `ref_logprobs` [B, T] and `kl_estimator`) and `entropy_coef`
    (with per-token `entropy` [B, T], subtracted as a bonus) are gin options, off by default. `normalization`
    "sequence_mean" averages each sequence's tokens first. With `total_tokens` / `total_sequences` the batch is one
    micro-batch of a bigger one (see `loss_weights`). Returns the scalar, or (loss, metrics) with `with_metrics`:
    each metric is a weighted mean over the same tokens, so micro-batch metrics also add up.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {logprobs.shape}, old_logprobs {old_logprobs.shape} and loss_mask "
                         f"{loss_mask.shape} must share one [B, T] shape")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be [B] = {logprobs.shape[:1]} or [B, T] = {logprobs.shape}, "
                         f"got {advantages.shape}")
    if not 0 <= eps_low < 1 or eps_high < 0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must exceed 1 (verl uses 3.0), got {dual_clip}")
    weights = loss_weights(loss_mask, normalization, total_tokens, total_sequences, segment_ids)
    per_token_advantages = advantages[:, None] if advantages.ndim == 1 else advantages
    per_token, indicators = clipped_surrogate(logprobs - old_logprobs, per_token_advantages.astype(jnp.float32),
                                              eps_low, eps_high, dual_clip)
    metrics = {"policy_loss": per_token, **indicators, "approx_kl": kl_penalty(logprobs, old_logprobs, "k3")}
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        metrics["kl"] = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * metrics["kl"]
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        metrics["entropy"] = entropy
        per_token = per_token - entropy_coef * entropy
    loss = jnp.sum(per_token * weights)
    if not with_metrics:
        return loss
    return loss, {name: jnp.sum(jax.lax.stop_gradient(values) * weights) for name, values in metrics.items()}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PolicyLossOptions:
    """The gin-set options of `policy_loss` a learner applies (defaults: SPEC 4.6, no KL, no entropy term).

    A learner reads `needs_reference` / `needs_entropy` to know whether to compute reference log-probs or entropies.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    normalization: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown loss normalization {self.normalization!r}; choose from {NORMALIZATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; choose from {KL_ESTIMATORS}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss has a KL term (and so needs the reference policy's log-probs)."""
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss has an entropy term."""
        return self.entropy_coef > 0
