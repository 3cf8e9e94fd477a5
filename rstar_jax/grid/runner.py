"""Running a grid's points, each in its own process, resumably (DESIGN "Everything is a gin parameter": gin is
global state, so one process per point keeps every run's bindings apart).

A point's run directory is GRID/points/NAME/. It is *finished* when SUMMARY_FILE (its held-out evaluation, written
last and atomically) exists, *interrupted* when it holds POINT_FILE (the point's bindings, model and the grid's base
gin settings) but no summary (the point's command then resumes from its last orbax checkpoint: experiments.train's
resume), and *new* otherwise. A rerun of the grid skips finished points, resumes interrupted ones and starts new
ones; a run directory that holds a run of other settings (bindings, model or base gin) is refused, not mixed in.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from rstar_jax.console import say
from rstar_jax.files import atomic_write_text
from rstar_jax.grid.points import GridError, Point
from rstar_jax.processes import killed_with_caller
from rstar_jax.train.metrics import METRICS_FILE, read_metrics

POINTS_DIR = "points"
POINT_FILE = "point.json"
SUMMARY_FILE = "summary.json"
Status = Literal["new", "interrupted", "finished"]
PointCommand = Callable[[Point, Path], Sequence[str]]


def run_dir(grid_dir: str | Path, point: Point) -> Path:
    """Where `point`'s run lives inside the grid's folder."""
    return Path(grid_dir) / POINTS_DIR / point.name


def point_status(directory: str | Path) -> Status:
    """"finished" (its summary exists), "interrupted" (started: point.json, no summary) or "new"."""
    directory = Path(directory)
    if (directory / SUMMARY_FILE).is_file():
        return "finished"
    if (directory / POINT_FILE).is_file():
        return "interrupted"
    return "new"


def claim(directory: str | Path, point: Point, base: Mapping[str, Any] | None = None) -> None:
    """Record `point` and the grid's `base` settings (gin files and bindings every point shares) in its run directory
    (POINT_FILE); GridError if the directory already holds a run of other bindings, model or base."""
    directory = Path(directory)
    path = directory / POINT_FILE
    record = {**point.to_json(), "base": dict(base or {})}
    if path.is_file():
        stored = json.loads(path.read_text())
        settings = ("bindings", "model", "base")
        if any(stored.get(key) != record[key] for key in settings):
            raise GridError(f"{directory} holds a run of other settings ("
                            + "; ".join(f"{key} {stored.get(key)}" for key in settings) + "), not ("
                            + "; ".join(f"{key} {record[key]}" for key in settings)
                            + "); remove it or use another --out")
        return
    directory.mkdir(parents=True, exist_ok=True)
    write_json(path, record)


def write_json(path: str | Path, data: Mapping) -> Path:
    """Write `data` as JSON atomically (a temporary file renamed over `path`), so a reader never sees half of it."""
    return atomic_write_text(path, json.dumps(data, indent=1) + "\n")


@dataclasses.dataclass
class GridOutcome:
    """What a pass over the grid did: point names skipped (already finished), run to the end, and failed."""

    skipped: list[str] = dataclasses.field(default_factory=list)
    finished: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)


def run_points(points: Sequence[Point], grid_dir: str | Path, command: PointCommand,
               base: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> GridOutcome:
    """Run every point not yet finished, one after another, each as `command(point, run_dir)` in a subprocess
    (output passed through, killed with this process); a failing point is reported and the others still run. `base`: the settings every
    point shares, recorded with each (`claim`) so that a rerun with other ones is refused, not mixed in."""
    outcome = GridOutcome()
    for index, point in enumerate(points, 1):
        directory = run_dir(grid_dir, point)
        status = point_status(directory)
        where = f"[{index}/{len(points)}] {point.name}"
        claim(directory, point, base)
        if status == "finished":
            say(f"{where}: finished before, skipped")
            outcome.skipped.append(point.name)
            continue
        steps = len(read_metrics(directory / METRICS_FILE))
        say(f"{where}: {'resuming after ' + str(steps) + ' logged steps' if status == 'interrupted' else 'starting'}"
            f" ({'; '.join(point.bindings)}; model {point.model})")
        result = subprocess.run(killed_with_caller(command(point, directory)), env=None if env is None else dict(env))
        if result.returncode == 0 and point_status(directory) == "finished":
            outcome.finished.append(point.name)
        else:
            say(f"{where}: FAILED (exit status {result.returncode}); its log is in {directory}")
            outcome.failed.append(point.name)
    return outcome
