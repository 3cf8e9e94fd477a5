"""Accounting of a batch rollout: how many trajectories, tool calls and errors, how fast (issue 5 must-show).

Pure: takes the `RolloutSample`s of `AgentLoop.rollout` and the seconds it took.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from rstar_jax.rollout.agent_loop import RolloutSample


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Counts and rates of one rollout; `tool_statuses` counts each structured tool-call status (SPEC 4)."""

    trajectories: int
    with_tool_calls: int
    tool_calls: int
    tool_errors: int
    response_tokens: int
    finish_reasons: dict[str, int]
    tool_statuses: dict[str, int]
    seconds: float

    @property
    def trajectories_per_s(self) -> float:
        """Finished trajectories per second of wall time."""
        return self.trajectories / self.seconds

    @property
    def tool_calls_per_s(self) -> float:
        """Tool calls (sent or invalid) per second of wall time."""
        return self.tool_calls / self.seconds


def rollout_stats(samples: Sequence[RolloutSample], seconds: float) -> RolloutStats:
    """Summarise `samples`, a rollout that took `seconds` of wall time."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    trajectories = [sample.trajectory for sample in samples]
    calls = [call for trajectory in trajectories for call in trajectory.tool_calls]
    return RolloutStats(
        trajectories=len(trajectories),
        with_tool_calls=sum(bool(trajectory.tool_calls) for trajectory in trajectories),
        tool_calls=len(calls),
        tool_errors=sum(not call.ok for call in calls),
        response_tokens=sum(trajectory.response_length for trajectory in trajectories),
        finish_reasons=dict(collections.Counter(t.finish_reason.value for t in trajectories)),
        tool_statuses=dict(collections.Counter(call.status for call in calls)),
        seconds=seconds,
    )
