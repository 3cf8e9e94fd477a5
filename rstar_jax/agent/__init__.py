"""The agent format of SPEC section 2: prompt, tool-call parsing, tool responses and trajectory building."""

from rstar_jax.agent.prompt import (TOOL_NAME, TOOL_SCHEMA, prompt_messages, prompt_text, prompt_token_ids,
                                    tool_schema)
from rstar_jax.agent.tool_call import FailedToolCall, ToolCall, has_tool_call, parse_tool_calls, tool_call_text
from rstar_jax.agent.tool_protocol import ToolExecutor, ToolOutcome
from rstar_jax.agent.tool_response import format_tool_response, truncate_middle
from rstar_jax.agent.trajectory import (
    FinishReason,
    ToolCallRecord,
    Trajectory,
    TrajectoryBuilder,
    count_answer_tags,
    sampled_turn_texts,
)

__all__ = [
    "TOOL_NAME",
    "TOOL_SCHEMA",
    "FailedToolCall",
    "FinishReason",
    "ToolCall",
    "ToolCallRecord",
    "ToolExecutor",
    "ToolOutcome",
    "Trajectory",
    "TrajectoryBuilder",
    "count_answer_tags",
    "format_tool_response",
    "has_tool_call",
    "parse_tool_calls",
    "prompt_messages",
    "prompt_text",
    "prompt_token_ids",
    "sampled_turn_texts",
    "tool_call_text",
    "tool_schema",
    "truncate_middle",
]
