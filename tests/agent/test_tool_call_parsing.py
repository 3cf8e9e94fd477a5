"""Tool-call parsing: well-formed calls run; anything else is a failed call with a message for the model."""

from __future__ import annotations

import json

import pytest

from rstar_jax.agent import TOOL_NAME, FailedToolCall, ToolCall, has_tool_call, parse_tool_calls, tool_call_text


def _call(payload: object) -> str:
    return f"<tool_call>\n{json.dumps(payload)}\n</tool_call>"


def test_well_formed_call_gives_code_and_stdin() -> None:
    text = "Let me compute.\n" + _call({"name": TOOL_NAME, "arguments": {"code": "print(input())", "input": "7\n"}})
    assert parse_tool_calls(text) == [ToolCall(code="print(input())", stdin="7\n")]
    assert has_tool_call(text)


def test_missing_input_defaults_to_empty_and_string_arguments_are_decoded() -> None:
    text = _call({"name": TOOL_NAME, "arguments": {"code": "print(1)"}}) + _call(
        {"name": TOOL_NAME, "arguments": json.dumps({"code": "print(2)", "input": "x"})}
    )
    assert parse_tool_calls(text) == [ToolCall("print(1)", ""), ToolCall("print(2)", "x")]


def test_round_trip_of_written_calls() -> None:
    call = ToolCall(code='s = "a\\nb"\nprint(len(s))  # ünïcode', stdin="line\n")
    assert parse_tool_calls(tool_call_text(call)) == [call]


def test_no_call_in_a_final_answer() -> None:
    assert parse_tool_calls("<answer>\\boxed{3}</answer>") == []
    assert not has_tool_call("<answer>\\boxed{3}</answer>")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(1)"', "could not decode"),
        ("[1, 2]", "expected a JSON object"),
        ('{"name": "web_search", "arguments": {"code": "1"}}', "unknown tool name 'web_search'"),
        ('{"arguments": {"code": "1"}}', "unknown tool name None"),
        ('{"name": "execute_python_code_with_standard_io", "arguments": {"input": ""}}', 'no "code"'),
        ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": "   "}}', 'no "code"'),
        ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": 5}}', 'no "code"'),
        ('{"name": "execute_python_code_with_standard_io", "arguments": ["print(1)"]}', '"arguments" must be'),
        ('{"name": "execute_python_code_with_standard_io", "arguments": "{oops"}', '"arguments" string'),
        ('{"name": "execute_python_code_with_standard_io", "arguments": {"code": "1", "input": 3}}', '"input" must'),
    ],
)
def test_malformed_calls_fail_with_a_clear_message(body: str, fragment: str) -> None:
    [failed] = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")
    assert isinstance(failed, FailedToolCall)
    assert fragment in failed.message
    assert failed.message.startswith("Tool call failed: ") and failed.message.endswith("Nothing was run.")
    assert failed.status == "invalid_call" and failed.ok is False


def test_unclosed_call_fails_and_earlier_calls_still_parse() -> None:
    good = _call({"name": TOOL_NAME, "arguments": {"code": "print(1)", "input": ""}})
    calls = parse_tool_calls(good + '\n<tool_call>\n{"name": "execute_python_code_with_standard_io", "argu')
    assert calls[0] == ToolCall("print(1)", "")
    assert isinstance(calls[1], FailedToolCall) and "never closed" in calls[1].message
