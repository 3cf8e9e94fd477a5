"""SFT transcripts for the synthetic tool tasks, run against the real sandbox (issue 4.5; SPEC sections 2 and 5).

Each transcript is a chat in the agent format: the model calls the Python tool, reads the sandbox's real output and
writes the boxed answer inside `<answer>`. A set fraction make a faulty call first, so RL starts with tool errors for
GRPO-RoC to remove. The faults (`sft_transcripts.fault_kinds`):
- "syntax", "name": the program's final print is broken, so nothing is printed; the transcript reads the real error
  and fixes it with a second call (which copies the question's numbers again: a costly error for a tiny model);
- "trailing": a line after the answer's print ends the program with a failure status (`raise SystemExit(1)`, or
  with a one-line message), so the call fails but its stdout already holds the answer and the transcript answers
  from it without a second call. Harmless to the outcome by construction: an outcome-only reward has no reason to
  remove it, a quality-aware one (GRPO-RoC, penalty rewards) does, the setting of SPEC 4's Figure 4 (issue 11).
  No traceback: one between the printed answer and the answer turn made the tiny demo model miscopy the answer
  (1 of 26 such samples correct against 24 of 46 clean ones), which made the error costly again.
Token ids and loss mask come from the `TrajectoryBuilder` (mask 1 on assistant tokens only). Which tasks are faulty
and every written word are decided by the seed, so the same seed and the same tool outputs give the same ids.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

import gin
from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.prompt import TOOL_NAME, prompt_messages, prompt_token_ids
from rstar_jax.agent.tool_call import ToolCall, tool_call_text
from rstar_jax.agent.tool_protocol import ToolExecutor, ToolOutcome
from rstar_jax.agent.tool_response import format_tool_response
from rstar_jax.agent.trajectory import FinishReason, Trajectory, TrajectoryBuilder
from rstar_jax.data.problem import Problem
from rstar_jax.data.synthetic import SyntheticTask

_FINAL_LINE = "print(result)"
_FAULTY_FINAL_LINES = {
    "syntax": ("print(result", "print result"),
    "name": ("print(answer)", "print(reslt)"),
}
TRAILING_FAULT = "trailing"
_TRAILING_LINES = ("raise SystemExit(1)", "raise SystemExit('unchecked')")
DEFAULT_FAULT_KINDS = tuple(sorted(_FAULTY_FINAL_LINES))  # the faults fixed by a second call
FAULT_KINDS = (*DEFAULT_FAULT_KINDS, TRAILING_FAULT)
INTROS = (  # the first assistant turn's reason, one chosen per transcript (and per copy drill)
    "Doing this by hand is error-prone, so I compute it exactly with Python.",
    "I will let Python do the exact arithmetic.",
    "This is a long computation; I run it in Python.",
)
_ERROR_NAME = re.compile(r"^(\w*(?:Error|Exception))\b")


@dataclass(frozen=True)
class SolutionPlan:
    """What one transcript will do: an optional faulty program first, then the task's correct program."""

    task: SyntheticTask
    intro: str
    fault: str | None
    faulty_code: str | None

    @property
    def answers_from_faulty_call(self) -> bool:
        """Whether the faulty call's stdout already holds the answer (a trailing fault): no second call."""
        return self.fault == TRAILING_FAULT

    @property
    def programs(self) -> tuple[str, ...]:
        """The programs the transcript sends to the tool, in order."""
        if self.faulty_code is None:
            return (self.task.solution_code,)
        if self.answers_from_faulty_call:
            return (self.faulty_code,)
        return self.faulty_code, self.task.solution_code


@dataclass(frozen=True)
class SftTranscript:
    """One SFT example: the problem, its token ids / loss mask (as a `Trajectory`) and whether it had a fault."""

    problem: Problem
    trajectory: Trajectory
    faulty_first_call: bool


class SandboxMismatchError(RuntimeError):
    """The tool's real output contradicts what a transcript needs (a correct program failed, or a faulty one ran)."""


