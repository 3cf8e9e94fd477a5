"""Scores of an evaluation (SPEC 7): per-problem verdict matrices, avg@k and pass@k. The figures of a set of
trajectories that training reports too (`trajectory_metrics`) live in `rstar_jax.rl.metrics`.
"""

from __future__ import annotations

from typing import Sequence

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
