"""The stage-3 difficulty filter (SPEC 5: the hard set drops problems the current model solves 8 of 8).

Pure functions: rollout rewards -> per-problem solve statistics -> the ids kept -> a predicate for a grain filter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from rstar_jax.data.problem import Problem


@dataclasses.dataclass(frozen=True)
class SolveStats:
    """How many of a problem's sampled attempts were correct."""

    solved: int
    attempts: int

    def __post_init__(self) -> None:
        if not 0 <= self.solved <= self.attempts:
            raise ValueError(
                f"SolveStats needs 0 <= solved <= attempts, got solved={self.solved}, attempts={self.attempts}"
            )


def solve_stats(problem_ids: Iterable[str], rewards: Iterable[float]) -> dict[str, SolveStats]:
    """Tallies rollouts (one problem id and one binary reward each, SPEC 3) into per-problem statistics."""
    solved: dict[str, int] = {}
    attempts: dict[str, int] = {}
    ids, values = list(problem_ids), list(rewards)
    if len(ids) != len(values):
        raise ValueError(f"solve_stats got {len(ids)} problem ids but {len(values)} rewards")
    for problem_id, reward in zip(ids, values):
        if reward not in (0, 1):
            raise ValueError(
                f"solve_stats: reward {reward!r} for {problem_id!r} is not binary (SPEC 3 rewards are 0/1)"
            )
        attempts[problem_id] = attempts.get(problem_id, 0) + 1
        solved[problem_id] = solved.get(problem_id, 0) + int(reward)
    return {problem_id: SolveStats(solved[problem_id], attempts[problem_id]) for problem_id in attempts}


def hard_problem_ids(stats: Mapping[str, SolveStats]) -> frozenset[str]:
    """The ids SPEC 5 stage 3 keeps: every problem with statistics except those solved in all their attempts.

    A problem with no attempts has shown nothing and is kept.
    """
    return frozenset(
        problem_id for problem_id, s in stats.items() if s.attempts == 0 or s.solved < s.attempts
    )


def keep_only(problem_ids: frozenset[str]) -> Callable[[Problem], bool]:
    """A grain filter predicate keeping the problems whose id is in `problem_ids` (e.g. `hard_problem_ids(...)`)."""
    return lambda problem: problem.id in problem_ids
