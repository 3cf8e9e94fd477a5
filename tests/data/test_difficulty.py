"""The stage-3 difficulty filter (SPEC 5): drop problems the current policy solves in every attempt."""

from __future__ import annotations

import pytest

from rstar_jax.data.difficulty import SolveStats, hard_problem_ids, keep_only, solve_stats
from rstar_jax.data.problem import Problem


def test_solve_stats_tally_rollouts_per_problem() -> None:
    ids = ["a", "b", "a", "c", "a", "b"]
    rewards = [1, 0, 1, 1, 0, 0]
    assert solve_stats(ids, rewards) == {
        "a": SolveStats(solved=2, attempts=3),
        "b": SolveStats(solved=0, attempts=2),
        "c": SolveStats(solved=1, attempts=1),
    }


def test_problems_solved_n_of_n_are_dropped() -> None:
    stats = {
        "always": SolveStats(8, 8),
        "almost": SolveStats(7, 8),
        "never": SolveStats(0, 8),
        "once_of_once": SolveStats(1, 1),
        "untried": SolveStats(0, 0),
    }
    assert hard_problem_ids(stats) == frozenset({"almost", "never", "untried"})


def test_paper_stage3_proportion_on_a_hand_computed_pool() -> None:
    # 42 problems: solve counts 0..8 repeating; 8/8 occurs for indices 8, 17, 26, 35 -> 4 dropped
    stats = {f"p{i}": SolveStats(i % 9, 8) for i in range(42)}
    kept = hard_problem_ids(stats)
    assert len(kept) == 38
    assert {"p8", "p17", "p26", "p35"}.isdisjoint(kept)


def test_keep_only_is_a_problem_predicate() -> None:
    keep = keep_only(frozenset({"x/1"}))
    assert keep(Problem("x/1", "q", "1", "x"))
    assert not keep(Problem("x/2", "q", "2", "x"))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: SolveStats(3, 2), "0 <= solved <= attempts"),
        (lambda: SolveStats(-1, 2), "0 <= solved <= attempts"),
        (lambda: solve_stats(["a"], [1, 0]), "1 problem ids but 2 rewards"),
        (lambda: solve_stats(["a"], [0.5]), "is not binary"),
    ],
)
def test_bad_statistics_are_clear_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
