"""Figures of a set of verified trajectories, shared by the trainer's per-step metrics and by evaluation.

Pure: trajectories (with their tool-call records) and whether each answer verified (SPEC 3) in, numbers out. The
tool-error ratio among correct trajectories is the paper's Figure 4 measure (SPEC 4: under plain GRPO it plateaus,
under GRPO-RoC it keeps falling): failed calls over all calls, counted in the trajectories whose answer is right.
Here, beside the penalties it reports on, so that `train` and `eval` both import it without one importing the other.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Sequence

import numpy as np

from rstar_jax.rl.penalties import format_penalty

if TYPE_CHECKING:  # only read through its attributes: rl imports no other package at run time
    from rstar_jax.agent.trajectory import Trajectory


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
