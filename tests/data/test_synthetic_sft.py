"""SFT transcripts from given tool outcomes (pure logic): layout, loss mask, fault fraction, determinism."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rstar_jax.agent import TOOL_SCHEMA
from rstar_jax.data.synthetic import synthetic_tasks
from rstar_jax.data.synthetic_sft import (
    SandboxMismatchError,
    build_transcript,
    faulty_version,
    plan_solutions,
    transcript_messages,
)
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.api import ToolResult



def _outcomes(plan) -> list[Outcome]:
    answer = ToolResult("ok", plan.task.problem.answer + "\n", "", 0, 9.0)
    if plan.faulty_code is None:
        return [answer]
    if plan.fault == "trailing":
        return [ToolResult("error", answer.stdout, "unchecked\n", 1, 4.0)]
    error = "SyntaxError: '(' was never closed" if plan.fault == "syntax" else "NameError: name 'answer' is not defined"
    return [ToolResult("error", "", f"Traceback (most recent call last):\n{error}\n", 1, 4.0), answer]


def test_exactly_the_set_fraction_starts_with_a_fault_chosen_by_seed() -> None:
    tasks = synthetic_tasks(20, seed=1)
    plans = plan_solutions(tasks, seed=3, faulty_fraction=0.3)
    assert sum(plan.faulty_code is not None for plan in plans) == 6
    assert plans == plan_solutions(tasks, seed=3, faulty_fraction=0.3)
    assert plans != plan_solutions(tasks, seed=4, faulty_fraction=0.3)
    assert all(len(plan.programs) == (2 if plan.faulty_code else 1) for plan in plans)
    with pytest.raises(ValueError, match="faulty_fraction"):
        plan_solutions(tasks, seed=3, faulty_fraction=1.5)


@pytest.mark.parametrize(("fault", "stderr_marks"), [("syntax", ("SyntaxError",)), ("name", ("NameError",)),
                                                    ("trailing", ("", "unchecked"))])
def test_faulty_programs_really_fail(fault: str, stderr_marks: tuple[str, ...]) -> None:
    """Each fault exits with status 1; syntax and name faults print nothing and raise their error, a trailing fault
    prints the answer first and leaves a stderr of at most one line (each of its variants is drawn)."""
    import random

    seen = set()
    for seed in range(12):
        task = synthetic_tasks(1, seed=seed)[0]
        code = faulty_version(task.solution_code, fault, random.Random(seed))
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert run.returncode == 1, (code, run.stderr)
        if fault == "trailing":
            assert run.stdout == task.problem.answer + "\n" and run.stderr.strip() in stderr_marks, (code, run)
            seen.add(run.stderr.strip())
        else:
            assert run.stdout == "" and stderr_marks[0] in run.stderr, (code, run)
            seen.add(stderr_marks[0])
    assert seen == set(stderr_marks)
    with pytest.raises(ValueError, match="unknown or no fault kinds"):
        faulty_version(task.solution_code, "typo", random.Random(0))
    with pytest.raises(ValueError, match="unknown or no fault kinds"):
        plan_solutions(synthetic_tasks(2, seed=0), seed=0, faulty_fraction=0.5, fault_kinds=())


def test_a_trailing_fault_answers_from_the_failed_call_without_a_second_call() -> None:
    tokenizer = load_tokenizer("tiny")
    plans = plan_solutions(synthetic_tasks(6, seed=2), seed=0, faulty_fraction=0.5, fault_kinds=("trailing",))
    assert sum(plan.fault == "trailing" and plan.faulty_code is not None for plan in plans) == 3
    for plan in plans:
        trajectory = build_transcript(plan, _outcomes(plan), tokenizer).trajectory
        expected = ["error"] if plan.faulty_code else ["ok"]
        assert [call.status for call in trajectory.tool_calls] == expected and trajectory.turns == 2
        assert tokenizer.decode(list(trajectory.token_ids)).endswith(
            f"<answer>\\boxed{{{plan.task.problem.answer}}}</answer><|im_end|>")
    # The default kinds leave the draws as they were before "trailing" existed: same plans for the same seed.
    assert plan_solutions(synthetic_tasks(6, seed=2), seed=0, faulty_fraction=0.5) == plan_solutions(
        synthetic_tasks(6, seed=2), seed=0, faulty_fraction=0.5, fault_kinds=("syntax", "name"))
    [faulty] = [plan for plan in plans if plan.faulty_code][:1]
    wrong = ToolResult("error", "12\n", "", 1, 1.0)
    with pytest.raises(SandboxMismatchError, match="expected stdout"):
        build_transcript(faulty, [wrong], tokenizer)


@pytest.mark.parametrize("name", ["tiny", "qwen2.5"])
def test_transcript_ids_decode_to_the_chat_and_train_only_on_assistant_tokens(name: str) -> None:
    tokenizer = load_tokenizer(name)
    plans = plan_solutions(synthetic_tasks(4, seed=2, difficulty=2), seed=0, faulty_fraction=0.5)
    for plan in plans:
        outcomes = _outcomes(plan)
        transcript = build_transcript(plan, outcomes, tokenizer)
        trajectory = transcript.trajectory
        messages = transcript_messages(plan, outcomes)
        chat = tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], tokenize=False)
        assert tokenizer.decode(list(trajectory.token_ids)) + "\n" == chat

        trained = tokenizer.decode([t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m])
        assistant_texts = [
            tokenizer.apply_chat_template([messages[0], m], tools=[TOOL_SCHEMA], tokenize=False).split(
                "<|im_start|>assistant\n", 1
            )[1]
            for m in messages
            if m["role"] == "assistant"
        ]
        assert trained == "".join(text.removesuffix("\n") for text in assistant_texts)
        assert trained.endswith(f"<answer>\\boxed{{{plan.task.problem.answer}}}</answer><|im_end|>")

        assert transcript.faulty_first_call == (plan.faulty_code is not None)
        assert trajectory.turns == len(plan.programs) + 1 and trajectory.answer_tags == 1
        assert [call.ok for call in trajectory.tool_calls] == [o.ok for o in outcomes]
        assert build_transcript(plan, outcomes, tokenizer) == transcript  # same outcomes, same ids


def test_fix_turn_names_the_error_the_tool_reported() -> None:
    plans = plan_solutions(synthetic_tasks(4, seed=2), seed=0, faulty_fraction=1.0)
    for plan in plans:
        fix_turn = transcript_messages(plan, _outcomes(plan))[4]
        expected = "SyntaxError" if plan.fault == "syntax" else "NameError"
        assert f"The program failed with a {expected}." in fix_turn["content"]


def test_outcomes_that_contradict_the_task_are_refused() -> None:
    tokenizer = load_tokenizer("tiny")
    [plan] = plan_solutions(synthetic_tasks(1, seed=0), seed=0, faulty_fraction=0.0)
    with pytest.raises(SandboxMismatchError, match="expected stdout"):
        build_transcript(plan, [ToolResult("ok", "12\n", "", 0, 1.0)], tokenizer)
    with pytest.raises(SandboxMismatchError, match="status 'timeout'"):
        build_transcript(plan, [ToolResult("timeout", "", "", None, 1.0)], tokenizer)
    [faulty] = plan_solutions(synthetic_tasks(1, seed=0), seed=0, faulty_fraction=1.0)
    answer = ToolResult("ok", faulty.task.problem.answer + "\n", "", 0, 1.0)
    with pytest.raises(SandboxMismatchError, match="faulty program ran without error"):
        build_transcript(faulty, [answer, answer], tokenizer)
    with pytest.raises(ValueError, match="2 programs but 1 outcomes"):
        build_transcript(faulty, [answer], tokenizer)
