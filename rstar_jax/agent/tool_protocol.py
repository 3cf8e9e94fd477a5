"""The agent's view of the code-execution tool: what a result carries and how code is run (DESIGN.md protocols).

The sandbox client's `ToolResult` and its `run` coroutine satisfy these structurally, so agent code does not import
the sandbox package.
"""

from __future__ import annotations

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


class ToolExecutor(Protocol):
    """Runs a Python program with standard input and returns its outcome (the sandbox client is one)."""

    async def run(self, code: str, stdin: str = "", *, timeout_s: float | None = None) -> ToolOutcome: ...
