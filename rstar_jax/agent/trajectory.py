"""Building a trajectory piece by piece from token ids (DESIGN.md, "Token ids end to end"; SPEC section 2).

The prompt ids come from the chat template once; model turns are appended as the ids the engine sampled (loss
mask 1, with their logprobs); tool responses and the chat scaffolding between turns are tokenised on their own and
appended as context (loss mask 0). Nothing is ever re-tokenised as a whole, so the ids the learner trains on are
exactly the ids the engine saw.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.tool_call import FailedToolCall
from rstar_jax.agent.tool_protocol import ToolOutcome
from rstar_jax.agent.tool_response import format_tool_response
from rstar_jax.tokenizers.plain_text import plain_text_ids
from rstar_jax.tokenizers.special_tokens import IM_END, IM_START, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN

ANSWER_TAG = "<answer>"


class FinishReason(str, enum.Enum):
    """Why a trajectory stopped (the four stop rules of SPEC section 2).

    answered: the model ended a turn without calling the tool, which is how it gives its final answer (whether that
    turn holds a boxed answer is the verifier's business); max_length: the response budget ran out; max_turns: the
    turn limit T was reached; tool_response_overflow: the next tool response would not have fitted the budget.
    """

    ANSWERED = "answered"
    MAX_LENGTH = "max_length"
    MAX_TURNS = "max_turns"
    TOOL_RESPONSE_OVERFLOW = "tool_response_overflow"


@dataclass(frozen=True)
class ToolCallRecord:
    """The outcome of one tool call: the sandbox status (or "invalid_call") and whether it succeeded."""

    status: str
    ok: bool


@dataclass(frozen=True)
class Trajectory:
    """One finished rollout: ids, loss mask, sampled logprobs and the counts GRPO-RoC needs (SPEC section 4).

    `rollout_logprobs` is 0.0 wherever a token was not sampled by the engine (prompt, context, written SFT text).
    """

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    prompt_length: int
    tool_calls: tuple[ToolCallRecord, ...]
    turns: int
    answer_tags: int
    finish_reason: FinishReason

    @property
    def response_length(self) -> int:
        """Tokens after the prompt (model turns plus tool responses), what the max response length bounds."""
        return len(self.token_ids) - self.prompt_length

    @property
    def tool_errors(self) -> int:
        """Tool calls that did not succeed, counted from structured statuses (SPEC section 4)."""
        return sum(not call.ok for call in self.tool_calls)


def sampled_turn_texts(trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The text of each run of model tokens (loss mask 1), in order: the assistant turns without the prompt and
    tool responses. Their join is what the final answer is extracted from (SPEC section 3), so program output that
    prints a `\\boxed{}` never counts as the model's answer."""
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(trajectory.token_ids, trajectory.loss_mask):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in runs]


def count_answer_tags(text: str) -> int:
    """Number of `<answer>` tags in model text (SPEC section 4, p_format)."""
    return text.count(ANSWER_TAG)


@dataclass
class TrajectoryBuilder:
    """Appends the pieces of one trajectory; `finish` freezes them into a `Trajectory`."""

    tokenizer: PreTrainedTokenizerBase
    prompt_ids: Sequence[int]
    _ids: list[int] = field(init=False)
    _mask: list[int] = field(init=False)
    _logprobs: list[float] = field(init=False)
    _tool_calls: list[ToolCallRecord] = field(init=False, default_factory=list)
    _turns: int = field(init=False, default=0)
    _answer_tags: int = field(init=False, default=0)
    _im_end_id: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("TrajectoryBuilder needs a non-empty prompt")
        self._ids = list(self.prompt_ids)
        self._mask = [0] * len(self._ids)
        self._logprobs = [0.0] * len(self._ids)
        self._im_end_id = self._single_id(IM_END)

    def _single_id(self, token: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer splits {token!r} into {len(ids)} ids; it must be one special token")
        return ids[0]

    @property
    def token_ids(self) -> list[int]:
        """A copy of the ids so far, e.g. to send to the engine for the next turn."""
        return list(self._ids)

    @property
    def response_length(self) -> int:
        """Tokens appended after the prompt so far."""
        return len(self._ids) - len(self.prompt_ids)

    @property
    def turns(self) -> int:
        """Assistant turns appended so far (the turn limit T of SPEC section 2 counts these)."""
        return self._turns

    def _append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        self._ids.extend(ids)
        self._mask.extend([mask] * len(ids))
        self._logprobs.extend([0.0] * len(ids) if logprobs is None else logprobs)

    def _count_turn(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self._turns += 1
        self._answer_tags += count_answer_tags(text)
        return text

    def add_sampled_turn(self, ids: Sequence[int], logprobs: Sequence[float]) -> str:
        """Append one assistant turn as the engine sampled it (loss mask 1); returns its text for parsing."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a sampled turn has {len(ids)} ids but {len(logprobs)} logprobs")
        if len(ids) == 0:
            raise ValueError("a sampled turn must hold at least one token")
        self._append(ids, 1, [float(lp) for lp in logprobs])
        return self._count_turn(ids)

    def add_written_turn(self, content: str) -> list[int]:
        """Append an assistant turn given as text (SFT transcripts): its ids and end of turn get loss mask 1."""
        ids = self.tokenizer.encode(content, add_special_tokens=False) + [self._im_end_id]
        self._append(ids, 1)
        self._count_turn(ids)
        return ids

    def tool_response_ids(self, outcomes: Sequence[ToolOutcome | FailedToolCall]) -> list[int]:
        """The context ids that close the assistant turn and carry the tool responses in a user turn.

        Program output is tokenised as plain text (`plain_text_ids`): a printed control token stays text.
        """
        if not outcomes:
            raise ValueError("tool_response_ids needs at least one tool outcome")
        ids = [] if self._ids[-1] == self._im_end_id else [self._im_end_id]
        ids += self._encode_markup(f"\n{IM_START}user")
        for outcome in outcomes:
            ids += self._encode_markup(f"\n{TOOL_RESPONSE_OPEN}\n")
            ids += plain_text_ids(self.tokenizer, format_tool_response(outcome))
            ids += self._encode_markup(f"\n{TOOL_RESPONSE_CLOSE}")
        ids += self._encode_markup(f"{IM_END}\n{IM_START}assistant\n")
        return ids

    def _encode_markup(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_tool_responses(
        self, outcomes: Sequence[ToolOutcome | FailedToolCall], max_response_length: int | None = None
    ) -> bool:
        """Record the calls' outcomes and append their responses as context (loss mask 0).

        With `max_response_length`, responses that would overflow the budget are not appended and False is
        returned, so the caller stops with TOOL_RESPONSE_OVERFLOW (SPEC section 2); the calls are still recorded
        because they ran.
        """
        self._tool_calls.extend(ToolCallRecord(status=o.status, ok=bool(o.ok)) for o in outcomes)
        ids = self.tool_response_ids(outcomes)
        if max_response_length is not None and self.response_length + len(ids) > max_response_length:
            return False
        self._append(ids, 0)
        return True

    def finish(self, reason: FinishReason) -> Trajectory:
        """Freeze the pieces into a `Trajectory` that stopped for `reason`."""
        return Trajectory(
            token_ids=tuple(self._ids),
            loss_mask=tuple(self._mask),
            rollout_logprobs=tuple(self._logprobs),
            prompt_length=len(self.prompt_ids),
            tool_calls=tuple(self._tool_calls),
            turns=self._turns,
            answer_tags=self._answer_tags,
            finish_reason=FinishReason(reason),
        )
