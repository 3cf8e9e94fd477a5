"""The SLURM executor of a grid (`--executor slurm` of experiments.sweep and experiments.ablate): every unfinished
point is one task of a submitit job array; each task claims its point and runs the same point command as the local
executor (`runner.run_point`), then this process waits for the array and the caller writes the report.

Tasks run on the compute nodes with this interpreter (`sys.executable`), this checkout and the grid folder at the
same paths (a shared file system), and the submitting environment (sbatch's default `--export=ALL`). submitit's
files (the pickled tasks, their stdout / stderr and results) go to GRID/slurm/<job id>/. A preempted or timed-out
task is requeued by submitit (`Checkpointable`) and resumes its point from the last checkpoint under the same job id,
which takes its own claim over. Waiting needs only `squeue` (no accounting database): a task is done when its result
file exists, or when the array has left the queue (a task without a result then died: "failed", its log named).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

from rstar_jax.console import say
from rstar_jax.grid.points import Point
from rstar_jax.grid.runner import (ClaimTiming, GridOutcome, Outcome, PointCommand, point_status, record_point,
                                   run_dir, run_point)

SLURM_DIR = "slurm"


def _import_submitit() -> ModuleType:
    """submitit configures logging when imported (logging.config.dictConfig), which closes every logging handler the
    process already has (an application's log file; absl's handler then closes the stream it writes to, which broke
    pytest's captured stderr). Imported with SUBMITIT_LOG_LEVEL=NOCONFIG instead (unless set), its logger gets a
    warnings-to-stderr handler of its own. The tasks import submitit themselves, configured as usual."""
    if "submitit" in sys.modules or "SUBMITIT_LOG_LEVEL" in os.environ:
        return importlib.import_module("submitit")
    os.environ["SUBMITIT_LOG_LEVEL"] = "NOCONFIG"
    try:
        module = importlib.import_module("submitit")
    finally:
        del os.environ["SUBMITIT_LOG_LEVEL"]
    logger = logging.getLogger("submitit")
    logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.WARNING)
    return module


submitit = _import_submitit()


@dataclasses.dataclass(frozen=True)
class SlurmSettings:
    """What each array task asks SLURM for. `cluster`: submitit's executor, "slurm", or "local" (submitit's local
    executor: the same code path on this machine without SLURM)."""

    partition: str | None = None
    time_min: int = 240
    cpus_per_task: int = 2
    mem_gb: float | None = None
    gpus_per_task: int = 0
    parallel: int | None = None
    setup: tuple[str, ...] = ()
    poll_s: float = 10.0
    cluster: str = "slurm"

    def parameters(self, name: str) -> dict[str, Any]:
        """submitit.AutoExecutor.update_parameters' arguments."""
        parameters: dict[str, Any] = {"name": name, "timeout_min": self.time_min, "cpus_per_task": self.cpus_per_task,
                                      "nodes": 1, "tasks_per_node": 1}
        if self.mem_gb is not None:
            parameters["mem_gb"] = self.mem_gb
        if self.gpus_per_task:
            parameters["gpus_per_node"] = self.gpus_per_task
        if self.partition:
            parameters["slurm_partition"] = self.partition
        if self.parallel:
            parameters["slurm_array_parallelism"] = self.parallel
        if self.setup:
            parameters["slurm_setup"] = list(self.setup)
        return parameters


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    """The --slurm_* arguments of the grid commands (used with --executor slurm)."""
    group = parser.add_argument_group("--executor slurm (one array task per unfinished point, through submitit)")
    group.add_argument("--slurm_partition", default=None, help="partition (default: the cluster's default)")
    group.add_argument("--slurm_time_min", type=int, default=240, help="time limit of each task, minutes (a task "
                       "that hits it is requeued and resumes its point from its last checkpoint)")
    group.add_argument("--slurm_cpus", type=int, default=2, help="CPUs per task")
    group.add_argument("--slurm_mem_gb", type=float, default=None, help="memory per task (default: the cluster's)")
    group.add_argument("--slurm_gpus", type=int, default=0, help="GPUs per task")
    group.add_argument("--slurm_parallel", type=int, default=None, help="at most this many tasks at once")
    group.add_argument("--slurm_setup", action="append", default=[], help="a shell line each task runs first "
                       "(e.g. 'module load cuda'; repeatable)")
    group.add_argument("--slurm_poll_s", type=float, default=10.0, help="how often to look at the array while "
                       "waiting, seconds")


def slurm_settings(args: argparse.Namespace) -> SlurmSettings:
    """The settings the --slurm_* arguments give."""
    return SlurmSettings(args.slurm_partition, args.slurm_time_min, args.slurm_cpus, args.slurm_mem_gb,
                         args.slurm_gpus, args.slurm_parallel, tuple(args.slurm_setup), args.slurm_poll_s)