def _check_fault_kinds(fault_kinds: Sequence[str]) -> None:
    unknown = set(fault_kinds) - set(FAULT_KINDS)
    if not fault_kinds or unknown:
        raise ValueError(f"unknown or no fault kinds {sorted(unknown) or list(fault_kinds)}; choose from {FAULT_KINDS}")


def faulty_version(code: str, fault: str, rng: random.Random) -> str:
    """`code` broken on purpose: its final print made a SyntaxError ("syntax") or NameError ("name"), or a failing
    exit added after it ("trailing": the answer is printed first)."""
    _check_fault_kinds((fault,))
    if not code.endswith(_FINAL_LINE):
        raise ValueError(f"a solution program must end with {_FINAL_LINE!r} to be broken on purpose: {code!r}")
    if fault == TRAILING_FAULT:
        return f"{code}\n{rng.choice(_TRAILING_LINES)}"
    return code[: -len(_FINAL_LINE)] + rng.choice(_FAULTY_FINAL_LINES[fault])


def plan_solutions(tasks: Sequence[SyntheticTask], seed: int, faulty_fraction: float,
                   fault_kinds: Sequence[str] = DEFAULT_FAULT_KINDS) -> list[SolutionPlan]:
    """A plan per task; exactly round(faulty_fraction * len(tasks)) of them, chosen by the seed, start faulty, each
    with a fault drawn from `fault_kinds`."""
    if not 0.0 <= faulty_fraction <= 1.0:
        raise ValueError(f"faulty_fraction must be within [0, 1], got {faulty_fraction}")
    _check_fault_kinds(fault_kinds)
    rng = random.Random(f"sft:{seed}")
    faulty = set(rng.sample(range(len(tasks)), round(faulty_fraction * len(tasks))))
    plans = []
    for index, task in enumerate(tasks):
        intro = rng.choice(INTROS)
        fault = rng.choice(sorted(fault_kinds))
        if index in faulty:
            plans.append(SolutionPlan(task, intro, fault, faulty_version(task.solution_code, fault, rng)))
        else:
            plans.append(SolutionPlan(task, intro, None, None))
    return plans


def _error_name(outcome: ToolOutcome) -> str:
    for line in reversed(outcome.stderr.strip().splitlines()):
        match = _ERROR_NAME.match(line.strip())
        if match:
            return f"a {match.group(1)}"
    return "an error"


def _check_outcomes(plan: SolutionPlan, outcomes: Sequence[ToolOutcome]) -> None:
    """Raise SandboxMismatchError unless the faulty program failed and the last program printed the answer (and
    succeeded, unless it is a trailing fault's)."""
    if len(outcomes) != len(plan.programs):
        raise ValueError(f"plan runs {len(plan.programs)} programs but {len(outcomes)} outcomes were given")
    problem = plan.task.problem
    if plan.faulty_code is not None and outcomes[0].ok:
        raise SandboxMismatchError(f"{problem.id}: the faulty program ran without error: {plan.faulty_code!r}")
    final = outcomes[-1]
    if (not final.ok and not plan.answers_from_faulty_call) or final.stdout.strip() != problem.answer:
        raise SandboxMismatchError(
            f"{problem.id}: the solution program gave status {final.status!r}, stdout {final.stdout!r:.200}, "
            f"stderr {final.stderr!r:.200}; expected stdout {problem.answer!r}"
        )


@dataclass(frozen=True)
class AssistantTurn:
    """One written assistant turn: its prose and, unless it is the last, the tool call it ends with."""

    content: str
    call: ToolCall | None = None

    @property
    def text(self) -> str:
        """The turn as the model writes it (the chat template's layout: prose, newline, call)."""
        return self.content if self.call is None else f"{self.content}\n{tool_call_text(self.call)}"

    def message(self) -> dict[str, Any]:
        """The turn as a chat message for `apply_chat_template`."""
        if self.call is None:
            return {"role": "assistant", "content": self.content}
        arguments = {"code": self.call.code, "input": self.call.stdin}
        call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
        return {"role": "assistant", "content": self.content, "tool_calls": [call]}


