"""Scores of an evaluation (SPEC 7): per-problem verdict matrices, avg@k and pass@k, and the paired change of avg@k
between two evaluations of the same problems. The figures of a set of trajectories that training reports too
(`trajectory_metrics`) live in `rstar_jax.rl.metrics`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np


def verdict_matrix(correct: Sequence[bool], problems: int, samples: int) -> np.ndarray:
    """Verdicts (SPEC 3 rewards) of `problems` x `samples` trajectories (problem-major, as the agent loop returns
    them) as a [problems, samples] float matrix of 0/1."""
    matrix = np.asarray(correct, np.float64)
    if problems < 1 or samples < 1 or matrix.shape != (problems * samples,):
        raise ValueError(f"{matrix.size} verdicts do not form {problems} problems x {samples} samples")
    return matrix.reshape(problems, samples)


def avg_at_k(verdicts: np.ndarray) -> float:
    """avg@k pass@1 (SPEC 7): the mean over problems of the share of each problem's k samples that verify."""
    return float(np.mean(verdicts))


def pass_at_k(verdicts: np.ndarray) -> float:
    """pass@k: the share of problems with at least one of their k samples verified."""
    return float(np.mean(np.max(verdicts, axis=1)))


@dataclasses.dataclass(frozen=True)
class PairedChange:
    """The mean per-problem change of the solved share (a fraction: 0.125 is +12.5 points), its standard error and
    how many problems it pairs."""

    mean: float
    standard_error: float
    problems: int


def solved_shares(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each problem's solved share (verified samples / k) by id, from `EvalResult.problems` records; ValueError on
    a repeated id (the shares are matched by id)."""
    shares = {record["id"]: record["correct"] / record["samples"] for record in records}
    if len(shares) != len(records):
        raise ValueError(f"{len(records) - len(shares)} repeated problem ids among {len(records)} records")
    return shares


def paired_change(before: Mapping[str, float], after: Mapping[str, float]) -> PairedChange:
    """The change of avg@k (SPEC 7) between two evaluations of the same problems (solved shares by problem id): the
    mean of the per-problem differences after - before and its standard error (their sample sd, ddof 1, over
    sqrt(n); NaN for one problem).

    Paired because both evaluations solve the same problems: each problem's difficulty is in both shares and cancels
    in its difference, so the standard error measures only how the model changed, not which problems happened to be
    drawn (the unpaired error of the two accuracies would also count how unequally hard the problems are). ValueError
    when the two sides do not hold the same problem ids, or hold none.
    """
    if before.keys() != after.keys():
        only_before, only_after = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
        raise ValueError(f"a paired change needs the same problems on both sides; only before: {only_before[:5]} "
                         f"({len(only_before)}), only after: {only_after[:5]} ({len(only_after)})")
    if not before:
        raise ValueError("a paired change needs at least one problem")
    differences = np.array([after[problem] - before[problem] for problem in before], np.float64)
    n = len(differences)
    error = float(np.std(differences, ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return PairedChange(float(np.mean(differences)), error, n)
