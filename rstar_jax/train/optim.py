"""The learner's optimiser: AdamW behind global-norm clipping, with a linear-warmup + cosine learning rate.

SPEC section 5: the SFT stage uses AdamW, lr 5e-6, 4% warmup then cosine decay; RL a constant lr after warmup
(end_fraction 1.0). Every knob is a gin parameter (`adamw_optimizer.learning_rate = ...`).
"""

from __future__ import annotations

import gin
import optax


def warmup_cosine_schedule(total_steps: int, peak: float, warmup_fraction: float,
                           end_fraction: float) -> optax.Schedule:
    """Linear warmup over warmup_fraction * total_steps (at least one step), then cosine to end_fraction * peak."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if peak <= 0:
        raise ValueError(f"learning_rate must be positive, got {peak}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be within [0, 1), got {warmup_fraction}")
    if not 0.0 <= end_fraction <= 1.0:
        raise ValueError(f"end_fraction must be within [0, 1], got {end_fraction}")
    warmup_steps = max(1, round(warmup_fraction * total_steps))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=end_fraction * peak)


@gin.configurable
def adamw_optimizer(
    total_steps: int,
    learning_rate: float = 5e-6,
    warmup_fraction: float = 0.04,
    end_fraction: float = 0.0,
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decoupled weight decay) after clipping the gradient's global norm to `clip_norm` (None: no clip).

    Returns the transformation and its learning-rate schedule (for logging the rate of each step).
    """
    if clip_norm is not None and clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive or None, got {clip_norm}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    schedule = warmup_cosine_schedule(total_steps, learning_rate, warmup_fraction, end_fraction)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    if clip_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw), schedule
