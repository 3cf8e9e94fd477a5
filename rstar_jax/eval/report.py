"""Text a person reads at the end of a run: the before/after comparison and one trajectory shown in full.

Pure formatting of `EvalResult`s (SPEC 7's figures: accuracy and its paired change, and SPEC 4's tool-error ratio
among correct trajectories), so the demo, evaluation and ablation scripts print the same table.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from rstar_jax.agent.trajectory import sampled_turn_texts
from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.metrics import PairedChange, paired_change, solved_shares
from rstar_jax.reward.extraction import extract_final_answer

ROWS = (
    ("accuracy", "sampled", "accuracy at T=1 (avg@k: share of the k samples per problem that verify)"),
    ("pass_at_k", "sampled", "pass@k at T=1 (problems with at least one verified sample)"),
    ("accuracy", "greedy", "accuracy, greedy"),
    ("tool_error_ratio_correct", "sampled", "tool-error ratio in correct trajectories (failed / all calls)"),
    ("tool_error_ratio_all", "sampled", "tool-error ratio in all trajectories"),
    ("tool_calls", "sampled", "tool calls per trajectory"),
    ("response_length", "sampled", "response length (tokens after the prompt)"),
)


def comparison_table(before: Mapping[str, EvalResult], after: Mapping[str, EvalResult],
                     labels: tuple[str, str] = ("after SFT", "after RL")) -> str:
    """A fixed-width table of the ROWS figures before and after (rows missing from either side are skipped)."""
    width = max(len(description) for _, _, description in ROWS)
    lines = [f"{'':{width}}  {labels[0]:>10}  {labels[1]:>10}"]
    for key, mode, description in ROWS:
        if mode not in before or mode not in after:
            continue
        values = [result[mode].summary[key] for result in (before, after)]
        shown = [f"{100 * v:9.1f}%" if "ratio" in key or "accuracy" in key or "pass" in key else f"{v:10.1f}"
                 for v in values]
        lines.append(f"{description:{width}}  {shown[0]}  {shown[1]}")
    sampled = after.get("sampled")
    if sampled is not None:
        summary = sampled.summary
        lines.append(f"({summary['problems']} held-out problems x {summary['samples']} samples; finish reasons "
                     f"after RL: {_reasons(summary['finish_reasons'])})")
    return "\n".join(lines)


def paired_changes(before: Mapping[str, EvalResult], after: Mapping[str, EvalResult]) -> dict[str, PairedChange]:
    """The `paired_change` of accuracy per problem for each mode both sides evaluated (sampled, greedy)."""
    return {mode: paired_change(solved_shares(before[mode].problems), solved_shares(after[mode].problems))
            for mode in before if mode in after}


def change_text(changes: Mapping[str, PairedChange]) -> str:
    """One line per mode ("sampled", "greedy"): the paired change of accuracy in points with its standard error,
    e.g. "T=1 accuracy change: +12.5 points (standard error 3.1, paired over 64 problems)"."""
    return "\n".join(f"{'T=1' if mode == 'sampled' else mode} accuracy change: {100 * change.mean:+.1f} points "
                     f"(standard error {100 * change.standard_error:.1f}, paired over {change.problems} problems)"
                     for mode, change in changes.items())


def problem_kind(problem_id: str) -> str:
    """The family a problem belongs to: a synthetic task's kind ("synthetic/multiply/d1/s7/0" -> "multiply"),
    otherwise the first part of its id (a benchmark set's name)."""
    parts = problem_id.split("/")
    return parts[1] if parts[0] == "synthetic" and len(parts) > 1 else parts[0]


def accuracy_by_kind(result: EvalResult) -> dict[str, float]:
    """avg@k (SPEC 7) within each `problem_kind`, in first-seen order: where the held-out accuracy comes from."""
    solved: dict[str, list[float]] = defaultdict(list)
    for problem_id, share in solved_shares(result.problems).items():
        solved[problem_kind(problem_id)].append(share)
    return {kind: sum(shares) / len(shares) for kind, shares in solved.items()}


def kind_table(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]],
               labels: tuple[str, str] = ("after SFT", "after RL")) -> str:
    """Accuracy per problem kind before and after (each side `{mode: accuracy_by_kind(result)}`), for each mode both
    sides evaluated (sampled, greedy)."""
    lines = [f"{'accuracy by kind':28}  {labels[0]:>10}  {labels[1]:>10}"]
    for mode in (mode for mode in before if mode in after):
        for kind, accuracy in before[mode].items():
            label = f"{kind}, {'T=1' if mode == 'sampled' else mode}"
            lines.append(f"{label:28}  {100 * accuracy:9.1f}%  {100 * after[mode].get(kind, float('nan')):9.1f}%")
    return "\n".join(lines)


def _reasons(counts: Mapping[str, int]) -> str:
    meaning = {"answered": "ended a turn without a tool call", "max_length": "ran out of tokens",
               "max_turns": "hit the turn limit", "tool_response_overflow": "a tool response would not fit"}
    return "; ".join(f"{count} {name} ({meaning.get(name, name)})" for name, count in sorted(counts.items()))


def example_text(result: EvalResult, tokenizer: Any) -> str:
    """One trajectory in full (a verified one when there is one): problem, reference, the model's answer, the text."""
    index = next((i for i, ok in enumerate(result.correct) if ok), 0)
    sample = result.samples[index]
    answer = extract_final_answer("\n".join(sampled_turn_texts(sample.trajectory, tokenizer)))
    trajectory = sample.trajectory
    header = (f"example trajectory ({'verified' if result.correct[index] else 'not verified'}, "
              f"finish: {trajectory.finish_reason.value}):\n  problem: {sample.problem.question}\n"
              f"  reference answer: {sample.problem.answer}\n  model's answer: {answer}")
    return header + "\n" + tokenizer.decode(list(trajectory.token_ids[trajectory.prompt_length:]))
