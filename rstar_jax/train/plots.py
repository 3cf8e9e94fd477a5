"""PNG plots of a run's metrics.jsonl, written at the end of a run (SFT or RL): one figure per group of metrics.

matplotlib with the Agg backend (no display needed). Only metrics present in the log are drawn, so the same function
serves SFT (loss, learning rate) and RL (accuracy, tool errors, lengths, seconds per phase).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

PANELS: dict[str, tuple[str, ...]] = {
    "accuracy": ("accuracy", "mean_reward"),
    "tool_errors": ("tool_error_ratio_correct", "tool_error_ratio_all", "p_format"),
    "lengths": ("response_length",),
    "tools_and_turns": ("tool_calls", "turns"),
    "optimisation": ("loss", "grad_norm", "clipped_fraction", "approx_kl"),
    "learning_rate": ("learning_rate",),
    "logprob_gap": ("logprob_gap",),
    "groups": ("groups_seen", "groups_kept"),
}


def _series(entries: Sequence[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    points = [(entry["step"], entry[name]) for entry in entries if isinstance(entry.get(name), (int, float))]
    return [step for step, _ in points], [float(value) for _, value in points]


def plot_metrics(entries: Sequence[dict[str, Any]], out_dir: str | Path, title: str = "") -> list[Path]:
    """Write OUT_DIR/<panel>.png for every panel with data (plus seconds.png for per-phase times); returns paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    panels = dict(PANELS)
    phases = sorted({phase for entry in entries for phase in entry.get("seconds", {})})
    flattened = [{**entry, **{f"seconds/{p}": v for p, v in entry.get("seconds", {}).items()}} for entry in entries]
    if phases:
        panels["seconds"] = tuple(f"seconds/{phase}" for phase in phases)
    for panel, names in panels.items():
        drawn = [(name, *_series(flattened, name)) for name in names]
        drawn = [(name, steps, values) for name, steps, values in drawn if steps]
        if not drawn:
            continue
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for name, steps, values in drawn:
            axes.plot(steps, values, marker="o" if len(steps) < 40 else None, markersize=3, label=name)
        axes.set_xlabel("step")
        axes.set_title(f"{title} {panel}".strip())
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = out_dir / f"{panel}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
