"""The numbers of a grid report: each group of runs (points that differ only in the axes averaged over, e.g. the
seed) summarised as mean and spread over its runs.

Pure apart from `load_results`. Figures: held-out evaluation of the start model and of the trained one (SPEC 7; the
tool-error ratio among correct trajectories is SPEC 4's Figure 4 measure), and the trainer's per-step metrics
(accuracy, tool-error ratio among correct trajectories, response length, tool calls: what Figure 4 plots over
steps). Spread is the sample standard deviation (n - 1) and the range; a group of one run has no standard deviation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rstar_jax.eval.report import ROWS
from rstar_jax.grid.points import Point
from rstar_jax.grid.runner import SUMMARY_FILE, run_dir
from rstar_jax.train.metrics import METRICS_FILE, read_metrics

CURVE_METRICS = ("accuracy", "tool_error_ratio_correct", "response_length", "tool_calls")
HELDOUT_FIGURES = tuple((mode, key) for key, mode, _ in ROWS)


@dataclasses.dataclass(frozen=True)
class PointResult:
    """A run's point, its summary (None until finished) and its per-step metrics."""

    point: Point
    summary: dict[str, Any] | None
    metrics: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation (None for one value), range and count of a figure over a group's runs."""

    mean: float
    sd: float | None
    low: float
    high: float
    n: int


def spread(values: Sequence[float]) -> Spread:
    """Mean and spread of `values` (at least one)."""
    if not values:
        raise ValueError("spread needs at least one value")
    array = np.asarray(values, np.float64)
    sd = float(array.std(ddof=1)) if len(array) > 1 else None
    return Spread(float(array.mean()), sd, float(array.min()), float(array.max()), len(array))


def load_results(grid_dir: str | Path, points: Sequence[Point]) -> list[PointResult]:
    """Every point's summary (None where it has not finished) and metrics, in the points' order."""
    results = []
    for point in points:
        directory = run_dir(grid_dir, point)
        summary_path = directory / SUMMARY_FILE
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        results.append(PointResult(point, summary, read_metrics(directory / METRICS_FILE)))
    return results


def groups(results: Sequence[PointResult], over: Sequence[str] = ()) -> dict[str, list[PointResult]]:
    """Finished results grouped by their point's name without the axes in `over`, in first-seen order."""
    grouped: dict[str, list[PointResult]] = {}
    for result in results:
        if result.summary is not None:
            grouped.setdefault(result.point.group(over), []).append(result)
    return grouped


def heldout_figures(results: Sequence[PointResult]) -> dict[str, dict[str, Spread]]:
    """For each held-out figure "mode/key" present in every run (SPEC 7 accuracy at T=1 and greedy, pass@k, the
    tool-error ratios, tool calls, response length): its spread at the start, after RL, and of the change."""
    figures: dict[str, dict[str, Spread]] = {}
    for mode, key in HELDOUT_FIGURES:
        pairs = [(r.summary["start"].get(mode, {}).get(key), r.summary["after"].get(mode, {}).get(key))
                 for r in results]
        if not pairs or any(start is None or after is None for start, after in pairs):
            continue
        figures[f"{mode}/{key}"] = {"start": spread([s for s, _ in pairs]), "after": spread([a for _, a in pairs]),
                                    "change": spread([a - s for s, a in pairs])}
    return figures


def step_curves(results: Sequence[PointResult], metrics: Sequence[str] = CURVE_METRICS
                ) -> dict[str, list[tuple[int, Spread]]]:
    """Per metric, (step, spread over the runs that logged that step) for every logged step (SPEC 4 Fig. 4's axes)."""
    curves: dict[str, list[tuple[int, Spread]]] = {}
    for name in metrics:
        by_step: dict[int, list[float]] = {}
        for result in results:
            for entry in result.metrics:
                value = entry.get(name)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    by_step.setdefault(int(entry["step"]), []).append(float(value))
        if by_step:
            curves[name] = [(step, spread(values)) for step, values in sorted(by_step.items())]
    return curves


def window(steps: int) -> int:
    """How many steps the "first" and "last" training windows average: a quarter of the run, at least one."""
    return max(1, steps // 4)


def training_windows(results: Sequence[PointResult], metrics: Sequence[str] = CURVE_METRICS
                     ) -> dict[str, dict[str, Spread]]:
    """Per metric, the spread over runs of each run's mean over its first and its last `window(steps)` steps: the
    trend SPEC 4 describes (RoC: tool errors in correct trajectories keep falling, responses get shorter)."""
    windows: dict[str, dict[str, Spread]] = {}
    for name in metrics:
        firsts, lasts = [], []
        for result in results:
            values = [float(e[name]) for e in result.metrics if isinstance(e.get(name), (int, float))]
            if values:
                size = window(len(values))
                firsts.append(float(np.mean(values[:size])))
                lasts.append(float(np.mean(values[-size:])))
        if firsts:
            windows[name] = {"first": spread(firsts), "last": spread(lasts)}
    return windows


def aggregate(results: Sequence[PointResult], over: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per group: its runs' names, held-out figures, step curves and first/last training windows."""
    return {group: {"runs": [r.point.name for r in members], "heldout": heldout_figures(members),
                    "curves": step_curves(members), "windows": training_windows(members)}
            for group, members in groups(results, over).items()}


def to_jsonable(value: Any) -> Any:
    """`aggregate`'s output with Spreads as dicts and (step, Spread) pairs as lists, for report.json."""
    if isinstance(value, Spread):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: to_jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item) for item in value]
    return value
