"""The standard axes of the experiments: the RoC ablation's selectors (SPEC 4: GRPO-RoC in both modes, the
penalty-reward baseline at several lambdas, plain GRPO) and seeds, each seed optionally with its own SFT model (the
ablation crosses the two; a sweep may add seeds to any grid).

Pure: it only names gin bindings (`make_selector.algorithm`, `RocSelector.mode`, `PenaltySelector.penalty_lambda`,
`RLSettings.seed`), which `rstar_jax.rl.selection` and the trainer read.
"""

from __future__ import annotations

from typing import Sequence

from rstar_jax.grid.points import Axis, AxisValue, GridError

ARMS = ("roc_paper", "roc_release", "penalty", "grpo")
SELECTOR_AXIS = "selector"
SEED_AXIS = "seed"


def selector_axis(arms: Sequence[str] = ARMS, lambdas: Sequence[float] = (0.25, 0.5, 1.0)) -> Axis:
    """SPEC 4's arms as one axis: "roc_paper" / "roc_release" (GRPO-RoC, 2G sampled, G kept), "penalty" (one value per
    lambda: G rollouts, a correct answer earns 1 - lambda * p_err) and "grpo" (G rollouts, plain GRPO)."""
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown or not arms:
        raise GridError(f"unknown ablation arms {unknown or list(arms)}; choose from {ARMS}")
    if len(set(arms)) != len(arms):
        raise GridError(f"repeated ablation arms: {list(arms)}")
    values: list[AxisValue] = []
    for arm in arms:
        if arm.startswith("roc_"):
            mode = arm.removeprefix("roc_")
            values.append(AxisValue(arm, ("make_selector.algorithm = 'roc'", f"RocSelector.mode = '{mode}'")))
        elif arm == "penalty":
            if not lambdas:
                raise GridError("the penalty arm needs at least one lambda (--lambdas)")
            if len(set(lambdas)) != len(lambdas) or any(value < 0 for value in lambdas):
                raise GridError(f"penalty lambdas must be distinct and >= 0, got {list(lambdas)}")
            values += [AxisValue(f"penalty_l{value:g}", ("make_selector.algorithm = 'penalty'",
                                                           f"PenaltySelector.penalty_lambda = {value!r}"))
                       for value in lambdas]
        else:
            values.append(AxisValue(arm, ("make_selector.algorithm = 'grpo'",)))
    return Axis(SELECTOR_AXIS, tuple(values))


def seed_axis(seeds: Sequence[int], model_template: str | None = None) -> Axis:
    """One value per seed binding `RLSettings.seed` (SPEC 5's RL run reseeded: sampling, selection, data order);
    `model_template` with "{seed}" in it (e.g. /tmp/exp/seed{seed}/sft/model) gives each seed its own start model."""
    if not seeds:
        raise GridError("at least one seed is needed (--seeds)")
    if len(set(seeds)) != len(seeds) or any(seed < 0 for seed in seeds):
        raise GridError(f"seeds must be distinct and >= 0, got {list(seeds)}")
    per_seed = model_template is not None and "{seed}" in model_template
    return Axis(SEED_AXIS, tuple(AxisValue(f"seed{seed}", (f"RLSettings.seed = {seed}",),
                                           model_template.format(seed=seed) if per_seed else None)
                                 for seed in seeds))
