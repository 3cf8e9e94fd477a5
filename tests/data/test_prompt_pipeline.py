"""grain prompt pipelines: seeded shuffle, epochs, filters, batches, and resuming from an orbax checkpoint
(issue 4, item 3)."""

from __future__ import annotations

import itertools
import pathlib

import numpy as np
import orbax.checkpoint as ocp
import pytest

from rstar_jax.data.difficulty import SolveStats, hard_problem_ids, keep_only
from rstar_jax.data.pipeline import (
    iterator_restore_args,
    iterator_save_args,
    prompt_batches,
    restore_iterator,
    save_iterator,
)
from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import load_problems


def _problems(count: int) -> list[Problem]:
    return [Problem(id=f"toy/{i}", question=f"What is {i}+1?", answer=str(i + 1), source="toy") for i in range(count)]


def _ids(batches: list[list[Problem]]) -> list[list[str]]:
    return [[p.id for p in batch] for batch in batches]


def test_batches_are_lists_of_problems_covering_each_epoch_once() -> None:
    problems = _problems(10)
    batches = list(prompt_batches(problems, batch_size=4, seed=3, num_epochs=2))
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4]
    assert all(isinstance(p, Problem) for batch in batches for p in batch)
    flat = [p.id for batch in batches for p in batch]
    assert sorted(flat[:10]) == sorted(flat[10:]) == sorted(p.id for p in problems)
    assert flat[:10] != flat[10:]  # reshuffled each epoch
    assert flat[:10] != [p.id for p in problems]  # shuffled at all


def test_same_seed_same_order_other_seed_other_order() -> None:
    problems = _problems(32)
    first = _ids(list(prompt_batches(problems, batch_size=8, seed=7)))
    assert first == _ids(list(prompt_batches(problems, batch_size=8, seed=7)))
    assert first != _ids(list(prompt_batches(problems, batch_size=8, seed=8)))


def test_drop_remainder_and_endless_epochs() -> None:
    problems = _problems(10)
    assert [len(b) for b in prompt_batches(problems, batch_size=4, num_epochs=1, drop_remainder=True)] == [4, 4]
    endless = iter(prompt_batches(problems, batch_size=5, num_epochs=None))
    epochs = [sorted(p.id for batch in itertools.islice(endless, 2) for p in batch) for _ in range(6)]
    assert all(epoch == sorted(p.id for p in problems) for epoch in epochs)


def test_filters_apply_before_batching() -> None:
    problems = _problems(20)
    batches = list(prompt_batches(problems, batch_size=3, seed=1, keep=[lambda p: int(p.answer) % 2 == 0]))
    kept = sorted(p.id for batch in batches for p in batch)
    assert kept == sorted(p.id for p in problems if int(p.answer) % 2 == 0)
    assert [len(b) for b in batches] == [3, 3, 3, 1]


def test_difficulty_filter_as_a_grain_filter() -> None:
    problems = _problems(6)
    stats = {p.id: SolveStats(solved=8 if i % 3 == 0 else i, attempts=8) for i, p in enumerate(problems)}
    batches = list(prompt_batches(problems, batch_size=2, seed=0, keep=[keep_only(hard_problem_ids(stats))]))
    assert sorted(p.id for batch in batches for p in batch) == ["toy/1", "toy/2", "toy/4", "toy/5"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be at least 1"),
        ({"num_epochs": 0}, "num_epochs must be at least 1 or None"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prompt_batches(_problems(3), **kwargs)
    with pytest.raises(ValueError, match="got no problems"):
        prompt_batches([])


def test_resumed_pipeline_sees_the_same_next_prompts(tmp_path: pathlib.Path) -> None:
    """Take k batches, checkpoint the iterator with orbax, restore into a fresh pipeline: the next batches equal
    those of an uninterrupted run, across an epoch boundary and through a filter."""
    problems = list(load_problems("aime24").problems)
    options = dict(batch_size=4, seed=11, num_epochs=3, keep=[lambda p: p.answer != "204"])
    uninterrupted = _ids(list(prompt_batches(problems, **options)))
    taken = 9  # past the first epoch's 29 kept problems
    assert len(uninterrupted) > taken + 5

    iterator = iter(prompt_batches(problems, **options))
    assert _ids([next(iterator) for _ in range(taken)]) == uninterrupted[:taken]
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        save_iterator(manager, step=taken, iterator=iterator)
    next(iterator)  # the interrupted run moves on; the checkpoint must not

    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.latest_step() == taken
        resumed = iter(prompt_batches(problems, **options))
        restore_iterator(manager, step=taken, iterator=resumed)
    assert _ids(list(resumed)) == uninterrupted[taken:]


def test_iterator_state_saves_beside_other_items_of_a_step(tmp_path: pathlib.Path) -> None:
    """The trainer checkpoints its state and the data position in one orbax step."""
    problems = _problems(40)
    uninterrupted = _ids(list(prompt_batches(problems, batch_size=6, seed=5)))
    iterator = iter(prompt_batches(problems, batch_size=6, seed=5))
    next(iterator), next(iterator)
    state = {"step": np.asarray(2), "weights": np.arange(4.0)}
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state), **iterator_save_args(iterator)))
        manager.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        resumed = iter(prompt_batches(problems, batch_size=6, seed=5))
        restored = manager.restore(
            2, args=ocp.args.Composite(state=ocp.args.StandardRestore(state), **iterator_restore_args(resumed))
        )
    np.testing.assert_array_equal(restored["state"]["weights"], state["weights"])
    assert _ids(list(resumed)) == uninterrupted[2:]