class PointTask(submitit.helpers.Checkpointable):
    """One array task: run `point` (its claim under this task's job id, then `command`) as the local executor
    would; returns the outcome ("finished", "failed", "skipped", "busy"). Requeued whole on preemption."""

    def __init__(self, point: Point, grid_dir: str | Path, command: Sequence[str], base: Mapping[str, Any] | None,
                 env: Mapping[str, str] | None, timing: ClaimTiming) -> None:
        self.point, self.grid_dir, self.command = point.to_json(), str(grid_dir), list(command)
        self.base, self.env, self.timing = dict(base or {}), None if env is None else dict(env), timing

    def __call__(self) -> Outcome:
        point = Point.from_json(self.point)
        job_id = submitit.JobEnvironment().job_id
        return run_point(point, self.grid_dir, lambda _point, _directory: self.command, self.base, self.env, job_id,
                         self.timing, where=f"[task {job_id}] {point.name}")


def in_queue(job_id: str) -> bool:
    """Whether SLURM still lists any task of job (array) `job_id`; a failing squeue counts as yes (transient)."""
    try:
        result = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if result.returncode != 0:
        return "invalid job id" not in result.stderr.lower()
    return bool(result.stdout.strip())


def _outcome(job: submitit.Job, point: Point) -> Outcome:
    if not job.paths.result_pickle.exists():
        say(f"{point.name}: FAILED: task {job.job_id} ended without a result (killed?); its log: {job.paths.stderr}")
        return "failed"
    try:
        return job.result()
    except Exception as exc:  # noqa: BLE001 - submitit's FailedJobError carries the task's traceback
        tail = "".join(traceback.format_exception_only(exc)).strip().splitlines()[-3:]
        say(f"{point.name}: FAILED in task {job.job_id}: {' / '.join(tail)}; its log: {job.paths.stderr}")
        return "failed"


def run_points_on_slurm(points: Sequence[Point], grid_dir: str | Path, command: PointCommand,
                        base: Mapping[str, Any] | None = None, settings: SlurmSettings = SlurmSettings(),
                        env: Mapping[str, str] | None = None, timing: ClaimTiming = ClaimTiming(),
                        name: str = "rstar-grid") -> GridOutcome:
    """The SLURM executor: check every point's folder (`record_point`: other settings are refused before anything is
    submitted), submit the unfinished ones as one job array of `PointTask`s, wait until every task is done and
    return what each did (a task that died without a result: "failed")."""
    outcome, pending = GridOutcome(), []
    for point in points:
        directory = run_dir(grid_dir, point)
        record_point(directory, point, base)
        if point_status(directory) == "finished":
            say(f"{point.name}: finished before, skipped")
            outcome.add(point.name, "skipped")
        else:
            pending.append(point)
    if not pending:
        return outcome
    executor = submitit.AutoExecutor(folder=Path(grid_dir) / SLURM_DIR / "%j", cluster=settings.cluster)
    executor.update_parameters(**settings.parameters(name))
    tasks = [PointTask(point, grid_dir, command(point, run_dir(grid_dir, point)), base, env, timing)
             for point in pending]
    jobs = executor.submit_array(tasks)
    with contextlib.suppress(OSError):
        (Path(grid_dir) / SLURM_DIR / "%j").rmdir()  # submitit's staging folder, empty once the tasks have ids
    array = str(jobs[0].job_id).split("_")[0]
    say(f"submitted {len(jobs)} points as {settings.cluster} job array {array} (task logs in "
        f"{Path(grid_dir) / SLURM_DIR}/{array}_*/); waiting for it")
    remaining = dict(zip(range(len(jobs)), zip(pending, jobs)))
    gone_since: float | None = None
    while remaining:
        for index, (point, job) in list(remaining.items()):
            if job.paths.result_pickle.exists() or (settings.cluster != "slurm" and job.done()):
                result = _outcome(job, point)
                outcome.add(point.name, result)
                say(f"{point.name}: {result} (task {job.job_id}; {len(jobs) - len(remaining) + 1}/{len(jobs)} done)")
                del remaining[index]
        if not remaining:
            break
        if settings.cluster == "slurm" and not in_queue(array):
            # the array left the queue: tasks without a result died (one more look for results written late)
            if gone_since is not None and time.monotonic() - gone_since > settings.poll_s:
                for point, job in remaining.values():
                    outcome.add(point.name, _outcome(job, point))
                break
            gone_since = gone_since or time.monotonic()
        time.sleep(min(settings.poll_s, 2.0) if gone_since else settings.poll_s)
    order = {point.name: index for index, point in enumerate(points)}
    for names in (outcome.finished, outcome.failed, outcome.busy):
        names.sort(key=order.__getitem__)  # in the grid's order, not the order the tasks ended in
    return outcome
