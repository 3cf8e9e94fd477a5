"""The RoC ablation (SPEC 4): GRPO-RoC (paper and release modes) against the penalty-reward baseline at several
lambdas and plain GRPO, x seeds, from one gin base; a report of held-out accuracy (start model vs after RL), the
tool-error ratio among correct trajectories (SPEC 4's Figure 4 measure), response length and tool calls per step, as
mean ± sample sd over seeds.

    python -m experiments.ablate --model DIR_OR_TEMPLATE --out GRID [--arms roc_paper roc_release penalty grpo]
        [--lambdas 0.25 0.5 1.0] [--seeds 0 1 2] [--gin_file ...] [--gin_param ...] [--report_dir DIR] [--report_only]
        [--executor local|slurm [--slurm_partition P --slurm_time_min M --slurm_cpus C --slurm_gpus G ...]]

--model may hold "{seed}" (e.g. /tmp/exp/seed{seed}/sft/model, the demo's SFT model of each seed): each seed then
starts from its own model. Each seed binds RLSettings.seed; each arm binds make_selector.algorithm and
RocSelector.mode or PenaltySelector.penalty_lambda over the base (default: the demo's gin files; RoC samples 2G
rollouts per prompt and keeps G, the baselines sample G). Built on the sweep's machinery: GRID/points/ARM__seedN/
per run (experiments.train's run folder, operative_config.gin, summary.json written last), GRID/start_eval/ (each
start model evaluated once), GRID/grid.json, and report.md, report.json, curves.png, heldout.png in GRID (or
--report_dir). A rerun skips finished runs and resumes interrupted ones from their last checkpoint. Runs hold exclusive
claims and `--executor slurm` submits the unfinished ones as one SLURM job array, as in experiments.sweep.

The real CPU ablation: 6 arms x 3 seeds = 18 runs of the demo's 10 RL steps, each seed from its demo SFT model
(`python -m experiments.demo --out /tmp/exp/seedN --seed N`). Estimated 2 h of 2 quiet cores: a RoC run ~7.5 min
(~1 min start-up and compilation, ~5.5 min of RL as in the demo, ~1.5 min held-out evaluation), a penalty or GRPO
run ~5.5 min (half the rollouts: G per prompt, not 2G), 3 start-model evaluations ~1.5 min each; 2-3x that while
other jobs share the cores:

    python -m experiments.ablate --model '/tmp/exp/seed{seed}/sft/model' --seeds 0 1 2 --out runs/ablation \\
        --report_dir experiments/reports/ablation

"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from experiments.grid_point import DEFAULT_GIN
from rstar_jax.grid.axes import ARMS, SEED_AXIS, seed_axis, selector_axis
from rstar_jax.grid.experiment import add_grid_arguments, run_experiment
from rstar_jax.grid.points import GridError, expand


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1 if a run failed)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model folder, or a template with {seed}")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help=f"selectors to run (default: all of {ARMS})")
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.25, 0.5, 1.0],
                        help="penalty_lambda values of the penalty arm (1 - lambda * p_err for a correct answer)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RLSettings.seed values")
    parser.add_argument("--title", default="RoC ablation: GRPO-RoC vs penalty rewards vs plain GRPO",
                        help="the report's title")
    add_grid_arguments(parser, "runs/ablation", DEFAULT_GIN)
    args = parser.parse_args(argv)
    try:
        points = expand([selector_axis(args.arms, args.lambdas), seed_axis(args.seeds, args.model)], args.model)
        preamble = ["Arms (SPEC 4): roc_paper / roc_release sample 2G rollouts per prompt and keep G by "
                    "Resample-on-Correct; penalty_lX samples G and rewards a correct answer 1 - X * p_err; grpo "
                    "samples G with the plain outcome reward."]
        return run_experiment(points, args, DEFAULT_GIN, args.title, "experiments.ablate", over=(SEED_AXIS,),
                              preamble=preamble)
    except GridError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
