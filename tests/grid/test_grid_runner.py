"""Running a grid's points (rstar_jax/grid/runner.py, experiment.py): finished points are skipped, interrupted ones
resumed, a failing point does not stop the others, a run folder of other settings is refused, and every point's gin
configuration and model folder are checked before anything runs. The point commands here are tiny Python scripts
that play a run: they log steps to metrics.jsonl and write summary.json last."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rstar_jax.grid.points import GridError, expand, parse_grid_arg
from rstar_jax.grid.runner import SUMMARY_FILE, point_status, record_point, run_dir, run_points

# argv: run folder, behaviour. "ok": log one more step, then the summary; "crash_once": the first time, log a step
# and die (exit 1); "fail": die at once (exit 3).
FAKE_RUN = r"""
import json, pathlib, sys
out, behaviour = pathlib.Path(sys.argv[1]), sys.argv[2]
metrics = out / "metrics.jsonl"
steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
if behaviour == "fail":
    sys.exit(3)
with metrics.open("a") as handle:
    handle.write(json.dumps({"step": steps + 1, "accuracy": 0.5}) + "\n")
if behaviour == "crash_once" and not (out / "crashed").exists():
    (out / "crashed").write_text("")
    sys.exit(1)
(out / "summary.json").write_text(json.dumps({"resumed_after": steps}))
"""


def _points():
    return expand([parse_grid_arg("RLSettings.seed=[1, 2, 3]")], "model")


def test_a_rerun_skips_finished_points_and_resumes_interrupted_ones(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    points = _points()
    behaviour = {points[0].name: "ok", points[1].name: "crash_once", points[2].name: "fail"}
    calls: list[str] = []

    def command(point, directory: Path) -> list[str]:
        calls.append(point.name)
        return [sys.executable, "-c", FAKE_RUN, str(directory), behaviour[point.name]]

    first = run_points(points, tmp_path, command)
    assert first.finished == [points[0].name] and first.failed == [points[1].name, points[2].name]
    assert [point_status(run_dir(tmp_path, point)) for point in points] == ["finished", "interrupted",
                                                                            "interrupted"]
    behaviour[points[2].name] = "ok"
    calls.clear()
    capsys.readouterr()
    second = run_points(points, tmp_path, command)
    assert second.skipped == [points[0].name] and second.finished == [points[1].name, points[2].name]
    assert calls == [points[1].name, points[2].name], "the finished point is not run again"
    output = capsys.readouterr().out
    assert f"[1/3] {points[0].name}: finished before, skipped" in output
    assert f"[2/3] {points[1].name}: resuming after 1 logged steps" in output
    assert f"[3/3] {points[2].name}: resuming after 0 logged steps" in output
    resumed = json.loads((run_dir(tmp_path, points[1]) / SUMMARY_FILE).read_text())
    assert resumed == {"resumed_after": 1}, "the interrupted point continued from its logged step"
    third = run_points(points, tmp_path, command)
    assert third.skipped == [point.name for point in points] and not third.finished and not third.failed


def test_a_run_folder_holding_other_settings_is_refused(tmp_path: Path) -> None:
    point = _points()[0]
    directory = run_dir(tmp_path, point)
    assert point_status(directory) == "new"
    record_point(directory, point)
    record_point(directory, point)  # the same point again: fine
    assert point_status(directory) == "interrupted"
    other = type(point)(point.name, point.labels, ("RLSettings.seed = 99",), point.model)
    with pytest.raises(GridError, match="holds a run of other settings"):
        record_point(directory, other)
    with pytest.raises(GridError, match="holds a run of other settings"):
        run_points([other], tmp_path, lambda p, d: [sys.executable, "-c", ""])
    with pytest.raises(GridError, match="holds a run of other settings"):
        record_point(directory, point, {"gin_params": ["RLSettings.prompts_per_step = 2"]})
    (directory / SUMMARY_FILE).write_text("{}")
    with pytest.raises(GridError, match="holds a run of other settings"):  # a finished one too: never mixed in
        run_points([point], tmp_path, lambda p, d: [sys.executable, "-c", ""], base={"gin_files": ["other.gin"]})


def test_every_point_is_checked_before_any_run(tmp_path: Path) -> None:
    import experiments.grid_point  # noqa: F401 - registers every configurable a point reads
    from experiments.grid_point import DEFAULT_GIN
    from rstar_jax.grid.experiment import check_points

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    check_points(expand([parse_grid_arg("RLSettings.group_size=[2, 4]")], str(model)), DEFAULT_GIN, [])
    with pytest.raises(GridError, match=r"point RLSettings.group_sise=2: .*doesn't have a parameter named"):
        check_points(expand([parse_grid_arg("RLSettings.group_sise=[2]")], str(model)), DEFAULT_GIN, [])
    with pytest.raises(GridError, match=r"point RLSettings.group_size=1: .*group_size must be >= 2"):
        check_points(expand([parse_grid_arg("RLSettings.group_size=[4, 1]")], str(model)), DEFAULT_GIN, [])
    with pytest.raises(GridError, match="is not a model folder"):
        check_points(expand([parse_grid_arg("RLSettings.seed=[1]")], str(tmp_path / "missing")), DEFAULT_GIN, [])
