"""Turn what the supervisor observed about a finished call into one status (issue 3, point 1)."""

from __future__ import annotations

import dataclasses
import os
import signal

from sandbox_server.api import Status
from sandbox_server.snippet import MEMORY_ERROR_EXIT_CODE


@dataclasses.dataclass(frozen=True)
class Observation:
    """Raw facts about a call: how its main process ended and what the supervisor had to do."""

    wait_status: int | None  # from waitpid; None if it could not be collected
    wall_timed_out: bool
    output_truncated: bool
    oom_killed: bool
    cpu_seconds_used: float
    cpu_limit_s: int


def exit_code_of(wait_status: int | None) -> int | None:
    """The process's own exit code, or minus the number of the signal that killed it (as `subprocess` reports)."""
    if wait_status is None:
        return None
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def classify(observation: Observation) -> tuple[str, str]:
    """Return (status, note); the note, when not empty, is appended to stderr to say why the call ended."""
    if observation.output_truncated:
        return Status.OUTPUT_TRUNCATED, "output exceeded the cap; the call was stopped and its output cut"
    code = exit_code_of(observation.wait_status)
    if observation.oom_killed or code == MEMORY_ERROR_EXIT_CODE:
        return Status.MEMORY_EXCEEDED, "memory limit exceeded"
    if observation.wall_timed_out:
        return Status.TIMEOUT, "wall-clock time limit exceeded; the call was killed"
    if code == -signal.SIGXCPU or (
        code == -signal.SIGKILL and observation.cpu_seconds_used >= observation.cpu_limit_s
    ):
        return Status.TIMEOUT, "CPU time limit exceeded; the call was killed"
    if code is None or code < 0:
        name = "an unknown signal" if code is None else _signal_name(-code)
        return Status.KILLED, f"the process was killed by {name}"
    if code != 0:
        return Status.ERROR, ""
    return Status.OK, ""
