"""The chat and tool special tokens every tokenizer of the project must hold as single ids (SPEC section 2)."""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# Control tokens: never produced by text a program prints (split_special_tokens keeps them out of tool output).
CONTROL_TOKENS: tuple[str, ...] = (END_OF_TEXT, IM_START, IM_END)
# Tool markup tokens: added as plain (non-special) tokens, as Qwen does, so decoding always keeps them.
TOOL_TOKENS: tuple[str, ...] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
CHAT_TOOL_TOKENS: tuple[str, ...] = CONTROL_TOKENS + TOOL_TOKENS
