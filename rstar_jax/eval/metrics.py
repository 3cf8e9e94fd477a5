"""Figures of a set of verified trajectories, shared by the trainer's per-step metrics and by evaluation.

Pure: trajectories (with their tool-call records) and whether each answer verified (SPEC 3) in, numbers out. The
tool-error ratio among correct trajectories is the paper's Figure 4 measure (SPEC 4: under plain GRPO it plateaus,
under GRPO-RoC it keeps falling): failed calls over all calls, counted in the trajectories whose answer is right.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from rstar_jax.agent.trajectory import Trajectory
from rstar_jax.rl.penalties import format_penalty


def _error_ratio(trajectories: Sequence[Trajectory]) -> float:
    calls = sum(len(t.tool_calls) for t in trajectories)
    return sum(t.tool_errors for t in trajectories) / calls if calls else 0.0


def trajectory_metrics(trajectories: Sequence[Trajectory], correct: Sequence[bool]) -> dict[str, float | dict]:
    """accuracy; mean response length (tokens after the prompt), turns and tool calls per trajectory; tool-error
    ratio (failed / all calls) among correct trajectories and among all; the share of correct trajectories with any
    failed call; mean p_format (SPEC 4.4); how many trajectories stopped for each reason (SPEC 2)."""
    if len(trajectories) != len(correct):
        raise ValueError(f"{len(trajectories)} trajectories but {len(correct)} verdicts")
    if not trajectories:
        raise ValueError("trajectory_metrics needs at least one trajectory")
    right = [t for t, ok in zip(trajectories, correct) if ok]
    return {
        "accuracy": float(np.mean(correct)),
        "response_length": float(np.mean([t.response_length for t in trajectories])),
        "turns": float(np.mean([t.turns for t in trajectories])),
        "tool_calls": float(np.mean([len(t.tool_calls) for t in trajectories])),
        "tool_error_ratio_correct": _error_ratio(right),
        "tool_error_ratio_all": _error_ratio(trajectories),
        "correct_with_tool_error": (sum(t.tool_errors > 0 for t in right) / len(right)) if right else 0.0,
        "p_format": float(np.mean(format_penalty([t.answer_tags for t in trajectories],
                                                 [t.turns for t in trajectories]))),
        "finish_reasons": dict(collections.Counter(t.finish_reason.value for t in trajectories)),
    }


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
