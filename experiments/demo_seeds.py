"""The CPU demo over several seeds, and the range of its figures that every demo run is read against (issue 24).

    python -m experiments.demo_seeds --seeds 0 1 2 3 4 [--out runs/demo_seeds] [--parallel 2] [--gin_param ...]
        [--write-range PATH] [--from-runs]

Runs `python -m experiments.demo --out OUT/seedN --seed N` for each seed, each its own process with its console in
OUT/seedN/console.log, and skips seeds whose OUT/seedN/demo_summary.json exists (a rerun resumes; an interrupted
seed resumes from its own checkpoints; stopping this command stops its running demos too). --parallel P runs P at a
time, the i-th pinned to core i (taskset, where installed) and to one thread (XLA_FLAGS, OMP_NUM_THREADS), so two
demos on 2 cores do not fight over both. Then writes the range record (`rstar_jax.eval.seed_range`: each figure's
min, max, mean and per-seed values, and the config's fingerprint) to --write-range, by default
experiments/reports/demo_seeds/range.json, the file `experiments.demo` reads at its end, and table.md beside it (one
row per seed and their mean). --from-runs only aggregates the existing OUT/seedN folders (no training).

One demo takes ~12 min alone on a quiet 2-core machine and ~23 min with a second beside it (README), so 5 seeds with
--parallel 2 take about 70 min.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rstar_jax.console import say
from rstar_jax.eval.seed_range import build_range, compare_with_range, config_fingerprint, seeds_table
from rstar_jax.files import atomic_write_text
from rstar_jax.paths import REPO_ROOT
from rstar_jax.processes import pinned_command, start_logged

RANGE_FILE = REPO_ROOT / "experiments" / "reports" / "demo_seeds" / "range.json"
TABLE_FILE = "table.md"  # beside the range file
SUMMARY_FILE = "demo_summary.json"
CONFIG_FILE = "bound_config.gin"
ONE_THREAD = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
              "OMP_NUM_THREADS": "1"}
POLL_S = 5.0


def seed_dir(out: str | Path, seed: int) -> Path:
    """The demo run folder of `seed`."""
    return Path(out) / f"seed{seed}"


def seed_command(seed: int, out: str | Path, gin_params: Sequence[str], core: int | None
                 ) -> tuple[list[str], dict[str, str]]:
    """The demo's command line for `seed` and its environment. With a `core` (demos side by side): pinned to that
    core where taskset is installed, and one thread, so each demo keeps one core to itself."""
    command = [sys.executable, "-m", "experiments.demo", "--out", str(seed_dir(out, seed)), "--seed", str(seed),
               *(arg for param in gin_params for arg in ("--gin_param", param))]
    if core is None:
        return command, dict(os.environ)
    if shutil.which("taskset"):
        command = pinned_command(command, [core])
    return command, {**os.environ, **ONE_THREAD}


def run_seeds(seeds: Sequence[int], out: str | Path, gin_params: Sequence[str], parallel: int) -> list[int]:
    """Run the demo of every seed without a summary yet, `parallel` at a time; returns the seeds that failed."""
    queue = [seed for seed in seeds if not (seed_dir(out, seed) / SUMMARY_FILE).is_file()]
    if len(queue) < len(seeds):
        say(f"seeds {[seed for seed in seeds if seed not in queue]} already finished (their {SUMMARY_FILE} exists)")
    running: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}  # slot -> (seed, its demo)
    failed = []
    while queue or running:
        for slot in range(parallel):
            if slot in running or not queue:
                continue
            seed = queue.pop(0)
            folder = seed_dir(out, seed)
            folder.mkdir(parents=True, exist_ok=True)
            command, env = seed_command(seed, out, gin_params, slot % (os.cpu_count() or 1) if parallel > 1 else None)
            running[slot] = (seed, start_logged(command, folder / "console.log", env=env, cwd=REPO_ROOT))
            say(f"seed {seed}: demo started, console in {folder / 'console.log'}")
        time.sleep(POLL_S)
        for slot, (seed, process) in list(running.items()):
            if process.poll() is None:
                continue
            del running[slot]
            if process.returncode == 0:
                say(f"seed {seed}: finished")
            else:
                failed.append(seed)
                say(f"seed {seed}: failed (exit status {process.returncode}); see "
                    f"{seed_dir(out, seed) / 'console.log'}")
    return failed


def load_runs(out: str | Path, seeds: Sequence[int]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each seed's demo summary and config fingerprint (of the bound config its demo wrote)."""
    folders = [seed_dir(out, seed) for seed in seeds]
    return ([json.loads((folder / SUMMARY_FILE).read_text()) for folder in folders],
            [config_fingerprint((folder / CONFIG_FILE).read_text()) for folder in folders])


def against_seed_range(summary: Mapping[str, Any], fingerprint: str, path: Path = RANGE_FILE) -> list[str]:
    """What the demo says at its end: its figures beside the range in `path` (`compare_with_range`), or one line
    that the range file is missing and how to make it."""
    if not path.is_file():
        return [f"no seed range to read this run against ({path} is missing); make it with "
                "`python -m experiments.demo_seeds --seeds 0 1 2 3 4 --parallel 2`"]
    record = json.loads(path.read_text())
    return [f"this run beside the demo's range over {len(record['seeds'])} seeds ({path}):",
            *compare_with_range(summary, fingerprint, record)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1 if a seed failed or a run folder lacks its summary)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="demo seeds (--seed N)")
    parser.add_argument("--out", default="runs/demo_seeds", help="one demo run folder per seed: OUT/seedN")
    parser.add_argument("--parallel", type=int, default=1, help="demos at once, each pinned to its own core")
    parser.add_argument("--gin_param", action="append", default=[], help="a binding for every seed's demo")
    parser.add_argument("--write-range", dest="write_range", type=Path, default=RANGE_FILE,
                        help=f"the range file to write, {TABLE_FILE} beside it (default: {RANGE_FILE})")
    parser.add_argument("--from-runs", dest="from_runs", action="store_true",
                        help="only aggregate the existing OUT/seedN folders (no training)")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}")
    if not args.from_runs:
        failed = run_seeds(args.seeds, args.out, args.gin_param, args.parallel)
        if failed:
            say(f"seeds {failed} failed; no range written (rerun to resume them)")
            return 1
    missing = [str(seed_dir(args.out, seed)) for seed in args.seeds
               if not (seed_dir(args.out, seed) / SUMMARY_FILE).is_file()]
    if missing:
        say(f"no {SUMMARY_FILE} in {', '.join(missing)}: run those seeds first (without --from-runs)")
        return 1
    summaries, fingerprints = load_runs(args.out, args.seeds)
    try:
        record = build_range(summaries, fingerprints)
    except ValueError as exc:
        say(str(exc))
        return 1
    args.write_range.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.write_range, json.dumps(record, indent=1) + "\n")
    table = atomic_write_text(args.write_range.parent / TABLE_FILE, seeds_table(summaries, record))
    say(f"range of {len(summaries)} seeds in {args.write_range}, table in {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
