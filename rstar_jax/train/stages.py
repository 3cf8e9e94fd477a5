"""The multi-stage RL recipe as gin records (SPEC section 5: stages of growing max response length, the last on
the problems the current model does not always solve, with an optimiser reset).

In gin a run lists its stages, each a scoped `Stage`:

    RLSettings.stages = [@stage1/Stage(), @stage2/Stage()]
    stage1/Stage.steps = 300
    stage1/Stage.max_response_tokens = 8192
    stage1/Stage.data = @stage1/ProblemSource()
    stage1/ProblemSource.source = 'math_train'
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import gin

from rstar_jax.data.problem_source import ProblemSource

DATA_FILTERS = ("drop_solved",)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Stage:
    """One RL stage (SPEC 5).

    steps: RL steps in the stage; max_response_tokens / max_turns: the agent loop's budget and turn limit T;
    data: where its prompts come from; data_filter: None, or "drop_solved" (SPEC 5 stage 3: before the stage, each
    problem is tried `filter_samples` times by the current model and those solved every time are removed);
    filter_problems: how many of the data's problems the filter tries (None: all); reset_optimizer: fresh optimiser
    moments at the stage's start; refresh_reference: the KL term's reference policy becomes the current one.
    """

    name: str = "stage"
    steps: int = 1
    max_response_tokens: int = 8192
    max_turns: int = 10
    data: ProblemSource = ProblemSource()
    data_filter: str | None = None
    filter_samples: int = 8
    filter_problems: int | None = None
    reset_optimizer: bool = False
    refresh_reference: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"stage {self.name!r}: steps must be >= 1, got {self.steps}")
        if self.max_response_tokens < 1 or self.max_turns < 1:
            raise ValueError(f"stage {self.name!r}: max_response_tokens and max_turns must be >= 1, got "
                             f"{self.max_response_tokens}, {self.max_turns}")
        if self.data_filter is not None and self.data_filter not in DATA_FILTERS:
            raise ValueError(f"stage {self.name!r}: unknown data_filter {self.data_filter!r}; choose from "
                             f"{DATA_FILTERS} or None")
        if self.filter_samples < 1:
            raise ValueError(f"stage {self.name!r}: filter_samples must be >= 1, got {self.filter_samples}")


def check_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """The stages as a tuple, refusing an empty list and repeated names (metrics and checkpoints name stages)."""
    stages = tuple(stages)
    if not stages:
        raise ValueError("an RL run needs at least one stage (RLSettings.stages)")
    names = [stage.name for stage in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be distinct, got {names}")
    for stage in stages:
        if not isinstance(stage, Stage):
            raise TypeError(f"RLSettings.stages must hold Stage records, got {type(stage).__name__}")
    return stages


def stage_at(stages: Sequence[Stage], step: int) -> tuple[int, int]:
    """(stage index, step within that stage) of global RL step `step` (0-based); past the end: (len, 0)."""
    for index, stage in enumerate(stages):
        if step < stage.steps:
            return index, step
        step -= stage.steps
    return len(stages), 0
