"""PNG figures of a grid report: per-step training curves of each group (mean, with a band of one standard deviation
over its runs) and held-out figures before and after RL (bars, with the standard deviation as error bars).

The curves are SPEC 4's Figure 4 in miniature: accuracy, tool-error ratio among correct trajectories, response
length and tool calls per step. matplotlib with the Agg backend, as `rstar_jax.train.plots` sets it up.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from matplotlib.ticker import MaxNLocator

from rstar_jax.train.plots import plt

CURVE_TITLES = {"accuracy": "training accuracy", "tool_error_ratio_correct": "tool-error ratio in correct",
                "response_length": "response length (tokens)", "tool_calls": "tool calls per trajectory"}
BAR_FIGURES = (("sampled/accuracy", "held-out accuracy at T=1 (avg@k)"),
               ("greedy/accuracy", "held-out accuracy, greedy"),
               ("sampled/tool_error_ratio_correct", "held-out tool-error ratio in correct"),
               ("sampled/response_length", "held-out response length"))


def plot_curves(report: Mapping[str, Mapping[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """One panel per training metric (SPEC 4 Fig. 4), one line per group; None when no group logged a step."""
    names = [name for name in CURVE_TITLES if any(name in group["curves"] for group in report.values())]
    if not names:
        return None
    columns = 2 if len(names) > 1 else 1
    rows = (len(names) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.5 * rows), squeeze=False)
    for panel, name in zip(axes.flat, names):
        for group, data in report.items():
            points = data["curves"].get(name)
            if not points:
                continue
            steps = np.array([step for step, _ in points])
            means = np.array([value.mean for _, value in points])
            line, = panel.plot(steps, means, marker="o" if len(steps) < 40 else None, markersize=3, label=group)
            sds = np.array([value.sd if value.sd is not None else np.nan for _, value in points])
            if np.isfinite(sds).any():
                panel.fill_between(steps, means - sds, means + sds, color=line.get_color(), alpha=0.15)
        panel.set_title(CURVE_TITLES[name])
        panel.set_xlabel("step")
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
        panel.grid(alpha=0.3)
    for panel in list(axes.flat)[len(names):]:
        panel.axis("off")
    axes.flat[0].legend(fontsize=7)
    _title(figure, title)
    return _save(figure, path)


def plot_heldout(report: Mapping[str, Mapping[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Bars of held-out figures (SPEC 7) per group, start model beside trained model; None without any."""
    figures = [(key, label) for key, label in BAR_FIGURES if any(key in g["heldout"] for g in report.values())]
    if not figures:
        return None
    groups = list(report)
    width = max(6.0, 0.6 * len(groups) + 2)
    figure, axes = plt.subplots(len(figures), 1, figsize=(width, 3.2 * len(figures)), squeeze=False)
    positions = np.arange(len(groups))
    for panel, (key, label) in zip(axes.flat, figures):
        for offset, when in ((-0.2, "start"), (0.2, "after")):
            spreads = [report[group]["heldout"].get(key, {}).get(when) for group in groups]
            means = [value.mean if value else np.nan for value in spreads]
            errors = [value.sd if value and value.sd is not None else 0.0 for value in spreads]
            panel.bar(positions + offset, means, 0.4, yerr=errors if any(errors) else None, capsize=3,
                      label="start model" if when == "start" else "after RL")
        panel.set_title(label)
        panel.set_xticks(positions, groups, rotation=30 if len(groups) > 3 else 0, ha="right" if len(groups) > 3
                         else "center", fontsize=7)
        panel.grid(alpha=0.3, axis="y")
    axes.flat[0].legend(fontsize=7)
    _title(figure, title)
    return _save(figure, path)


TITLE_CHARS_PER_INCH = 10  # of the default 12-point title: a line this long (or shorter) fits the figure's width


def _title(figure: Any, title: str) -> None:
    """`title` above the panels, wrapped to the figure's width (a long grid title was cut off at both edges), and
    the panels laid out below its lines."""
    lines = textwrap.wrap(title, int(figure.get_figwidth() * TITLE_CHARS_PER_INCH)) or [""]
    figure.suptitle("\n".join(lines))
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.25 * len(lines) / figure.get_figheight()))


def _save(figure: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