@gin.configurable
def final_turn_text(value: str, restated: bool = True) -> str:
    """The last assistant turn of a transcript (SPEC section 5's format): what the program printed, boxed inside the
    answer tags; `restated` also writes it once in the reason before. Each copy of a number is a chance for the
    tiny demo model to miscopy it, and a restated 5-digit product is copied twice (issue 24)."""
    reason = f"The program printed {value}." if restated else "The program printed the answer."
    return f"<reason>{reason}</reason>\n<answer>\\boxed{{{value}}}</answer>"


def assistant_turns(plan: SolutionPlan, outcomes: Sequence[ToolOutcome]) -> list[AssistantTurn]:
    """The assistant turns given the tool's outcome for each of the plan's programs (pure).

    The boxed answer is the correct program's real stdout, so the transcript never states what the tool did not say;
    outcomes that contradict the plan raise SandboxMismatchError.
    """
    _check_outcomes(plan, outcomes)
    calls = [ToolCall(code=code) for code in plan.programs]
    turns = [AssistantTurn(f"<reason>{plan.intro}</reason>", calls[0])]
    if plan.faulty_code is not None and not plan.answers_from_faulty_call:
        fix = f"The program failed with {_error_name(outcomes[0])}. I fix the code and run it again."
        turns.append(AssistantTurn(f"<reason>{fix}</reason>", calls[1]))
    value = outcomes[-1].stdout.strip()
    turns.append(AssistantTurn(final_turn_text(value)))
    return turns


def transcript_messages(plan: SolutionPlan, outcomes: Sequence[ToolOutcome]) -> list[dict[str, Any]]:
    """The whole transcript as chat messages (with the tool schema, `apply_chat_template` renders its text)."""
    messages: list[dict[str, Any]] = list(prompt_messages(plan.task.problem.question))
    turns = assistant_turns(plan, outcomes)
    for turn, outcome in zip(turns, outcomes):
        messages += [turn.message(), {"role": "tool", "content": format_tool_response(outcome)}]
    messages.append(turns[-1].message())
    return messages


def build_transcript(
    plan: SolutionPlan, outcomes: Sequence[ToolOutcome], tokenizer: PreTrainedTokenizerBase
) -> SftTranscript:
    """Token ids and loss mask of one transcript from the tool's outcomes (pure; the ids are appended piecewise)."""
    builder = TrajectoryBuilder(tokenizer, prompt_token_ids(tokenizer, plan.task.problem.question))
    turns = assistant_turns(plan, outcomes)
    for turn, outcome in zip(turns, outcomes):
        builder.add_written_turn(turn.text)
        builder.add_tool_responses([outcome])
    builder.add_written_turn(turns[-1].text)
    return SftTranscript(
        problem=plan.task.problem,
        trajectory=builder.finish(FinishReason.ANSWERED),
        faulty_first_call=plan.faulty_code is not None,
    )


async def run_plan(plan: SolutionPlan, executor: ToolExecutor) -> list[ToolOutcome]:
    """Run the plan's programs one after the other on the tool, as the model would."""
    return [await executor.run(code) for code in plan.programs]


@gin.configurable
async def sft_transcripts(
    tasks: Sequence[SyntheticTask],
    executor: ToolExecutor,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    faulty_fraction: float = 0.25,
    fault_kinds: Sequence[str] = DEFAULT_FAULT_KINDS,
    max_concurrency: int = 8,
) -> list[SftTranscript]:
    """SFT transcripts for `tasks`, in order, with the tool's real outputs (issue 4.5); `faulty_fraction` of them
    start with a fault drawn from `fault_kinds` (the module docstring says what each does).

    Raises SandboxMismatchError when the tool's output contradicts a task's reference answer.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    plans = plan_solutions(tasks, seed, faulty_fraction, fault_kinds)
    limit = asyncio.Semaphore(max_concurrency)

    async def one(plan: SolutionPlan) -> SftTranscript:
        async with limit:
            outcomes = await run_plan(plan, executor)
        return build_transcript(plan, outcomes, tokenizer)

    return list(await asyncio.gather(*(one(plan) for plan in plans)))
