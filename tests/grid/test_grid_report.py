"""The grid report's numbers (rstar_jax/grid/aggregate.py, report.py) against means and spreads computed by hand from
fake run folders: two arms x three seeds, held-out summaries and per-step metrics, one run unfinished; and that a
long title stays inside its figure (plots.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rstar_jax.grid.aggregate import aggregate, load_results, spread, window
from rstar_jax.grid.axes import seed_axis
from rstar_jax.grid.plots import _title
from rstar_jax.grid.points import Axis, AxisValue, expand
from rstar_jax.grid.report import cell, write_report
from rstar_jax.grid.runner import POINT_FILE, SUMMARY_FILE, run_dir, write_json
from rstar_jax.train.plots import plt

ARMS = Axis("selector", (AxisValue("roc_paper", ("make_selector.algorithm = 'roc'",)),
                         AxisValue("grpo", ("make_selector.algorithm = 'grpo'",))))
# Held-out T=1 accuracy (start, after) and tool-error ratio in correct trajectories after RL, per arm and seed.
HELDOUT = {"roc_paper": [(0.1, 0.2, 0.10), (0.2, 0.2, 0.05), (0.3, 0.5, 0.00)],
           "grpo": [(0.1, 0.1, 0.20), (0.2, 0.3, 0.10), (0.3, 0.2, 0.30)]}


def _sampled(accuracy: float, error_ratio: float) -> dict:
    return {"problems": 4, "samples": 2, "temperature": 1.0, "accuracy": accuracy, "pass_at_k": accuracy,
            "tool_error_ratio_correct": error_ratio, "tool_error_ratio_all": 0.5, "tool_calls": 1.0,
            "response_length": 100.0}


def _fake_grid(root: Path, unfinished: str | None = None) -> list:
    """Runs of 8 steps; run (arm a, seed s) logs accuracy = a + 0.01 * s * step and tool_error_ratio_correct =
    0.5 - 0.05 * step (a = 0.1 for roc_paper, 0.2 for grpo)."""
    points = expand([ARMS, seed_axis([0, 1, 2])], "model")
    for point in points:
        arm, seed = point.labels[0][1], int(point.labels[1][1].removeprefix("seed"))
        directory = run_dir(root, point)
        directory.mkdir(parents=True)
        write_json(directory / POINT_FILE, point.to_json())
        base = 0.1 if arm == "roc_paper" else 0.2
        with (directory / "metrics.jsonl").open("w") as handle:
            for step in range(1, 9):
                handle.write(json.dumps({"step": step, "accuracy": base + 0.01 * seed * step,
                                         "tool_error_ratio_correct": 0.5 - 0.05 * step, "response_length": 100 + step,
                                         "tool_calls": 1.0, "seconds": {"rollout": 1.0}}) + "\n")
        if point.name == unfinished:
            continue
        start, after, errors = HELDOUT[arm][seed]
        write_json(directory / SUMMARY_FILE, {"start": {"sampled": _sampled(start, 0.2)},
                                              "after": {"sampled": _sampled(after, errors)}})
    return points


def _sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_spread_is_mean_sample_sd_and_range() -> None:
    result = spread([0.1, 0.2, 0.6])
    assert result.mean == pytest.approx(0.3) and result.sd == pytest.approx(math.sqrt(0.07))
    assert (result.low, result.high, result.n) == (0.1, 0.6, 3)
    assert spread([0.4]).sd is None
    assert cell(result, percent=True) == "30.0% ± 26.5" and cell(spread([12.25]), percent=False) == "12.2"


def test_groups_average_over_seeds_as_computed_by_hand(tmp_path: Path) -> None:
    points = _fake_grid(tmp_path)
    report = aggregate(load_results(tmp_path, points), over=["seed"])
    assert list(report) == ["roc_paper", "grpo"]
    for arm, rows in HELDOUT.items():
        figures = report[arm]["heldout"]
        starts, afters, errors = ([row[i] for row in rows] for i in range(3))
        assert figures["sampled/accuracy"]["start"].mean == pytest.approx(sum(starts) / 3)
        assert figures["sampled/accuracy"]["after"].mean == pytest.approx(sum(afters) / 3)
        assert figures["sampled/accuracy"]["after"].sd == pytest.approx(_sd(afters))
        changes = [a - s for s, a in zip(starts, afters)]
        assert figures["sampled/accuracy"]["change"].mean == pytest.approx(sum(changes) / 3)
        assert figures["sampled/accuracy"]["change"].sd == pytest.approx(_sd(changes))
        assert figures["sampled/tool_error_ratio_correct"]["after"].mean == pytest.approx(sum(errors) / 3)
        assert figures["sampled/tool_error_ratio_correct"]["start"].sd == pytest.approx(0.0)
        assert "greedy/accuracy" not in figures, "no run evaluated greedily"
    curve = dict(report["grpo"]["curves"]["accuracy"])
    assert sorted(curve) == list(range(1, 9))
    at_step_4 = [0.2 + 0.01 * seed * 4 for seed in range(3)]
    assert curve[4].mean == pytest.approx(sum(at_step_4) / 3) and curve[4].sd == pytest.approx(_sd(at_step_4))
    assert window(8) == 2
    # Each run's mean over steps 1-2 and 7-8, then mean and sd over seeds.
    firsts = [0.1 + 0.01 * seed * 1.5 for seed in range(3)]
    lasts = [0.1 + 0.01 * seed * 7.5 for seed in range(3)]
    windows = report["roc_paper"]["windows"]["accuracy"]
    assert windows["first"].mean == pytest.approx(sum(firsts) / 3) and windows["first"].sd == pytest.approx(_sd(firsts))
    assert windows["last"].mean == pytest.approx(sum(lasts) / 3) and windows["last"].sd == pytest.approx(_sd(lasts))
    errors = report["roc_paper"]["windows"]["tool_error_ratio_correct"]
    assert errors["first"].mean == pytest.approx(0.425) and errors["last"].mean == pytest.approx(0.125)
    assert errors["last"].sd == pytest.approx(0.0)


def test_the_report_leaves_out_unfinished_runs_and_writes_its_files(tmp_path: Path) -> None:
    points = _fake_grid(tmp_path / "grid", unfinished="grpo__seed2")
    results = load_results(tmp_path / "grid", points)
    path = write_report(results, tmp_path / "report", "Ablation", over=["seed"], preamble=["Command: `x`"])
    text = path.read_text()
    assert text.startswith("# Ablation\n\nCommand: `x`")
    assert "5 of 6 runs finished" in text and "4 held-out problems, each solved 2 times at T=1" in text
    afters = [0.1, 0.3]  # grpo's two finished seeds
    grpo_row = next(line for line in text.splitlines() if line.startswith("| grpo | 2 |"))
    assert f"| {100 * sum(afters) / 2:.1f}% ± {100 * _sd(afters):.1f} |" in grpo_row
    assert "| grpo__seed2 |" in text and "not finished" in text
    for name in ("curves.png", "heldout.png", "report.json"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    stored = json.loads((tmp_path / "report" / "report.json").read_text())
    assert stored["grpo"]["runs"] == ["grpo__seed0", "grpo__seed1"]
    assert stored["grpo"]["heldout"]["sampled/accuracy"]["after"]["n"] == 2


def test_a_long_title_is_wrapped_inside_the_figure() -> None:
    # A report's title (the ablation's, 82 characters) was cut off at both edges of a 6-inch figure.
    title = "RoC ablation from the demo's SFT models: GRPO-RoC vs penalty rewards vs plain GRPO"
    figure, _ = plt.subplots(1, 1, figsize=(6, 3))
    try:
        _title(figure, title)
        text = figure.get_suptitle()
        assert text.count("\n") == 1 and text.replace("\n", " ") == title
        box = figure._suptitle.get_window_extent(figure.canvas.get_renderer())
        assert 0 <= box.x0 and box.x1 <= figure.bbox.x1
    finally:
        plt.close(figure)
