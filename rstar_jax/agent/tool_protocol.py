"""The agent's view of the code-execution tool: what a result carries and how code is run (DESIGN.md protocols).

The sandbox client's `ToolResult` and its `run` coroutine satisfy these structurally, so agent code does not import
the sandbox package.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class ToolOutcome(Protocol):
    """A finished tool call: structured status (ok, error, timeout, ...), streams, exit code and run time."""

    @property
    def status(self) -> str: ...

    @property
    def stdout(self) -> str: ...

    @property
    def stderr(self) -> str: ...

    @property
    def exit_code(self) -> int | None: ...

    @property
    def duration_ms(self) -> float: ...

    @property
    def ok(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class FixedOutcome:
    """A `ToolOutcome` made without running the tool: an executor's failure the model reads instead of a crash (the
    agent loop), or a call whose output is known in advance (SFT transcripts, copy drills). `ok` as the sandbox's:
    status "ok"."""

    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the call ran to completion (status "ok")."""
        return self.status == "ok"


class ToolExecutor(Protocol):
    """Runs a Python program with standard input and returns its outcome (the sandbox client is one)."""

    async def run(self, code: str, stdin: str = "", *, timeout_s: float | None = None) -> ToolOutcome: ...
