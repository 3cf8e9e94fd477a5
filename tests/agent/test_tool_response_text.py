"""Tool responses: status line, streams, middle truncation at the gin-set limits (SPEC section 2)."""

from __future__ import annotations


import gin
import pytest

from rstar_jax.agent import FailedToolCall, format_tool_response, truncate_middle
from sandbox_server.api import ToolResult



def test_truncate_middle_keeps_head_and_tail_within_the_limit() -> None:
    text = "".join(str(i % 10) for i in range(1000))
    cut = truncate_middle(text, 100)
    assert len(cut) <= 100
    head, marker_and_tail = cut.split("\n...[", 1)
    count, tail = marker_and_tail.split(" characters cut]...\n")
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) + int(count) + len(tail) == len(text)
    assert abs(len(head) - len(tail)) <= 1


def test_truncate_middle_leaves_short_text_alone_and_rejects_tiny_limits() -> None:
    assert truncate_middle("abc", 3) == "abc"
    with pytest.raises(ValueError, match="max_chars"):
        truncate_middle("x" * 100, 10)
    with pytest.raises(ValueError, match="positive"):
        truncate_middle("x", 0)


def test_success_shows_status_exit_code_time_and_stdout() -> None:
    text = format_tool_response(ToolResult("ok", "4374493942\n", "", 0, 31.4))
    assert text == "succeeded, exit code 0, 31 ms\nstdout:\n4374493942"


def test_failure_shows_status_and_stderr() -> None:
    stderr = "Traceback (most recent call last):\nNameError: name 'x' is not defined\n"
    text = format_tool_response(ToolResult("error", "", stderr, 1, 12.0))
    assert text == "failed (error), exit code 1, 12 ms\nstderr:\n" + stderr.rstrip("\n")


def test_timeout_without_output_says_so() -> None:
    assert format_tool_response(ToolResult("timeout", "", "", None, 10000.0)) == "failed (timeout), 10000 ms\n(no output)"


def test_failed_call_answers_with_its_message() -> None:
    message = "Tool call failed: could not decode the JSON. Nothing was run."
    assert format_tool_response(FailedToolCall(message)) == message


def test_limits_are_gin_knobs_and_cut_the_middle() -> None:
    outcome = ToolResult("ok", "A" * 3000 + "END", "", 0, 5.0)
    assert len(format_tool_response(outcome)) <= 256
    assert format_tool_response(outcome).endswith("END")
    with gin.unlock_config():
        gin.parse_config(["format_tool_response.max_chars = 5000", "format_tool_response.show_duration = False"])
    try:
        text = format_tool_response(outcome)
        assert text.startswith("succeeded, exit code 0\nstdout:\nAAAA")
        assert len(text) <= len("succeeded, exit code 0\nstdout:\n") + 1000 and text.endswith("END")
    finally:
        gin.clear_config()
