"""One orbax checkpoint per RL step, holding everything the run needs to go on exactly as if never stopped.

Items of the Composite checkpoint at DIR/<step>/:
- "state": the TrainState (parameters, optimiser state, update counter), restored with the step's shardings;
- "data": the grain iterator of the stage in progress (its position in the prompt stream);
- "trainer": a JSON record: completed RL steps, the stage whose iterator was saved, the problems each filtered
  stage kept, and the run's seed (every step's randomness is derived from seed and step, so this IS the RNG);
- "reference": the KL term's reference parameters, only when the loss has a KL term.
orbax marks a step complete only once every item is written, so a run killed mid-save resumes from the step before.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp

from rstar_jax.parallel import abstract_placed
from rstar_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class TrainerRecord:
    """The JSON part of a checkpoint: completed RL steps, the stage of the saved iterator, each filtered stage's kept
    problem ids (by stage index), and the run's seed."""

    step: int
    stage: int
    seed: int
    kept_problems: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (stage indices become strings, as JSON keys must)."""
        return {"step": self.step, "stage": self.stage, "seed": self.seed,
                "kept_problems": {str(k): v for k, v in self.kept_problems.items()}}

    @classmethod
    def from_json(cls, content: dict[str, Any]) -> "TrainerRecord":
        """The record `to_json` wrote."""
        return cls(int(content["step"]), int(content["stage"]), int(content["seed"]),
                   {int(k): list(v) for k, v in content.get("kept_problems", {}).items()})


def rl_checkpoint_manager(directory: str | Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
    """A manager keeping the latest `max_to_keep` RL checkpoints (the trainer decides when to save)."""
    if max_to_keep < 1:
        raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save_rl_checkpoint(manager: ocp.CheckpointManager, state: TrainState, iterator: grain.DatasetIterator,
                       record: TrainerRecord, reference: Any | None = None) -> None:
    """Save the step's checkpoint under `record.step` and wait until it is complete on disk."""
    items: dict[str, Any] = {"state": ocp.args.StandardSave(state),
                             "data": grain.checkpoint.CheckpointSave(iterator),
                             "trainer": ocp.args.JsonSave(record.to_json())}
    if reference is not None:
        items["reference"] = ocp.args.StandardSave(reference)
    manager.save(record.step, args=ocp.args.Composite(**items), force=True)
    manager.wait_until_finished()


def latest_record(manager: ocp.CheckpointManager) -> TrainerRecord | None:
    """The trainer record of the latest complete checkpoint, or None when there is none."""
    step = manager.latest_step()
    if step is None:
        return None
    restored = manager.restore(step, args=ocp.args.Composite(trainer=ocp.args.JsonRestore()))
    return TrainerRecord.from_json(restored["trainer"])


def restore_rl_checkpoint(manager: ocp.CheckpointManager, step: int, like: TrainState, shardings: TrainState,
                          iterator: grain.DatasetIterator,
                          reference_like: Any | None = None) -> tuple[TrainState, Any | None]:
    """The TrainState (placed with `shardings`) and reference parameters saved at `step`; moves `iterator` (a fresh
    iterator of the saved stage's pipeline) to the saved position."""
    items: dict[str, Any] = {"state": ocp.args.StandardRestore(abstract_placed(like, shardings)),
                             "data": grain.checkpoint.CheckpointRestore(iterator)}
    if reference_like is not None:
        items["reference"] = ocp.args.StandardRestore(abstract_placed(reference_like, shardings.params))
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"], restored.get("reference") if reference_like is not None else None
