"""avg@k / pass@k (SPEC 7) on verdicts worked out by hand, the per-problem records of real trajectories, and the
summary tables with the paper's reference rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rstar_jax.agent import FinishReason, TrajectoryBuilder, prompt_token_ids, tool_call_text
from rstar_jax.agent.tool_call import ToolCall
from rstar_jax.data.problem import Problem
from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.benchmark_report import (problem_records, problem_records_jsonl, reference_table, results_table,
                                             set_row)
from rstar_jax.eval.metrics import avg_at_k, pass_at_k, verdict_matrix
from rstar_jax.rl.metrics import trajectory_metrics
from rstar_jax.rollout.agent_loop import RolloutSample
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.api import Status, ToolResult


def test_avg_and_pass_at_k_by_hand() -> None:
    # 3 problems x 4 samples: one of four right, all right, none right.
    verdicts = verdict_matrix([True, False, False, False, True, True, True, True, False, False, False, False], 3, 4)
    assert verdicts.shape == (3, 4)
    assert avg_at_k(verdicts) == pytest.approx((1 / 4 + 1 + 0) / 3)  # 0.41667
    assert pass_at_k(verdicts) == pytest.approx(2 / 3)
    # k = 1: both are plain accuracy.
    single = verdict_matrix([True, False, True, True, False], 5, 1)
    assert avg_at_k(single) == pass_at_k(single) == pytest.approx(0.6)


def test_verdicts_must_fill_the_matrix() -> None:
    with pytest.raises(ValueError, match="7 verdicts"):
        verdict_matrix([True] * 7, 2, 4)


def _trajectory(tokenizer, problem: Problem, answer: str, failed_call: bool):
    builder = TrajectoryBuilder(tokenizer, prompt_token_ids(tokenizer, problem.question))
    if failed_call:
        builder.add_written_turn(tool_call_text(ToolCall(code="print(1/0)")))
        builder.add_tool_responses([ToolResult(Status.ERROR, "", "ZeroDivisionError", 1, 3.0)])
    builder.add_written_turn(f"<answer>\\boxed{{{answer}}}</answer>")
    return builder.finish(FinishReason.ANSWERED)


def test_records_rows_and_tables_from_real_trajectories() -> None:
    tokenizer = load_tokenizer("tiny")
    problems = [Problem("set/1", "What is 2 + 3?", "5", "set"), Problem("set/2", "What is 7 * 6?", "42", "set")]
    # problem 1: right, wrong (after a failed call); problem 2: wrong, wrong.
    plan = [("5", False, True), ("4", True, False), ("41", False, False), ("40", False, False)]
    samples = [RolloutSample(problems[i // 2], i // 2, i % 2, i, _trajectory(tokenizer, problems[i // 2], a, f))
               for i, (a, f, _) in enumerate(plan)]
    correct = [ok for _, _, ok in plan]
    verdicts = verdict_matrix(correct, 2, 2)
    summary = {"problems": 2, "samples": 2, "temperature": 0.6,
               **trajectory_metrics([s.trajectory for s in samples], correct),
               "pass_at_k": pass_at_k(verdicts)}
    summary["accuracy"] = avg_at_k(verdicts)
    result = EvalResult(summary, [{"id": "set/1", "answer": "5", "correct": 1, "samples": 2},
                                  {"id": "set/2", "answer": "42", "correct": 0, "samples": 2}], samples, correct)

    records = problem_records(result, tokenizer)
    assert [r["id"] for r in records] == ["set/1", "set/2"]
    assert records[0]["correct"] == [True, False] and records[1]["correct"] == [False, False]
    assert records[0]["model_answers"] == ["5", "4"] and records[1]["model_answers"] == ["41", "40"]
    assert records[0]["tool_calls"] == [0, 1] and records[0]["tool_errors"] == [0, 1]
    assert records[0]["turns"] == [1, 2]
    assert records[0]["response_lengths"] == [s.trajectory.response_length for s in samples[:2]]
    assert records[0]["response_lengths"][1] > records[0]["response_lengths"][0]
    assert [json.loads(line) for line in problem_records_jsonl(result, tokenizer).splitlines()] == records

    row = set_row("aime24", result, seconds=12.0)
    assert (row["title"], row["problems"], row["k"]) == ("AIME24", 2, 2)
    assert row["avg_at_k"] == pytest.approx(0.25) and row["pass_at_k"] == pytest.approx(0.5)
    assert row["tool_calls"] == pytest.approx(0.25) and row["tool_error_ratio_all"] == pytest.approx(1.0)

    line = results_table([row]).splitlines()[2]
    assert [cell.strip() for cell in line.strip("|").split("|")][:5] == ["AIME24", "2", "2", "25.0", "50.0"]
    table = {cells[0]: cells[1:] for cells in
             ([c.strip() for c in line.strip("|").split("|")] for line in reference_table([row]).splitlines()[2:])}
    # Columns: MATH-500, AIME24, AIME25, HMMT25, AMC23, GSM8K.
    assert table["this run (avg@2)"] == ["—", "25.0", "—", "—", "—", "—"]
    assert table["rStar2-Agent-14B (paper)"] == ["97.8", "80.6", "69.8", "52.7", "—", "—"]
    assert table["Qwen3-14B (paper)"] == ["96.8", "79.3", "70.4", "48.9", "—", "—"]
    assert table["rStar2-Agent-14B after RL stage 1 (paper)"] == ["—", "72.1", "64.2", "—", "—", "—"]
    assert np.isclose(float(table["o3-mini (medium) (paper)"][2]), 77.0)
