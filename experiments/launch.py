"""Write (and with --submit, submit) the sbatch script of a multi-node training run, from the run's own gin files:
N learner processes (one per node, `srun`; `distributed.initialize = True`, JAX reading SLURM's environment), vLLM
servers on the rollout nodes (one per `--gpus_per_server` GPUs, launched with the gin file's `server_command` and
`server_env`), sandbox servers, and their URLs wired into the trainer's bindings (`RolloutBackend.vllm_urls`, one
`--sandbox_url` each). rstar_jax/grid/sbatch.py describes the script.

    python -m experiments.launch --model DIR --out RUN --gin_file paper/qwen3_14b.gin \\
        --learner_nodes 8 --rollout_nodes 8 --gpus_per_node 8 [--sandbox_nodes 2] [--partition P] [--time 48:00:00]
        [--gin_param ...] [--script FILE] [--submit]

Writes RUN/launch.sbatch (or --script) and prints how to submit it; --submit submits it with sbatch and prints the
job id. The job's output (the learner's) goes to RUN/slurm-JOBID.out, the servers' logs to RUN/logs/. Every node must
see this checkout, its .venv, DIR and RUN at the same paths, and the weight-sync folder (gin
`default_sync_dir.sync_dir`) must be shared by the learner and the rollout nodes. Setting RSTAR_LAUNCH_DRY_RUN=1 in
the job's environment (e.g. `RSTAR_LAUNCH_DRY_RUN=1 sbatch RUN/launch.sbatch`) prints the commands instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import gin

import experiments.train  # noqa: F401 - registers every configurable the run's gin files bind
from experiments.demo import DEMO_GIN
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.gin_setup import GinConfigError, parse_gin
from rstar_jax.grid.sbatch import DRY_RUN_VARIABLE, LaunchPlan, sbatch_script, submit
from rstar_jax.paths import REPO_ROOT
from rstar_jax.rollout.vllm_server import server_command, server_env

DEFAULT_GIN = (TINY_MODEL_GIN, SFT_GIN, DEMO_GIN)


def gin_tensor_parallel(command: Sequence[str]) -> int:
    """The --tensor-parallel-size the gin file's server command carries (its last one), 1 without one."""
    sizes = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "--tensor-parallel-size"]
    return int(sizes[-1]) if sizes else 1


def plan_launch(args: argparse.Namespace, gin_files: Sequence[str], written_by: str = "") -> LaunchPlan:
    """The launch plan of the parsed arguments: the gin config parsed (GinConfigError when it does not), the vLLM
    command and environment read from it, and cleared again."""
    try:
        parse_gin(gin_files, args.gin_param)
        command = server_command(args.model, 0, host="0.0.0.0")
        added_env = sorted((name, value) for name, value in server_env().items() if os.environ.get(name) != value)
    finally:
        gin.clear_config()
    gpus_per_server = args.gpus_per_server or gin_tensor_parallel(command)
    servers = args.servers_per_node or (args.gpus_per_node // gpus_per_server if args.gpus_per_node else 1)
    train = [sys.executable, "-m", "experiments.train", "--model", str(Path(args.model).resolve()), "--out",
             str(Path(args.out).resolve())]
    train += [arg for name in gin_files for arg in ("--gin_file", name)]
    train += [arg for param in args.gin_param for arg in ("--gin_param", param)]
    return LaunchPlan(repo=str(REPO_ROOT), run_dir=str(Path(args.out).resolve()), python=sys.executable,
                      train_command=tuple(train), server_command=tuple(command), server_env=tuple(added_env),
                      learner_nodes=args.learner_nodes, rollout_nodes=args.rollout_nodes,
                      sandbox_nodes=args.sandbox_nodes, gpus_per_node=args.gpus_per_node,
                      gpus_per_server=gpus_per_server, servers_per_node=servers, vllm_port=args.vllm_port,
                      sandbox_port=args.sandbox_port, sandbox_workers=args.sandbox_workers, job_name=args.job_name,
                      partition=args.partition, time=args.time, account=args.account,
                      cpus_per_node=args.cpus_per_node, setup=tuple(args.setup), wait_s=args.wait_s,
                      written_by=written_by)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model folder the run starts from (and the servers load)")
    parser.add_argument("--out", required=True, help="the run folder (experiments.train's --out)")
    parser.add_argument("--gin_file", action="append", default=None, help=f"default: {', '.join(DEFAULT_GIN)}")
    parser.add_argument("--gin_param", action="append", default=[], help="more bindings of the run")
    parser.add_argument("--learner_nodes", type=int, default=1, help="learner processes, one per node")
    parser.add_argument("--rollout_nodes", type=int, default=0, help="nodes of vLLM servers (0: the gin file's "
                        "rollout backend, e.g. in-process JAX engines or servers it launches itself)")
    parser.add_argument("--sandbox_nodes", type=int, default=0, help="nodes of sandbox servers (0: one sandbox "
                        "server on each rollout node, or on each learner node without rollout nodes)")
    parser.add_argument("--gpus_per_node", type=int, default=0, help="GPUs of each node (0: CPU nodes)")
    parser.add_argument("--gpus_per_server", type=int, default=None, help="GPUs of each vLLM server (default: the "
                        "gin file's --tensor-parallel-size, else 1)")
    parser.add_argument("--servers_per_node", type=int, default=None, help="vLLM servers per rollout node "
                        "(default: gpus_per_node / gpus_per_server; 1 on CPU nodes)")
    parser.add_argument("--vllm_port", type=int, default=8000, help="first vLLM port of a node (server k: +k)")
    parser.add_argument("--sandbox_port", type=int, default=8080)
    parser.add_argument("--sandbox_workers", type=int, default=32, help="worker processes per sandbox server")
    parser.add_argument("--job_name", default="rstar-train")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default=None, help="the job's time limit, e.g. 48:00:00")
    parser.add_argument("--account", default=None)
    parser.add_argument("--cpus_per_node", type=int, default=None, help="CPUs to ask for on each node")
    parser.add_argument("--setup", action="append", default=[], help="a shell line the script runs first (e.g. "
                        "'module load cuda'; repeatable)")
    parser.add_argument("--wait_s", type=int, default=3600, help="how long to wait for the servers to be healthy")
    parser.add_argument("--script", default=None, help="where to write the script (default: OUT/launch.sbatch)")
    parser.add_argument("--submit", action="store_true", help="submit it with sbatch")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"{args.model} is not a model folder (no config.json)")
    command_line = "python -m experiments.launch " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        plan = plan_launch(args, list(args.gin_file or DEFAULT_GIN), written_by=command_line)
        script = sbatch_script(plan)
    except (GinConfigError, ValueError) as exc:
        parser.error(str(exc))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.script or Path(args.out) / "launch.sbatch")
    path.write_text(script)
    path.chmod(0o755)
    print(f"wrote {path}: {plan.learner_nodes} learner node(s), {plan.rollout_nodes} rollout node(s) x "
          f"{plan.servers_per_node if plan.rollout_nodes else 0} vLLM server(s), sandbox servers on "
          f"{plan.sandbox_nodes or 'the rollout' if plan.sandbox_nodes or plan.rollout_nodes else 'the learner'} "
          f"node(s); {plan.nodes} node(s) in all")
    if not args.submit:
        print(f"submit it with: sbatch {path}  (dry run, printing the commands: {DRY_RUN_VARIABLE}=1 sbatch {path})")
        return 0
    try:
        job = submit(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"sbatch failed: {getattr(exc, 'stderr', '') or exc}", file=sys.stderr)
        return 1
    print(f"submitted job {job}; its output: {Path(args.out).resolve()}/slurm-{job}.out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
