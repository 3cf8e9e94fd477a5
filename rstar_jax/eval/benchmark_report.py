"""What a benchmark evaluation writes (SPEC section 7): one JSONL record per problem, one summary row per set, and
the summary table (markdown) with the paper's reported rows beside ours.

Pure: `EvalResult`s and numbers in, dicts and text out; the script writes them to files.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from rstar_jax.agent.trajectory import sampled_turn_texts
from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.benchmarks import BENCHMARKS
from rstar_jax.eval.references import PAPER_AIME24_RESPONSE_TOKENS, PAPER_REFERENCES, SOURCE, ReferenceRow
from rstar_jax.reward.extraction import extract_final_answer

# Column order of the reference table: the paper's four sets first, as SPEC 7 lists them, then the other two.
REFERENCE_COLUMNS = ("math500", "aime24", "aime25", "hmmt25", "amc23", "gsm8k")


def problem_records(result: EvalResult, tokenizer: Any) -> list[dict[str, Any]]:
    """One record per problem: id, reference answer, and per sample (in sample order) whether it verified, the
    answer extracted from the model's turns (SPEC 3; None when it boxed none), response length in tokens, tool
    calls and failed tool calls, turns and why the trajectory stopped (SPEC 2)."""
    k = result.summary["samples"]
    records = []
    for index, record in enumerate(result.problems):
        samples = result.samples[index * k:(index + 1) * k]
        if any(sample.problem.id != record["id"] for sample in samples):
            raise ValueError(f"samples of problem {record['id']} are out of order")
        trajectories = [sample.trajectory for sample in samples]
        records.append({
            "id": record["id"],
            "answer": record["answer"],
            "correct": [bool(ok) for ok in result.correct[index * k:(index + 1) * k]],
            "solved": record["correct"],
            "samples": k,
            "model_answers": [extract_final_answer("\n".join(sampled_turn_texts(t, tokenizer)))
                              for t in trajectories],
            "response_lengths": [t.response_length for t in trajectories],
            "tool_calls": [len(t.tool_calls) for t in trajectories],
            "tool_errors": [t.tool_errors for t in trajectories],
            "turns": [t.turns for t in trajectories],
            "finish_reasons": [t.finish_reason.value for t in trajectories],
        })
    return records


def problem_records_jsonl(result: EvalResult, tokenizer: Any) -> str:
    """`problem_records` as JSON lines, the per-problem file every evaluation writes."""
    return "".join(json.dumps(record) + "\n" for record in problem_records(result, tokenizer))


def set_row(name: str, result: EvalResult, seconds: float) -> dict[str, Any]:
    """The summary of one set (SPEC 7): its problem count, k, avg@k pass@1 and pass@k (fractions), and the trajectories'
    mean response length, tool calls, tool-error ratios and finish reasons; `seconds` it took."""
    summary = result.summary
    return {
        "benchmark": name,
        "title": BENCHMARKS[name].title if name in BENCHMARKS else name,
        "problems": summary["problems"],
        "k": summary["samples"],
        "temperature": summary["temperature"],
        "avg_at_k": summary["accuracy"],
        "pass_at_k": summary["pass_at_k"],
        "response_length": summary["response_length"],
        "turns": summary["turns"],
        "tool_calls": summary["tool_calls"],
        "tool_error_ratio_all": summary["tool_error_ratio_all"],
        "tool_error_ratio_correct": summary["tool_error_ratio_correct"],
        "finish_reasons": summary["finish_reasons"],
        "seconds": seconds,
    }


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def results_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown (SPEC 7's figures): one line per set with its problem count, k, avg@k pass@1 and pass@k (%), mean
    response tokens, tool calls per trajectory, tool-error ratio and seconds."""
    k = {row["k"] for row in rows}
    k_label = f"@{k.pop()}" if len(k) == 1 else "@k"
    lines = [f"| benchmark | problems | k | avg{k_label} pass@1 (%) | pass{k_label} (%) | response tokens (mean) | "
             f"tool calls / trajectory | tool-error ratio (%) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['title']} | {row['problems']} | {row['k']} | {_percent(row['avg_at_k'])} | "
                     f"{_percent(row['pass_at_k'])} | {row['response_length']:.1f} | {row['tool_calls']:.2f} | "
                     f"{_percent(row['tool_error_ratio_all'])} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def reference_table(rows: Sequence[Mapping[str, Any]], label: str = "this run",
                    references: Sequence[ReferenceRow] = PAPER_REFERENCES) -> str:
    """Markdown: our avg@k pass@1 (%) per set beside the paper's reported rows (SPEC 7); "—" where a model has no
    reported score or a set was not run."""
    ours = {row["benchmark"]: row["avg_at_k"] for row in rows}
    k = {row["k"] for row in rows}
    ours_label = f"{label} (avg@{k.pop()})" if len(k) == 1 else f"{label} (avg@k)"
    header = "| model | " + " | ".join(BENCHMARKS[name].title for name in REFERENCE_COLUMNS) + " |"
    lines = [header, "|---|" + "---:|" * len(REFERENCE_COLUMNS),
             f"| {ours_label} | " + " | ".join(_percent(ours.get(name)) for name in REFERENCE_COLUMNS) + " |"]
    for reference in references:
        cells = [f"{reference.scores[name]:.1f}" if name in reference.scores else "—" for name in REFERENCE_COLUMNS]
        lines.append(f"| {reference.model} (paper) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(rows: Sequence[Mapping[str, Any]], header: Mapping[str, Any]) -> str:
    """The whole SPEC 7 summary: what was evaluated and how (`header`: model, command, protocol, backend, seconds), the
    results table, the reference table and where its numbers come from."""
    settings = header["settings"]
    lines = ["# Benchmark evaluation", "",
             f"- model: {header['model']}",
             f"- command: `{header['command']}`",
             f"- protocol: k = {settings['samples']} samples per problem at temperature {settings['temperature']:g}, "
             f"at most {settings['max_turns']} turns and {settings['max_response_tokens']} response tokens "
             f"(SPEC 7's protocol is avg@16 at 0.6, 30 turns, 30K tokens)",
             f"- engines: {header['backend']}",
             f"- wall time: {header['seconds']:.0f} s", "",
             "avg@k pass@1 is the mean over problems of the share of their k samples whose answer verifies; pass@k "
             "the share of problems with at least one verified sample.", "",
             results_table(rows), "",
             "## Beside the paper", "",
             f"avg@k pass@1 in percent. Reference rows: {SOURCE}. AMC23 and GSM8K have no reported score there.", "",
             reference_table(rows), "",
             "Mean response length on AIME24 in the paper: " + ", ".join(
                 f"{model} {tokens:,} tokens" for model, tokens in PAPER_AIME24_RESPONSE_TOKENS.items()) + "."]
    return "\n".join(lines) + "\n"
