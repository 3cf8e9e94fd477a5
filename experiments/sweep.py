"""A sweep: RL runs over a grid of gin bindings (stage lengths, turn limits, group sizes, learning rates, ...) from
one model, each followed by the held-out evaluation, then a comparison table and plots (SPEC 5's recipe knobs; SPEC
7's held-out accuracy; SPEC 4's tool-error ratio among correct trajectories).

    python -m experiments.sweep --model DIR --out GRID --grid 'KEY=[v1, v2, ...]' [--grid ...] [--grid_file F.json]
        [--seeds 0 1 2] [--gin_file ...] [--gin_param ...] [--report_dir DIR] [--report_only]
        [--executor local|slurm [--slurm_partition P --slurm_time_min M --slurm_cpus C --slurm_gpus G ...]]

Grid axes: `--grid 'short/Stage.max_response_tokens=[256, 384]' --grid 'RLSettings.group_size=[2, 4]'` (each value
gin text: `'grpo'` for a string, `(64, 128)`, `@a/Stage()`), and/or a JSON file {"axes": {AXIS: VALUES}}: VALUES a
list (AXIS is the gin parameter) or {LABEL: [binding, ...]} for values that bind several parameters together (e.g.
experiments/grids/stage_lengths.json: both stages' lengths per schedule). Every combination runs; `--seeds` adds an
axis of `RLSettings.seed` values and the report then averages over it (mean ± sample sd).

Writes GRID/points/NAME/ per point (NAME joins the values' labels, e.g.
`RLSettings.group_size=2__short.Stage.max_response_tokens=256`): experiments.train's run folder (metrics.jsonl,
checkpoints/, model/, plots/), operative_config.gin, summary.json (held-out figures of the start and trained model;
written last: a point is finished when it exists). GRID/start_eval/ caches the start model's evaluation, GRID/grid.json
records the grid, and GRID (or --report_dir) gets report.md, report.json, curves.png (per-step accuracy, tool-error
ratio in correct trajectories, response length, tool calls) and heldout.png. Each point runs in its own process (gin
is global state). A rerun with the same arguments skips finished points and resumes interrupted ones from their last
checkpoint; a point folder holding other bindings is refused. Each point runs under an exclusive claim (GRID/points/
NAME/claim.N.json: job id, host, pid, heartbeat), so two sweeps on one GRID never run one point, and a dead worker's
point is taken over once its heartbeat is --claim_timeout_s old. `--executor slurm` submits every unfinished point as
one task of a SLURM job array (submitit; task files in GRID/slurm/), waits for it and writes the report; the
compute nodes must see this checkout, its .venv and GRID at the same paths.

The real stage-length sweep on the CPU demo (3 schedules x the demo's 10 RL steps, from seed 0's demo SFT model,
made by `python -m experiments.demo --out /tmp/exp/seed0 --seed 0`); estimated 25-30 min of 2 quiet cores (per
point ~7 min: ~1 min start-up and compilation, ~5.5 min of RL as in the demo, ~1.5 min held-out evaluation; plus
~1.5 min for the start model once), 2-3x that while other jobs share the cores:

    python -m experiments.sweep --model /tmp/exp/seed0/sft/model --out runs/sweep_stage_lengths \\
        --grid_file experiments/grids/stage_lengths.json --report_dir experiments/reports/sweep_stage_lengths

"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from experiments.grid_point import DEFAULT_GIN
from rstar_jax.grid.axes import SEED_AXIS, seed_axis
from rstar_jax.grid.experiment import add_grid_arguments, run_experiment
from rstar_jax.grid.points import Axis, GridError, expand, load_grid_file, parse_grid_arg


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1 if a point failed)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model folder every point starts from")
    parser.add_argument("--grid", action="append", default=[], help="an axis: 'KEY=[v1, v2, ...]' (repeatable)")
    parser.add_argument("--grid_file", default=None, help="JSON file of axes (see above)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="also run each point with these "
                        "RLSettings.seed values and average over them")
    parser.add_argument("--title", default="Sweep", help="the report's title")
    add_grid_arguments(parser, "runs/sweep", DEFAULT_GIN)
    args = parser.parse_args(argv)
    try:
        axes: list[Axis] = [parse_grid_arg(text) for text in args.grid]
        if args.grid_file:
            axes += load_grid_file(args.grid_file)
        if args.seeds:
            axes.append(seed_axis(args.seeds))
        points = expand(axes, args.model)
        return run_experiment(points, args, DEFAULT_GIN, args.title, "experiments.sweep",
                              over=(SEED_AXIS,) if args.seeds else ())
    except GridError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
