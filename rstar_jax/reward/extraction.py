"""Finding the final answer in a model response (SPEC 3: the last `\\boxed{}`, the paper: inside `<answer>`).

Pure string scanning, linear in the response length, so even adversarial text (10,000 nested braces, unbalanced
braces) is handled quickly; nothing here parses mathematics.
"""

from __future__ import annotations

import re

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"
_FIRST_NON_SPACE = re.compile(r"\S")
_BARE_ARGUMENT = re.compile(r"\s*([^\s$\\{}]+|\\[A-Za-z]+)")


def _braced_content(text: str, open_index: int) -> str | None:
    """The text between the brace at `open_index` and its matching close, or None if it never closes."""
    depth = 0
    index = open_index
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # an escaped brace such as \{ does not open or close a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
        index += 1
    return None


def _box_argument(text: str, command_end: int) -> str | None:
    """The argument of a box command ending at `command_end`: `{...}` balanced, or a bare `\\boxed X` token."""
    first = _FIRST_NON_SPACE.search(text, command_end)
    if first is not None and first.group() == "{":
        return _braced_content(text, first.start())
    bare = _BARE_ARGUMENT.match(text, command_end)
    return bare.group(1) if bare is not None else None


def last_boxed(text: str) -> str | None:
    """The argument of the last `\\boxed`/`\\fbox` in `text` (stripped); None when there is none or it is malformed."""
    matches = list(_BOX_COMMAND.finditer(text))
    if not matches:
        return None
    argument = _box_argument(text, matches[-1].end())
    return argument.strip() if argument is not None else None


def _last_answer_block(response: str) -> str | None:
    """Text of the last `<answer>` block, up to its `</answer>` (or the end of the response if never closed)."""
    start = response.rfind(_ANSWER_OPEN)
    if start < 0:
        return None
    start += len(_ANSWER_OPEN)
    end = response.find(_ANSWER_CLOSE, start)
    return response[start:] if end < 0 else response[start:end]


def extract_final_answer(response: str) -> str | None:
    """The answer a response commits to (SPEC 3): the last box inside `<answer>`, else the last box anywhere.

    Returns None when no well-formed box exists (no answer, or the last box's braces never close); such a
    response earns reward 0.
    """
    block = _last_answer_block(response)
    if block is not None:
        answer = last_boxed(block)
        if answer is not None:
            return answer
    return last_boxed(response)
