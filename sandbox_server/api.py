"""The sandbox's wire schema and the `ToolExecutor` protocol the agent loop programs against.

Implements the tool semantics of SPEC section 2 (`execute_python_code_with_standard_io(code, input)`) as a
structured result: the agent loop counts failures from `ToolResult.status` (SPEC section 4, "count failures from
the sandbox's structured status instead" of grepping for "error").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Status:
    """Every status a call can end with. The server answers with the first seven; the client adds UNAVAILABLE."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY_EXCEEDED = "memory_exceeded"
    OUTPUT_TRUNCATED = "output_truncated"
    KILLED = "killed"
    REJECTED = "rejected"
    UNAVAILABLE = "unavailable"

    SERVER = (OK, ERROR, TIMEOUT, MEMORY_EXCEEDED, OUTPUT_TRUNCATED, KILLED, REJECTED)
    ALL = SERVER + (UNAVAILABLE,)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """Outcome of one code execution; what the agent loop turns into a tool response (SPEC section 2)."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    duration_ms: float

    @property
    def ok(self) -> bool:
        """True only when the code ran to completion with exit code 0 and untruncated output."""
        return self.status == Status.OK

    def to_json(self) -> dict[str, Any]:
        """The `/run` response body."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ToolResult:
        """Parse a `/run` response body; a malformed one raises ValueError naming the problem."""
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in body]
        if missing:
            raise ValueError(f"sandbox response lacks field(s) {missing}: {dict(body)!r:.200}")
        if body["status"] not in Status.ALL:
            raise ValueError(f"sandbox response has unknown status {body['status']!r}")
        return cls(
            status=str(body["status"]),
            stdout=str(body["stdout"]),
            stderr=str(body["stderr"]),
            exit_code=None if body["exit_code"] is None else int(body["exit_code"]),
            duration_ms=float(body["duration_ms"]),
        )

    @classmethod
    def failure(cls, status: str, reason: str) -> ToolResult:
        """A result for a call that never ran (rejected, unavailable, worker lost), with the reason in stderr."""
        return cls(status=status, stdout="", stderr=reason, exit_code=None, duration_ms=0.0)


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """A validated `/run` request body: `{code, stdin?, timeout_s?, memory_mb?}`."""

    code: str
    stdin: str = ""
    timeout_s: float | None = None
    memory_mb: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The body sent over HTTP; unset optional fields are left out so server defaults apply."""
        body: dict[str, Any] = {"code": self.code, "stdin": self.stdin}
        if self.timeout_s is not None:
            body["timeout_s"] = self.timeout_s
        if self.memory_mb is not None:
            body["memory_mb"] = self.memory_mb
        return body


class RequestError(ValueError):
    """A request the server refuses; the message says which field is wrong and why."""


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Bounds a request must respect; the server builds these from its configuration."""

    max_code_bytes: int
    max_stdin_bytes: int
    max_timeout_s: float
    min_memory_mb: int
    max_memory_mb: int


_FIELDS = ("code", "stdin", "timeout_s", "memory_mb")


def parse_run_request(body: Any, limits: RequestLimits) -> RunRequest:
    """Validate one decoded `/run` body against `limits`; raise RequestError naming the offending field."""
    if not isinstance(body, Mapping):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; allowed: {list(_FIELDS)}")
    code = body.get("code")
    if not isinstance(code, str):
        raise RequestError(f"'code' must be a string, got {type(code).__name__}")
    if len(code.encode("utf-8", "surrogatepass")) > limits.max_code_bytes:
        raise RequestError(f"'code' is longer than the limit of {limits.max_code_bytes} bytes")
    stdin = body.get("stdin", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        raise RequestError(f"'stdin' must be a string, got {type(stdin).__name__}")
    if len(stdin.encode("utf-8", "surrogatepass")) > limits.max_stdin_bytes:
        raise RequestError(f"'stdin' is longer than the limit of {limits.max_stdin_bytes} bytes")
    timeout_s = body.get("timeout_s")
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s):
            raise RequestError(f"'timeout_s' must be a finite number, got {timeout_s!r}")
        if not 0 < timeout_s <= limits.max_timeout_s:
            raise RequestError(f"'timeout_s' must be in (0, {limits.max_timeout_s}], got {timeout_s}")
        timeout_s = float(timeout_s)
    memory_mb = body.get("memory_mb")
    if memory_mb is not None:
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int):
            raise RequestError(f"'memory_mb' must be an integer, got {memory_mb!r}")
        if not limits.min_memory_mb <= memory_mb <= limits.max_memory_mb:
            raise RequestError(
                f"'memory_mb' must be in [{limits.min_memory_mb}, {limits.max_memory_mb}], got {memory_mb}"
            )
    return RunRequest(code=code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)


def parse_batch_body(body: Any) -> list[Any]:
    """Extract the list of request bodies from a `/run_batch` body `{requests: [...]}`."""
    if not isinstance(body, Mapping) or set(body) != {"requests"}:
        raise RequestError("batch body must be a JSON object with exactly one field, 'requests'")
    requests = body["requests"]
    if not isinstance(requests, list):
        raise RequestError(f"'requests' must be a list, got {type(requests).__name__}")
    return requests


class ToolExecutor(Protocol):
    """What the agent loop needs from a code tool (DESIGN.md, "one protocol per boundary")."""

    async def run(self, code: str, stdin: str = "", *, timeout_s: float | None = None) -> ToolResult:
        """Execute one snippet; never raises for tool-side failures, which come back as a status."""
        ...

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[ToolResult]:
        """Execute many snippets; results in request order."""
        ...
