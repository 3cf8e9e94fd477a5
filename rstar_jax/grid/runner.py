"""Running a grid's points, each in its own process, resumably and exclusively (DESIGN "Everything is a gin
parameter": gin is global state, so one process per point keeps every run's bindings apart).

A point's run directory is GRID/points/NAME/. It is *finished* when SUMMARY_FILE (its held-out evaluation, written
last and atomically) exists, *interrupted* when it holds POINT_FILE (the point's bindings, model and the grid's base
gin settings) but no summary (the point's command then resumes from its last orbax checkpoint: experiments.train's
resume), and *new* otherwise. A rerun of the grid skips finished points, resumes interrupted ones and starts new
ones; a run directory that holds a run of other settings (bindings, model or base gin) is refused, not mixed in.

Whoever runs a point (this process's loop, `run_points`, or a SLURM array task, `rstar_jax.grid.slurm`) goes through
`run_point`: it first takes the point's exclusive claim (`rstar_jax.grid.claims`: atomic, with its job id and a
heartbeat refreshed while the point runs), so two workers never run one point, a point running elsewhere is left to
its worker ("busy"), and a dead worker's point is taken over once its heartbeat is stale.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from rstar_jax.console import say
from rstar_jax.files import atomic_write_text
from rstar_jax.grid.claims import HEARTBEAT_S, STALE_AFTER_S, Heartbeat, current_claim, try_claim
from rstar_jax.grid.points import GridError, Point
from rstar_jax.processes import killed_with_caller
from rstar_jax.train.metrics import METRICS_FILE, read_metrics

POINTS_DIR = "points"
POINT_FILE = "point.json"
SUMMARY_FILE = "summary.json"
Status = Literal["new", "interrupted", "finished"]
Outcome = Literal["skipped", "finished", "failed", "busy"]
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


def record_point(directory: str | Path, point: Point, base: Mapping[str, Any] | None = None) -> None:
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


@dataclasses.dataclass(frozen=True)
class ClaimTiming:
    """How often a running point's claim is refreshed, and how old a heartbeat must be for the claim to be stale
    (taken over by the next worker). The timeout must exceed the refresh interval by far, and the workers' clocks
    must agree within much less than it."""

    heartbeat_s: float = HEARTBEAT_S
    stale_after_s: float = STALE_AFTER_S


@dataclasses.dataclass
class GridOutcome:
    """What a pass over the grid did: point names skipped (already finished), run to the end, failed, and left to
    the other worker that holds their claim (busy)."""

    skipped: list[str] = dataclasses.field(default_factory=list)
    finished: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    busy: list[str] = dataclasses.field(default_factory=list)

    def add(self, name: str, outcome: Outcome) -> None:
        getattr(self, outcome).append(name)


def run_point(point: Point, grid_dir: str | Path, command: PointCommand, base: Mapping[str, Any] | None = None,
              env: Mapping[str, str] | None = None, job_id: str | None = None, timing: ClaimTiming = ClaimTiming(),
              where: str | None = None) -> Outcome:
    """Run (or resume) one point as `command(point, run_dir)` in a subprocess (output passed through, killed with
    this process) under its exclusive claim for `job_id` (default: this process, `claims.local_job_id`), refreshed
    every `timing.heartbeat_s` while it runs; the subprocess is killed if the claim is lost meanwhile. Returns
    "skipped" (finished before), "busy" (another worker holds it), "finished" or "failed". GridError (before
    anything runs) if its directory holds a run of other settings (`record_point`)."""
    directory = run_dir(grid_dir, point)
    where = where or point.name
    record_point(directory, point, base)
    if point_status(directory) == "finished":
        say(f"{where}: finished before, skipped")
        return "skipped"
    claim = try_claim(directory, job_id, timing.stale_after_s)
    if claim is None:
        holder = current_claim(directory)
        say(f"{where}: running elsewhere ({holder.describe() if holder else 'released just now'}), left to it")
        return "busy"
    try:
        if claim.took_over is not None:
            say(f"{where}: taking over from {claim.took_over.describe()}")
        status = point_status(directory)
        if status == "finished":  # its last worker finished it between our look and our claim
            say(f"{where}: finished before, skipped")
            return "skipped"
        steps = len(read_metrics(directory / METRICS_FILE))
        say(f"{where}: {'resuming after ' + str(steps) + ' logged steps' if status == 'interrupted' else 'starting'}"
            f" ({'; '.join(point.bindings)}; model {point.model})")
        process = subprocess.Popen(killed_with_caller(command(point, directory)),
                                   env=None if env is None else dict(env))
        try:
            with Heartbeat(claim, timing.heartbeat_s, on_lost=process.kill) as heartbeat:
                returncode = process.wait()
        except BaseException:
            process.kill()
            process.wait()
            raise
        if heartbeat.lost:
            holder = current_claim(directory)
            say(f"{where}: FAILED: its claim was taken over by {holder.describe() if holder else 'another worker'};"
                " stopped")
            return "failed"
        if returncode == 0 and point_status(directory) == "finished":
            return "finished"
        say(f"{where}: FAILED (exit status {returncode}); its log is in {directory}")
        return "failed"
    finally:
        if not claim.lost:
            claim.release()


def run_points(points: Sequence[Point], grid_dir: str | Path, command: PointCommand,
               base: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
               timing: ClaimTiming = ClaimTiming()) -> GridOutcome:
    """The local executor: every point not yet finished, one after another in this process (`run_point`); a
    failing point is reported and the others still run. `base`: the settings every point shares, recorded with
    each (`record_point`) so that a rerun with other ones is refused, not mixed in."""
    outcome = GridOutcome()
    for index, point in enumerate(points, 1):
        outcome.add(point.name, run_point(point, grid_dir, command, base, env, timing=timing,
                                          where=f"[{index}/{len(points)}] {point.name}"))
    return outcome
