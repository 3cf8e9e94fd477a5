"""RL training (GRPO-RoC or a baseline, SPEC 4-5) of a model folder: `rstar_jax.train.rl_trainer.RLTrainer`.

    python -m experiments.train --model DIR --out RUN [--gin_file ...] [--gin_param ...]
    python -m experiments.train --gin_file paper/qwen3_14b.gin --dry_run --devices 64


DIR is any Hugging Face Qwen2/Qwen3 folder with its tokenizer (e.g. the demo's SFT model, OUT/sft/model). Starts a
sandbox server (or uses `--sandbox_url`), trains every stage of `RLSettings.stages`, and writes RUN/metrics.jsonl,
RUN/tensorboard/, RUN/plots/, RUN/checkpoints/, RUN/model/ and RUN/operative_config.gin. A killed run started again
with the same command resumes from its last checkpoint and continues exactly as the uninterrupted run would.
`--dry_run --devices N` checks the config for N learner devices without allocating the model
(`rstar_jax.train.dry_run`): the mesh plan, per-device parameter, optimiser and activation memory, and how many
rollouts the fleet's KV cache holds; it exits 1 when the config cannot run.

"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Sequence

import gin
import jax

from experiments.demo import DEMO_GIN
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.console import log_to, say
from rstar_jax.gin_setup import knob_help, parse_gin, write_operative_config
from rstar_jax.eval.heldout import HeldOutEval
from rstar_jax.model import load_hf
from rstar_jax.model.folder import save_model_folder
from rstar_jax.parallel.gpu_placement import apply_learner_devices, learner_devices
from rstar_jax.parallel.multihost import is_driver
from rstar_jax.processes import running_sandbox
from rstar_jax.reward import VerifierPool
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.train.dry_run import ClusterSpec, DryRun, DryRunError, format_dry_run, model_config, plan_dry_run
from rstar_jax.train.metrics import read_metrics
from rstar_jax.train.plots import plot_metrics
from rstar_jax.train.rl_setup import RLSetup, rl_setup
from rstar_jax.train.rl_trainer import RLTrainer

KNOBS = ("RLSettings.prompts_per_step", "RLSettings.group_size", "RLSettings.zero_variance", "RLSettings.seed",
         "make_selector.algorithm", "RocSelector.mode", "PenaltySelector.penalty_lambda", "PolicyLossOptions.eps_high",
         "rl_optimizer.learning_rate", "RolloutBackend.backend")


@gin.configurable
def distributed(initialize: bool = False, coordinator_address: str | None = None, num_processes: int | None = None,
                process_id: int | None = None, heartbeat_timeout_s: int = 100) -> None:
    """Multi-host JAX (DESIGN "Scale-out"): with `initialize`, call `jax.distributed.initialize` before anything
    touches a device, so `jax.devices()` (and the mesh) spans every host's devices. The arguments left None are
    found by JAX from the cluster environment (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU). CPU collectives across
    processes go through gloo (the local multi-process tests; GPUs use NCCL regardless). If a process dies, the
    others' next collective fails and JAX's coordination service stops them, naming the task whose heartbeats
    stopped, within `heartbeat_timeout_s`."""
    if initialize:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)


def place_learner(backend: RolloutBackend) -> None:
    """One node shared by the learner and the vLLM servers it launches (gin/paper/one_node.gin): restrict JAX to
    gin `learner_devices.gpus` with `learner_devices.memory_fraction` of each, after checking them against
    `RolloutBackend.vllm_per_server_gpus` (disjoint, within `learner_devices.node_gpus`). Nothing bound: nothing
    changes. Runs before anything touches a device (see `rstar_jax.parallel.gpu_placement`)."""
    apply_learner_devices(learner_devices(), backend.launched_server_gpus)


def dry_run_plan(setup: RLSetup, device_count: int, model_dir: str | None = None) -> DryRun:
    """The dry run's plan of `setup` (the trainer's own) on `device_count` devices, with the parsed gin config's
    model (or `model_dir`'s, at the trainer's precision), held-out evaluation budget and `ClusterSpec`."""
    return plan_dry_run(setup, device_count, model_config(model_dir), HeldOutEval(), ClusterSpec())


def dry_run(setup: RLSetup, device_count: int, model_dir: str | None = None) -> int:
    """Print `dry_run_plan`; 0 when the config fits, else 1."""
    try:
        plan = dry_run_plan(setup, device_count, model_dir)
    except DryRunError as exc:
        print(f"dry run: {exc}", file=sys.stderr)
        return 1
    print(format_dry_run(plan))
    return 1 if plan.problems else 0


def main(argv: Sequence[str] | None = None) -> Path | int:
    """Command-line entry point; returns the trained model folder (with --dry_run: the exit status)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=knob_help([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN], KNOBS))
    parser.add_argument("--model", help="HF model folder to start from (required unless --dry_run; with it, the "
                        "dry run plans this folder's model)")
    parser.add_argument("--out", help="run folder, an existing one resumes (required unless --dry_run)")
    parser.add_argument("--dry_run", action="store_true", help="check the config for --devices learner devices "
                        "without allocating the model: mesh plan, memory per device, rollouts the fleet's KV holds")
    parser.add_argument("--devices", type=int, default=None, help="learner devices for --dry_run (default: this "
                        "machine's)")
    parser.add_argument("--sandbox_url", action="append", default=[], help="running sandbox servers (default: "
                        "start one here)")
    parser.add_argument("--gin_file", action="append", default=None,
                        help=f"gin files (default: {TINY_MODEL_GIN}, {SFT_GIN}, {DEMO_GIN})")
    parser.add_argument("--gin_param", action="append", default=[], help="e.g. 'make_selector.algorithm = \"grpo\"'")
    args = parser.parse_args(argv)
    if not args.dry_run and (args.model is None or args.out is None):
        parser.error("--model and --out are required (unless --dry_run)")
    parse_gin(args.gin_file or [TINY_MODEL_GIN, SFT_GIN, DEMO_GIN], args.gin_param)
    setup = rl_setup()  # the run's objects, built once from gin: the trainer and the dry run read the same
    if args.dry_run:
        return dry_run(setup, args.devices if args.devices is not None else jax.device_count(), args.model)
    place_learner(setup.backend)  # before anything touches a device (building the setup does not)
    distributed()
    out = Path(args.out)
    mesh = setup.mesh()
    model = load_hf(args.model, mesh=mesh)  # straight into its shards; precision from gin (recipe: f32 / bf16)
    config = model.config
    driver = is_driver()  # process 0 of a multi-process learner (always, in one process) drives the run
    log_file = out / ("train.log" if driver else f"train.process{jax.process_index()}.log")
    with log_to(log_file), contextlib.ExitStack() as stack:
        trainer = RLTrainer(out, config, model.params, args.model, setup, mesh)
        del model  # the trainer's state takes the parameters over: no second copy stays on the devices
        verifier, sandbox_urls = None, args.sandbox_url
        if driver:
            verifier = stack.enter_context(VerifierPool())
            sandbox_urls = sandbox_urls or [stack.enter_context(running_sandbox(["--workers", "2"])).url]
        params = trainer.run(sandbox_urls, verifier)
        if not driver:
            return out / "model"
        folder = save_model_folder(config, params, out / "model", args.model)
        plot_metrics(read_metrics(out / "metrics.jsonl"), out / "plots", "RL")
        write_operative_config(out)
        say(f"wrote {folder}; metrics in {out / 'metrics.jsonl'}, plots in {out / 'plots'}")
    return folder


if __name__ == "__main__":
    result = main()
    if isinstance(result, int):
        sys.exit(result)
