"""Parsing the model's tool calls out of an assistant turn (SPEC section 2).

A call is `<tool_call>{"name": ..., "arguments": {"code": ..., "input": ...}}</tool_call>`. Anything that does not
parse into a runnable program becomes a `FailedToolCall` whose message is sent back to the model as the tool
response, and which counts as a tool error for GRPO-RoC's p_err (SPEC section 4).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rstar_jax.agent.prompt import TOOL_NAME
from rstar_jax.tokenizers.special_tokens import TOOL_CALL_CLOSE as CALL_CLOSE
from rstar_jax.tokenizers.special_tokens import TOOL_CALL_OPEN as CALL_OPEN

_CALL_PATTERN = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of the Python tool: the program and its standard input."""

    code: str
    stdin: str = ""


@dataclass(frozen=True)
class FailedToolCall:
    """A call that could not be run; `message` is what the model reads as the tool response."""

    message: str

    status = "invalid_call"
    ok = False


def has_tool_call(turn_text: str) -> bool:
    """Whether the turn opens a tool call; a turn without one ends the trajectory (SPEC section 2)."""
    return CALL_OPEN in turn_text


def parse_tool_calls(turn_text: str) -> list[ToolCall | FailedToolCall]:
    """Every tool call of an assistant turn, in order, each parsed or turned into a failed call.

    An opening tag without its closing tag is a failed call too (the model stopped inside it).
    """
    return [
        _parse_call_body(match.group(1)) if match.group(2) else _failed("the <tool_call> tag is never closed")
        for match in _CALL_PATTERN.finditer(turn_text)
    ]


def _failed(reason: str) -> FailedToolCall:
    return FailedToolCall(f"Tool call failed: {reason}. Nothing was run.")


def _parse_call_body(body: str) -> ToolCall | FailedToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return _failed(f"could not decode the JSON inside <tool_call> ({error})")
    if not isinstance(call, dict):
        return _failed(f"expected a JSON object with \"name\" and \"arguments\", got a {type(call).__name__}")
    name = call.get("name")
    if name != TOOL_NAME:
        return _failed(f"unknown tool name {name!r}; the only tool is {TOOL_NAME!r}")
    return _parse_arguments(call.get("arguments"))


def _parse_arguments(arguments: Any) -> ToolCall | FailedToolCall:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            return _failed(f"could not decode the \"arguments\" string as JSON ({error})")
    if not isinstance(arguments, dict):
        return _failed("\"arguments\" must be a JSON object with \"code\" and \"input\"")
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return _failed("\"arguments\" has no \"code\" string to run")
    stdin = arguments.get("input", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return _failed(f"\"input\" must be a string, got a {type(stdin).__name__}")
    return ToolCall(code=code, stdin=stdin)


def tool_call_text(call: ToolCall) -> str:
    """The text of a well-formed call as the model should write it (used to write SFT transcripts)."""
    payload = {"name": TOOL_NAME, "arguments": {"code": call.code, "input": call.stdin}}
    return f"{CALL_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{CALL_CLOSE}"
