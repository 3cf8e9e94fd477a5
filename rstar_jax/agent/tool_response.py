"""The text the model reads back after a tool call (SPEC section 2).

Success or failure first, then stdout and stderr (each cut in the middle to a limit), then the whole response cut
in the middle to an overall limit, so a runaway program cannot flood the context. Both limits are gin knobs; the
defaults are the public release's (1000 characters per stream, 256 for the response).
"""

from __future__ import annotations

import gin

from rstar_jax.agent.tool_call import FailedToolCall
from rstar_jax.agent.tool_protocol import ToolOutcome


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` if it fits in `max_chars`, else its head and tail around a marker saying how much was cut."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    if len(text) <= max_chars:
        return text
    marker_width = len(f"\n...[{len(text)} characters cut]...\n")
    keep = max_chars - marker_width
    if keep < 2:
        raise ValueError(f"max_chars={max_chars} leaves no room for text around the truncation marker")
    head = (keep + 1) // 2
    tail = keep - head
    marker = f"\n...[{len(text) - keep} characters cut]...\n"
    return text[:head] + marker + (text[-tail:] if tail else "")


@gin.configurable
def format_tool_response(
    outcome: ToolOutcome | FailedToolCall,
    max_chars: int = 256,
    max_stream_chars: int = 1000,
    show_duration: bool = True,
) -> str:
    """The tool response text for one call: a status line, stdout, stderr, all cut to the gin-set limits.

    A failed (unparseable) call answers with its own message, so the model learns what was wrong with it.
    """
    if isinstance(outcome, FailedToolCall):
        return truncate_middle(outcome.message, max_chars)
    header = "succeeded" if outcome.ok else f"failed ({outcome.status})"
    if outcome.exit_code is not None:
        header += f", exit code {outcome.exit_code}"
    if show_duration:
        header += f", {outcome.duration_ms:.0f} ms"
    sections = [header]
    for name, stream in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
        stream = stream.rstrip("\n")
        if stream:
            sections.append(f"{name}:\n{truncate_middle(stream, max_stream_chars)}")
    if len(sections) == 1:
        sections.append("(no output)")
    return truncate_middle("\n".join(sections), max_chars)
