"""The quality penalty GRPO-RoC ranks correct rollouts by (SPEC section 4, step 4), and its two parts.

p_total = p_err + p_format, computed from counts a trajectory records: tool calls, failed calls (a call whose
structured sandbox status is not success, never a substring match on "error"), `<answer>` tags and turns. Every
function is elementwise over numpy arrays (or plain numbers) so a whole batch is scored at once.
"""

from __future__ import annotations

import numpy as np

NO_TOOL_CALL_PENALTY = 0.5


def _counts(*values: object) -> list[np.ndarray]:
    arrays = [np.asarray(value, np.float64) for value in values]
    for array in arrays:
        if np.any(array < 0):
            raise ValueError(f"penalty counts must be non-negative, got {array}")
    return arrays


def tool_error_penalty(num_tool_calls: object, num_failed_calls: object) -> np.ndarray:
    """p_err: failed calls / all calls; 0.5 for a trajectory without any call, so tool use keeps being preferred."""
    calls, failed = _counts(num_tool_calls, num_failed_calls)
    if np.any(failed > calls):
        raise ValueError(f"more failed calls than calls: {failed} > {calls}")
    return np.where(calls > 0, failed / np.maximum(calls, 1.0), NO_TOOL_CALL_PENALTY)


def format_penalty(num_answer_tags: object, num_turns: object) -> np.ndarray:
    """p_format: 1 without an `<answer>` tag, else min(1, (tags - 1) / turns): repeated answers are penalised."""
    tags, turns = _counts(num_answer_tags, num_turns)
    if np.any((tags > 0) & (turns < 1)):
        raise ValueError(f"a trajectory with answer tags must have at least one turn, got tags {tags}, turns {turns}")
    return np.where(tags > 0, np.minimum(1.0, (tags - 1) / np.maximum(turns, 1.0)), 1.0)


def roc_penalty(num_tool_calls: object, num_failed_calls: object, num_answer_tags: object,
                num_turns: object) -> np.ndarray:
    """p_total = p_err + p_format of SPEC 4.4, in [0, 2]; lower is a cleaner correct rollout."""
    return tool_error_penalty(num_tool_calls, num_failed_calls) + format_penalty(num_answer_tags, num_turns)
