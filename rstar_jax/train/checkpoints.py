"""Orbax checkpoints of the whole TrainState, so a killed training run resumes where its last save left off.

Saves go to DIR/<step>/ every `save_every` steps (orbax only marks a step complete once fully written, so a run
killed mid-save resumes from the previous one). Restoring places every array with the shardings the train step
expects, so the resumed step runs on the same layout as the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import gin
import jax
import orbax.checkpoint as ocp

from rstar_jax.train.state import TrainState


@gin.configurable
def checkpoint_manager(directory: str | Path, save_every: int = 25, max_to_keep: int = 2) -> ocp.CheckpointManager:
    """A manager that keeps the latest `max_to_keep` TrainState checkpoints, saved every `save_every` steps."""
    if save_every < 1 or max_to_keep < 1:
        raise ValueError(f"checkpoint save_every and max_to_keep must be >= 1, got {save_every} and {max_to_keep}")
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save_state(manager: ocp.CheckpointManager, state: TrainState) -> bool:
    """Save `state` under its own step number if the manager's interval says so; returns whether it saved."""
    return manager.save(int(state.step), args=ocp.args.StandardSave(state))


def restore_latest(manager: ocp.CheckpointManager, like: TrainState, shardings: TrainState) -> TrainState | None:
    """The latest complete checkpoint shaped like `like` and placed with `shardings`, or None when there is none."""
    step = manager.latest_step()
    if step is None:
        return None
    target = jax.tree_util.tree_map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                                 sharding=sharding), like, shardings)
    return manager.restore(step, args=ocp.args.StandardRestore(target))
