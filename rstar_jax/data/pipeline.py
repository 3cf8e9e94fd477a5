"""grain pipelines of prompt batches whose position is saved in orbax checkpoints (issue 4, item 3).

A pipeline is a `grain.MapDataset` of `Problem`s: seeded shuffle, repeat for epochs (reshuffled each epoch), optional
filters (e.g. the stage-3 difficulty filter), then batches as lists of `Problem`. Records are tiny and the transforms
are cheap Python predicates, so everything runs in the trainer process: worker processes would only add start-up
and pickling costs (and need absl flags marked parsed) for no throughput gain.

Its iterator's state (`get_state()`/`set_state()`, a dict holding the next index) is saved with grain's orbax
handler, so a resumed run sees exactly the prompts an uninterrupted run would have seen next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gin
import grain
import orbax.checkpoint as ocp

from rstar_jax.data.problem import Problem

DATA_ITEM = "data"  # the name of the iterator state inside an orbax Composite checkpoint


@gin.configurable(denylist=["problems", "keep"])
def prompt_batches(
    problems: Sequence[Problem],
    batch_size: int = 8,
    seed: int = 0,
    num_epochs: int | None = 1,
    keep: Sequence[Callable[[Problem], bool]] = (),
    drop_remainder: bool = False,
) -> grain.IterDataset:
    """Batches (lists of `Problem`) in a seeded order over `num_epochs` epochs (None: forever).

    Each predicate in `keep` must accept a problem for it to be used. Iterate with `iter(...)`; the iterator's state
    goes into checkpoints via `save_iterator`.
    """
    if batch_size < 1:
        raise ValueError(f"prompt_batches batch_size must be at least 1, got {batch_size}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"prompt_batches num_epochs must be at least 1 or None (forever), got {num_epochs}")
    if not problems:
        raise ValueError("prompt_batches got no problems")
    dataset = grain.MapDataset.source(list(problems)).shuffle(seed=seed).repeat(num_epochs)
    for predicate in keep:
        dataset = dataset.filter(predicate)
    return dataset.to_iter_dataset().batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)


def iterator_save_args(iterator: grain.DatasetIterator) -> dict[str, ocp.args.CheckpointArgs]:
    """The iterator's entry of an orbax `Composite` save, to merge with the trainer's other items of the step."""
    return {DATA_ITEM: grain.checkpoint.CheckpointSave(iterator)}


def iterator_restore_args(iterator: grain.DatasetIterator) -> dict[str, ocp.args.CheckpointArgs]:
    """The iterator's entry of an orbax `Composite` restore: moves `iterator` to the saved position."""
    return {DATA_ITEM: grain.checkpoint.CheckpointRestore(iterator)}


def save_iterator(manager: ocp.CheckpointManager, step: int, iterator: grain.DatasetIterator) -> None:
    """Saves only the iterator's position as checkpoint `step` (waits until it is written)."""
    manager.save(step, args=ocp.args.Composite(**iterator_save_args(iterator)))
    manager.wait_until_finished()


def restore_iterator(manager: ocp.CheckpointManager, step: int, iterator: grain.DatasetIterator) -> None:
    """Moves a fresh iterator of the same pipeline to the position saved at `step`."""
    manager.restore(step, args=ocp.args.Composite(**iterator_restore_args(iterator)))
