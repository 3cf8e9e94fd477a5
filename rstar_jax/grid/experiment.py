"""What experiments/sweep.py and experiments/ablate.py share: their common arguments, checking every point's gin
configuration before any run starts, running the points resumably under their exclusive claims, here one after
another (`--executor local`: `runner.run_points`, one sandbox server for all points) or as one SLURM job array
(`--executor slurm`: `slurm.run_points_on_slurm`), and writing the report (SPEC 4's Figure 4 measures and SPEC 7's
held-out accuracy).

Each point runs as `python -m POINT_MODULE --model M --out RUN --sandbox_url U --start_eval_cache C --gin_file ...
--gin_param ...` (experiments/grid_point.py: RL through experiments.train, then the held-out evaluation).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Sequence

import gin

from rstar_jax.console import log_to, say
from rstar_jax.eval.heldout import HeldOutEval
from rstar_jax.gin_setup import GinConfigError, parse_gin
from rstar_jax.grid.aggregate import load_results
from rstar_jax.grid.point_eval import START_EVAL_DIR
from rstar_jax.grid.points import GridError, Point
from rstar_jax.grid.report import write_report
from rstar_jax.grid.runner import ClaimTiming, point_status, run_dir, run_points, write_json
from rstar_jax.grid.slurm import add_slurm_arguments, run_points_on_slurm, slurm_settings
from rstar_jax.processes import running_sandbox
from rstar_jax.train.rl_setup import rl_setup

POINT_MODULE = "experiments.grid_point"


def add_grid_arguments(parser: argparse.ArgumentParser, default_out: str, default_gin: Sequence[str]) -> None:
    """The arguments every grid command takes (output folders, gin base, sandbox, report-only)."""
    parser.add_argument("--out", default=default_out, help="grid folder: points/NAME/ per run, start_eval/, the "
                        "report (an existing folder resumes)")
    parser.add_argument("--report_dir", default=None, help="where report.md, report.json and the PNGs go "
                        "(default: --out)")
    parser.add_argument("--gin_file", action="append", default=None,
                        help=f"the base gin files of every point (default: {', '.join(default_gin)})")
    parser.add_argument("--gin_param", action="append", default=[], help="base bindings of every point (the "
                        "grid's own bindings come after and win)")
    parser.add_argument("--sandbox_url", default=None, help="a running sandbox server (default: start one; with "
                        "--executor slurm each point starts its own)")
    parser.add_argument("--report_only", action="store_true", help="run nothing; write the report of what "
                        "has finished")
    parser.add_argument("--executor", choices=("local", "slurm"), default="local", help="local: the points one "
                        "after another in this process's children; slurm: one SLURM array task per unfinished point "
                        "(submitit; --slurm_* below), waited for")
    parser.add_argument("--claim_timeout_s", type=float, default=ClaimTiming.stale_after_s, help="a point's claim "
                        "whose heartbeat (every %g s while it runs) is older than this is stale: its worker died, "
                        "and the next one takes the point over" % ClaimTiming.heartbeat_s)
    add_slurm_arguments(parser)


def check_points(points: Sequence[Point], gin_files: Sequence[str], base_params: Sequence[str]) -> None:
    """Parse each point's gin configuration and build its RL setup (`rl_setup`) and evaluation (SPEC 4-5, 7), so a
    misspelled or invalid binding, or a missing model folder, stops the grid before any run; GridError naming the
    point. Needs the configurables registered (the calling script imports the point command's module)."""
    for point in points:
        if not (Path(point.model) / "config.json").is_file():
            raise GridError(f"point {point.name}: {point.model} is not a model folder (no config.json)")
        try:
            parse_gin(gin_files, [*base_params, *point.bindings])
            rl_setup(), HeldOutEval()
        except (GinConfigError, ValueError, TypeError) as exc:
            raise GridError(f"point {point.name}: {exc}") from exc
        finally:
            gin.clear_config()


def point_command(point: Point, directory: Path, gin_files: Sequence[str], base_params: Sequence[str],
                  sandbox_url: str | None, cache_dir: Path) -> list[str]:
    """The subprocess command line that runs (or resumes) one point in `directory` (without `sandbox_url` the point
    starts its own sandbox server)."""
    command = [sys.executable, "-m", POINT_MODULE, "--model", point.model, "--out", str(directory),
               "--start_eval_cache", str(cache_dir)]
    command += ["--sandbox_url", sandbox_url] if sandbox_url else []
    command += [arg for name in gin_files for arg in ("--gin_file", name)]
    return command + [arg for param in (*base_params, *point.bindings) for arg in ("--gin_param", param)]


def run_experiment(points: Sequence[Point], args: argparse.Namespace, default_gin: Sequence[str], title: str,
                   script: str, over: Sequence[str] = (), preamble: Sequence[str] = ()) -> int:
    """Check every point, run those not finished (skipping finished ones, resuming interrupted ones) and write the
    report (SPEC 4 Fig. 4 measures, SPEC 7 held-out accuracy) grouped without the axes in `over`; `script` is the
    calling module, for the command line the report quotes. Returns the exit status (1 if a point failed)."""
    gin_files = list(args.gin_file or default_gin)
    out = Path(args.out)
    check_points(points, gin_files, args.gin_param)
    command_line = "python -m " + " ".join(shlex.quote(arg) for arg in [script, *sys.argv[1:]])
    out.mkdir(parents=True, exist_ok=True)
    with log_to(out / "grid.log"):
        write_json(out / "grid.json", {"command": command_line, "gin_files": gin_files, "gin_params": args.gin_param,
                                       "points": [point.to_json() for point in points]})
        pending = [point for point in points if point_status(run_dir(out, point)) != "finished"]
        failed: list[str] = []
        say(f"{title}: {len(points)} runs in {out / 'points'}, {len(points) - len(pending)} finished before")
        if not args.report_only:
            base = {"gin_files": gin_files, "gin_params": args.gin_param}
            timing = ClaimTiming(stale_after_s=args.claim_timeout_s)
            with contextlib.ExitStack() as stack:
                url = args.sandbox_url
                if url is None and pending and args.executor == "local":
                    url = stack.enter_context(running_sandbox(["--workers", "2"])).url

                def command(point: Point, directory: Path) -> list[str]:
                    return point_command(point, directory, gin_files, args.gin_param, url, out / START_EVAL_DIR)

                if args.executor == "slurm":
                    outcome = run_points_on_slurm(points, out, command, base, slurm_settings(args), timing=timing,
                                                  name=f"{script.split('.')[-1]}-{out.name}")
                else:
                    outcome = run_points(points, out, command, base, timing=timing)
            failed = outcome.failed
            if outcome.busy:
                say(f"left to the workers that hold them: {', '.join(outcome.busy)}")
        results = load_results(out, points)
        report = write_report(results, args.report_dir or out, title, over,
                              [f"Command: `{command_line}`", "", f"Base gin files: {', '.join(gin_files)}.",
                               *preamble])
        say(f"report: {report} ({sum(r.summary is not None for r in results)} of {len(points)} runs finished"
            + (f"; FAILED: {', '.join(failed)}" if failed else "") + ")")
    return 1 if failed else 0
