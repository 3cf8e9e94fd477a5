"""The agent's prompt: system prompt, the Python tool's schema and the user prefix (SPEC section 2).

The prompt is rendered by the tokenizer's own chat template exactly once per problem, straight to token ids;
every later piece of a trajectory is appended to those ids (DESIGN.md, "Token ids end to end").
"""

from __future__ import annotations

import copy
from typing import Any

import gin
from transformers import PreTrainedTokenizerBase

TOOL_NAME = "execute_python_code_with_standard_io"

SYSTEM_PROMPT = (
    "You are a careful problem solver. Think the problem through step by step inside <reason> </reason> tags. "
    "Whenever exact computation helps, write a Python program and run it with the tool; its output comes back "
    "to you, and you may run the tool again as often as you need. When you are sure, write the final result "
    "inside <answer> </answer> tags as \\boxed{...}."
)

USER_PREFIX = "Solve the problem below. Use the Python tool for any computation you cannot do exactly in your head.\n\n"

TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Run a Python 3 program and return what it wrote to standard output and standard error. "
            "The value of a bare final expression is printed as well."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python program to run."},
                "input": {"type": "string", "description": "Text given to the program on standard input."},
            },
            "required": ["code", "input"],
        },
    },
}


@gin.configurable
def tool_schema(description: str | None = None, code_description: str | None = None,
                input_description: str | None = None) -> dict[str, Any]:
    """The tool's JSON schema for the system turn (SPEC 2): `TOOL_SCHEMA` with any description replaced.

    Gin knobs so a small model can be given shorter wording (every word of the system turn is prefilled and trained
    on in every trajectory); the name, parameters and required fields never change.
    """
    schema = copy.deepcopy(TOOL_SCHEMA)
    function = schema["function"]
    if description is not None:
        function["description"] = description
    for name, text in (("code", code_description), ("input", input_description)):
        if text is not None:
            function["parameters"]["properties"][name]["description"] = text
    return schema


@gin.configurable
def prompt_messages(
    question: str,
    system_prompt: str = SYSTEM_PROMPT,
    user_prefix: str = USER_PREFIX,
) -> list[dict[str, str]]:
    """The chat messages (system, then user) that open every trajectory for `question` (SPEC section 2).

    The system prompt and user prefix are gin knobs so ablations can change the wording without code changes.
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"prompt_messages needs a non-empty question string, got {question!r}")
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": user_prefix + question},
    ]


def prompt_text(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """The rendered prompt text (system turn with the tool schema, user turn, open assistant turn)."""
    return tokenizer.apply_chat_template(
        prompt_messages(question), tools=[tool_schema()], add_generation_prompt=True, tokenize=False
    )


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """Token ids of the prompt for `question`, rendered once by the chat template (SPEC section 2).

    The ids end with the opened assistant turn, so the engine's first sampled token starts the answer.
    """
    encoded = tokenizer.apply_chat_template(
        prompt_messages(question),
        tools=[tool_schema()],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return list(encoded["input_ids"])
