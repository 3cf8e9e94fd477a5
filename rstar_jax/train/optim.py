"""The learner's optimiser: AdamW behind global-norm clipping, with a warm-up then constant, cosine or linear rate.

SPEC section 5: the SFT stage uses AdamW, lr 5e-6, 4% warm-up then cosine decay (`sft_optimizer`); RL a constant
lr of 1e-6 after 20 warm-up steps (`rl_optimizer`). The two are separate gin configurables so one run (the demo:
SFT then RL) configures both without scopes: `sft_optimizer.learning_rate = ...`, `rl_optimizer.learning_rate = ...`.
"""

from __future__ import annotations

import gin
import optax

SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(total_steps: int, peak: float, warmup_steps: int, shape: str = "cosine",
                           end_fraction: float = 0.0) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps` (none when 0: the first step already runs at `peak`), then
    "constant" at `peak`, or "cosine" / "linear" decay to end_fraction * peak at `total_steps`."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if peak <= 0:
        raise ValueError(f"learning_rate must be positive, got {peak}")
    if shape not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {shape!r}; choose from {SCHEDULES}")
    if not 0 <= warmup_steps < max(total_steps, 2):
        raise ValueError(f"warm-up of {warmup_steps} steps does not fit in {total_steps} steps")
    if not 0.0 <= end_fraction <= 1.0:
        raise ValueError(f"end_fraction must be within [0, 1], got {end_fraction}")
    decay_steps = max(1, total_steps - warmup_steps)
    after = {"constant": optax.constant_schedule(peak),
             "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=end_fraction),
             "linear": optax.linear_schedule(peak, end_fraction * peak, decay_steps)}[shape]
    if warmup_steps == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), after], [warmup_steps])


def with_warm_restarts(schedule: optax.Schedule, total_steps: int, cycles: int, cycle_steps: int, peak: float,
                       warmup_fraction: float, end_fraction: float) -> optax.Schedule:
    """`schedule` over its `total_steps`, then `cycles` cycles of `cycle_steps`, each warming up again to `peak` and
    decaying by cosine to end_fraction * peak (SGDR's warm restarts): the optional extra rounds of the format SFT's
    copy gate. Before `total_steps` the rates are `schedule`'s own, so a run that never restarts is unchanged."""
    if cycles == 0:
        return schedule
    cycle = learning_rate_schedule(cycle_steps, peak, round(warmup_fraction * cycle_steps), "cosine", end_fraction)
    return optax.join_schedules([schedule] + [cycle] * cycles,
                                [total_steps + index * cycle_steps for index in range(cycles)])


def adamw_optimizer(total_steps: int, learning_rate: float, warmup_steps: int | None = None,
                    warmup_fraction: float = 0.0, schedule: str = "cosine", end_fraction: float = 0.0,
                    weight_decay: float = 0.0, clip_norm: float | None = 1.0, b1: float = 0.9,
                    b2: float = 0.999, restarts: tuple[int, int, float] = (0, 0, 1.0),
                    ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decoupled weight decay) after clipping the gradient's global norm to `clip_norm` (None: no clip).

    The warm-up lasts `warmup_steps`, or `warmup_fraction` of `total_steps` when that is None. `restarts` (cycles,
    steps a cycle, peak as a fraction of `learning_rate`) appends warm restarts after `total_steps`
    (`with_warm_restarts`). Returns the transformation and its learning-rate schedule (for logging each step's rate).
    """
    if clip_norm is not None and clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive or None, got {clip_norm}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be within [0, 1), got {warmup_fraction}")
    warmup = round(warmup_fraction * total_steps) if warmup_steps is None else warmup_steps
    cycles, cycle_steps, cycle_peak = restarts
    rate = with_warm_restarts(learning_rate_schedule(total_steps, learning_rate, warmup, schedule, end_fraction),
                              total_steps, cycles, cycle_steps, cycle_peak * learning_rate, warmup_fraction,
                              end_fraction)
    adamw = optax.adamw(rate, b1=b1, b2=b2, weight_decay=weight_decay)
    if clip_norm is None:
        return adamw, rate
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw), rate


@gin.configurable
def sft_optimizer(total_steps: int, learning_rate: float = 5e-6, warmup_fraction: float = 0.04,
                  schedule: str = "cosine", end_fraction: float = 0.0, weight_decay: float = 0.0,
                  clip_norm: float | None = 1.0, b1: float = 0.9,
                  b2: float = 0.999, restarts: tuple[int, int, float] = (0, 0, 1.0),
                  ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The SFT optimiser (SPEC 5: lr 5e-6, 4% warm-up, cosine), with the copy gate's `restarts` (cycles, steps,
    peak fraction) when it may add rounds; see `adamw_optimizer`."""
    return adamw_optimizer(total_steps, learning_rate, None, warmup_fraction, schedule, end_fraction, weight_decay,
                           clip_norm, b1, b2, restarts)


@gin.configurable
def rl_optimizer(total_steps: int, learning_rate: float = 1e-6, warmup_steps: int = 20, schedule: str = "constant",
                 end_fraction: float = 0.0, weight_decay: float = 0.0, clip_norm: float | None = 1.0,
                 b1: float = 0.9, b2: float = 0.999) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The RL optimiser (SPEC 5: lr 1e-6, 20 warm-up steps, then constant); see `adamw_optimizer`."""
    return adamw_optimizer(total_steps, learning_rate, warmup_steps, 0.0, schedule, end_fraction, weight_decay,
                           clip_norm, b1, b2)
