"""A grid's report as markdown (report.md), its numbers as JSON (report.json) and its PNGs (curves.png,
heldout.png): held-out accuracy of the start model and after RL (SPEC 7), the tool-error ratio among correct
trajectories (SPEC 4 Fig. 4), response length and tool calls, per step and held out, as mean and spread over each
group's runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from rstar_jax.grid.aggregate import PointResult, Spread, aggregate, to_jsonable, window
from rstar_jax.grid.plots import plot_curves, plot_heldout

PERCENT_KEYS = ("accuracy", "ratio", "pass")


def is_percent(figure: str) -> bool:
    """Whether a figure's name ("sampled/accuracy", "tool_error_ratio_correct") is a share shown in percent."""
    return any(word in figure for word in PERCENT_KEYS)


def cell(value: Spread | None, percent: bool, signed: bool = False) -> str:
    """A table cell: "mean ± sd" (percent points for shares; a sign for changes when `signed`), the mean alone for
    one run, "-" for none."""
    if value is None:
        return "-"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    text = f"{scale * value.mean:{'+' if signed else ''}.1f}{unit}"
    return text if value.sd is None else f"{text} ± {scale * value.sd:.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def heldout_tables(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Markdown lines: held-out accuracy (T=1 and greedy: start, after, change), then tool use and length."""
    accuracy_rows, tool_rows = [], []
    for group, data in report.items():
        figures = data["heldout"]

        def triple(key: str, with_change: bool = True) -> list[str]:
            spreads = figures.get(key, {})
            whens = ("start", "after", "change") if with_change else ("start", "after")
            return [cell(spreads.get(when), is_percent(key), when == "change") for when in whens]

        accuracy_rows.append([group, str(len(data["runs"])), *triple("sampled/accuracy"),
                              *triple("sampled/pass_at_k", False), *triple("greedy/accuracy")])
        tool_rows.append([group, *triple("sampled/tool_error_ratio_correct", False),
                          *triple("sampled/tool_error_ratio_all", False), *triple("sampled/tool_calls", False),
                          *triple("sampled/response_length", False)])
    lines = _table(["group", "runs", "T=1 accuracy: start", "after RL", "change", "pass@k: start", "after RL",
                    "greedy: start", "after RL", "change"], accuracy_rows)
    lines += ["", *_table(["group", "tool-error ratio in correct: start", "after RL", "in all: start", "after RL",
                           "tool calls: start", "after RL", "response tokens: start", "after RL"], tool_rows)]
    return lines


def training_table(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Markdown lines: each training metric averaged over the first and the last quarter of the steps."""
    names = ("accuracy", "tool_error_ratio_correct", "response_length", "tool_calls")
    rows = []
    for group, data in report.items():
        row = [group, str(max((len(points) for points in data["curves"].values()), default=0))]
        for name in names:
            spreads = data["windows"].get(name, {})
            row += [cell(spreads.get("first"), is_percent(name)), cell(spreads.get("last"), is_percent(name))]
        rows.append(row)
    return _table(["group", "steps", "accuracy: first", "last", "tool-error ratio in correct: first", "last",
                   "response tokens: first", "last", "tool calls: first", "last"], rows)


def runs_table(results: Sequence[PointResult]) -> list[str]:
    """Markdown lines: one row per run (finished or not) with its bindings, start model, steps and T=1 accuracy."""
    rows = []
    for result in results:
        summary = result.summary
        accuracy = [summary[when]["sampled"]["accuracy"] for when in ("start", "after")] if summary else None
        rows.append([result.point.name, "<br>".join(f"`{b}`" for b in result.point.bindings), result.point.model,
                     str(len(result.metrics)),
                     f"{100 * accuracy[0]:.1f}% -> {100 * accuracy[1]:.1f}%" if accuracy else "not finished"])
    return _table(["run", "bindings", "start model", "steps", "held-out T=1 accuracy"], rows)


def describe_evaluation(results: Sequence[PointResult]) -> str:
    """One sentence on the held-out set (problems, samples, temperature) from the first finished run."""
    for result in results:
        if result.summary:
            sampled = result.summary["after"]["sampled"]
            greedy = " and once greedily" if "greedy" in result.summary["after"] else ""
            return (f"{sampled['problems']} held-out problems, each solved {sampled['samples']} times at "
                    f"T={sampled['temperature']:g} (avg@{sampled['samples']}){greedy}")
    return "no run has finished yet"


def write_report(results: Sequence[PointResult], out_dir: str | Path, title: str, over: Sequence[str] = (),
                 preamble: Sequence[str] = ()) -> Path:
    """Write OUT_DIR/report.md, report.json, curves.png and heldout.png for `results` grouped without `over`;
    returns the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = aggregate(results, over)
    finished = sum(result.summary is not None for result in results)
    averaged = f"; each group is the mean ± sample sd over its runs ({', '.join(over)})" if over else ""
    steps = max((len(result.metrics) for result in results), default=0)
    lines = [f"# {title}", "", *preamble, *([""] if preamble else []),
             f"{finished} of {len(results)} runs finished{averaged}. Held-out: {describe_evaluation(results)}; "
             f"change = after RL - start model, per run.", ""]
    curves = plot_curves(report, out_dir / "curves.png", title)
    heldout = plot_heldout(report, out_dir / "heldout.png", title)
    lines += ["## Held-out evaluation: start model vs after RL", "", *heldout_tables(report), ""]
    if heldout:
        lines += [f"![held-out figures]({heldout.name})", ""]
    lines += [f"## Training, per step (each run's mean over its first vs its last quarter of steps: {window(steps)} "
              f"of {steps} here)", "",
              *training_table(report), ""]
    if curves:
        lines += [f"![training curves]({curves.name})", ""]
    lines += ["## Runs", "", *runs_table(results), ""]
    (out_dir / "report.json").write_text(json.dumps(to_jsonable(report), indent=1) + "\n")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
