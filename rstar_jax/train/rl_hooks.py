"""Where an RL run is, and what runs after each of its steps (issue 25 item 6; DESIGN "Data flow of one RL step").

`RunPosition` is the whole of a run's moving state between steps: steps done, the stage it is in, each filtered
stage's kept problems, the train state, the KL reference and the stage's prompt iterator. After every step the
trainer calls its hooks in order with a `StepEvent`; checkpointing, the metrics log and the progress line are
hooks like any a user adds (`RLTrainer(hooks=...)` or `RLTrainer.add_hook`), so adding one (an evaluation every
N steps, a plot, an alert) never means editing the loop. A hook may add figures to `event.metrics`; the metrics
hook runs last but one, so they are logged. A learner over several JAX processes runs the checkpoint hook and the
user's hooks on every process (a checkpoint is written by all; a hook with host-side effects checks
`multihost.is_driver()`: only the driver's metrics hold the rollouts' figures) and the metrics and progress hooks on
the driver alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import orbax.checkpoint as ocp

from rstar_jax.console import Progress
from rstar_jax.model.lm import Params
from rstar_jax.train.metrics import MetricsWriter
from rstar_jax.train.rl_checkpoint import TrainerRecord, save_rl_checkpoint
from rstar_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class RunPosition:
    """A run between two steps: `step` steps done, inside stage `stage` (None before the first), `kept`: the
    problem ids each filtered stage kept; `state`, `reference` (None without a KL term) and `iterator` (the
    stage's prompt stream, grain, checkpointed with the run). Steps return a new position; nothing is changed in
    place."""

    step: int
    stage: int | None
    kept: Mapping[int, tuple[str, ...]]
    state: TrainState
    reference: Params | None
    iterator: Any

    def record(self, seed: int) -> TrainerRecord:
        """The checkpoint's JSON part for this position of a run of `seed`."""
        assert self.stage is not None, "a run records its position only inside a stage"
        return TrainerRecord(self.step, self.stage, seed, {index: list(ids) for index, ids in self.kept.items()})


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """What a hook is given after a step: the position after it (`position.step` steps done), the total steps of
    the run, the stage's name and the step's metrics (a hook may add to them)."""

    position: RunPosition
    total_steps: int
    stage_name: str
    metrics: dict[str, Any]

    @property
    def is_last(self) -> bool:
        """Whether this was the run's last step."""
        return self.position.step == self.total_steps


StepHook = Callable[[StepEvent], None]


def every(steps: int, hook: StepHook, at_last: bool = True) -> StepHook:
    """`hook` called after every `steps`-th step (and after the last one when `at_last`)."""
    if steps < 1:
        raise ValueError(f"a hook's interval must be >= 1 step, got {steps}")

    def maybe(event: StepEvent) -> None:
        if event.position.step % steps == 0 or (at_last and event.is_last):
            hook(event)

    return maybe


def checkpoint_hook(manager: ocp.CheckpointManager, seed: int) -> StepHook:
    """Save the position as an orbax checkpoint (state, reference, prompt iterator, record) and add its seconds
    to the metrics as seconds/checkpoint; wrap it in `every` for an interval."""

    def save(event: StepEvent) -> None:
        started = time.monotonic()
        position = event.position
        save_rl_checkpoint(manager, position.state, position.iterator, position.record(seed), position.reference)
        event.metrics.setdefault("seconds", {})["checkpoint"] = time.monotonic() - started

    return save


def metrics_hook(writer: MetricsWriter) -> StepHook:
    """Write the step's metrics (JSONL + TensorBoard)."""
    return lambda event: writer.write(event.position.step, event.metrics)


def progress_hook(progress: Progress) -> StepHook:
    """Advance the console's progress line with the stage, accuracy, groups kept and log-prob gap."""

    def advance(event: StepEvent) -> None:
        metrics = event.metrics
        progress.advance(stage=event.stage_name, accuracy=metrics["accuracy"], kept=metrics["groups_kept"],
                         gap=metrics.get("logprob_gap", 0.0))

    return advance
