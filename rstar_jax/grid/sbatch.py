"""The sbatch script of a multi-node training run (experiments.launch; issue 23 item 3). Pure text: the caller
gives the commands (from the run's gin files) and the node layout; nothing here runs anything.

The job takes learner_nodes + rollout_nodes + sandbox_nodes nodes, one task each, in that order of
`scontrol show hostnames $SLURM_JOB_NODELIST`. The script
1. starts a sandbox server on every sandbox node (the rollout nodes when there are none; the learner nodes when there
   are no rollout nodes either), one `srun --overlap` step each,
2. starts `servers_per_node` vLLM servers on every rollout node (one step per node; server k on the step's GPUs
   k*g .. k*g+g-1 of CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, g = gpus_per_server, ports base_port+k),
3. waits until every server answers /health, then
4. runs the learner: one `srun` step of learner_nodes tasks (one process per node, all its GPUs) of
   `experiments.train ... --gin_param 'distributed.initialize = True'`, JAX finding the coordinator, process count and
   rank in SLURM's environment, with `RolloutBackend.vllm_urls` bound to the servers' URLs (and
   `RolloutBackend.backend = 'vllm'`) and one `--sandbox_url` per sandbox server. The learner's exit status is the
   job's; the servers' steps are cancelled when it ends.
Logs: the job's output file (the learner) and RUN/logs/ (servers). With RSTAR_LAUNCH_DRY_RUN=1 in its environment the
script prints every command (`+ ...`, bash-quoted) instead of running it and waits for nothing.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Sequence

DRY_RUN_VARIABLE = "RSTAR_LAUNCH_DRY_RUN"

_WAIT_HEALTHY = r'''wait_healthy() {  # URL...: until each answers GET URL/health with 200, at most $WAIT_S seconds
  [ "$DRY" = 1 ] && return 0
  "$PYTHON" - "$WAIT_S" "$@" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for url in sys.argv[2:]:
    while True:
        try:
            with opener.open(url + "/health", timeout=10) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"launch: {url} not healthy after {sys.argv[1]} s (its log is in the run's logs/ folder)")
        time.sleep(5)
    print(f"launch: {url} is up", flush=True)
PY
}'''


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What the script starts. Commands are argument lists as they run on the nodes (absolute interpreter, this
    checkout at the same path everywhere); `train_command` without the bindings the script adds."""

    repo: str
    run_dir: str
    python: str
    train_command: tuple[str, ...]
    server_command: tuple[str, ...]
    server_env: tuple[tuple[str, str], ...] = ()
    learner_nodes: int = 1
    rollout_nodes: int = 0
    sandbox_nodes: int = 0
    gpus_per_node: int = 0
    gpus_per_server: int = 1
    servers_per_node: int = 1
    vllm_port: int = 8000
    sandbox_port: int = 8080
    sandbox_workers: int = 32
    job_name: str = "rstar-train"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_node: int | None = None
    setup: tuple[str, ...] = ()
    wait_s: int = 3600
    written_by: str = ""

    @property
    def nodes(self) -> int:
        return self.learner_nodes + self.rollout_nodes + self.sandbox_nodes

    def check(self) -> None:
        """ValueError naming what cannot work."""
        if self.learner_nodes < 1:
            raise ValueError("at least one learner node is needed")
        if min(self.rollout_nodes, self.sandbox_nodes, self.gpus_per_node) < 0:
            raise ValueError("node and GPU counts must be >= 0")
        if self.rollout_nodes and self.servers_per_node < 1:
            raise ValueError("rollout nodes need at least one vLLM server each")
        if self.gpus_per_node and self.servers_per_node * self.gpus_per_server > self.gpus_per_node:
            raise ValueError(f"{self.servers_per_node} servers x {self.gpus_per_server} GPUs do not fit a node's "
                             f"{self.gpus_per_node} GPUs")


def _sbatch_lines(plan: LaunchPlan) -> list[str]:
    options = [f"--job-name={plan.job_name}", f"--nodes={plan.nodes}", "--ntasks-per-node=1", "--exclusive",
               f"--output={plan.run_dir}/slurm-%j.out"]
    options += [f"--gpus-per-node={plan.gpus_per_node}"] if plan.gpus_per_node else []
    options += [f"--cpus-per-task={plan.cpus_per_node}"] if plan.cpus_per_node else []
    options += [f"--partition={plan.partition}"] if plan.partition else []
    options += [f"--time={plan.time}"] if plan.time else []
    options += [f"--account={plan.account}"] if plan.account else []
    return [f"#SBATCH {shlex.quote(option)}" for option in options]


def _node_servers(plan: LaunchPlan) -> str:
    """The bash program one rollout node's step runs: its vLLM servers in the background, then wait."""
    port_at = plan.server_command.index("--port")
    command = [*plan.server_command[:port_at], *plan.server_command[port_at + 2:]]
    lines = [f"export {name}={shlex.quote(value)}" for name, value in plan.server_env]
    lines += ['IFS=, read -ra visible <<< "${CUDA_VISIBLE_DEVICES:-${HIP_VISIBLE_DEVICES:-}}"',
              f"for k in $(seq 0 {plan.servers_per_node - 1}); do",
              f"  port=$(({plan.vllm_port} + k))"]
    if plan.gpus_per_node:
        lines += [f"  gpus=(); for g in $(seq $((k * {plan.gpus_per_server})) $((k * {plan.gpus_per_server} + "
                  f"{plan.gpus_per_server} - 1))); do gpus+=(\"${{visible[$g]:-$g}}\"); done",
                  '  devices=$(IFS=,; echo "${gpus[*]}")',
                  "  CUDA_VISIBLE_DEVICES=$devices HIP_VISIBLE_DEVICES=$devices \\"]
    tensor_parallel = ["--tensor-parallel-size", str(plan.gpus_per_server)] if plan.gpus_per_node else []
    lines += [f"  {shlex.join(command)} --port \"$port\" {shlex.join(tensor_parallel)} \\",
              f"    > {shlex.quote(plan.run_dir)}/logs/vllm-$(hostname)-$k.log 2>&1 &",
              "done", "wait"]
    return "\n".join(lines)


def sbatch_script(plan: LaunchPlan) -> str:
    """The sbatch script of `plan` (see the module docstring)."""
    plan.check()
    quote = shlex.quote
    sandbox_hosts = ("SANDBOX_NODES" if plan.sandbox_nodes else "ROLLOUT_NODES" if plan.rollout_nodes
                     else "LEARNER_NODES")
    step_gpus = f" --gpus-per-node={plan.gpus_per_node}" if plan.gpus_per_node else ""
    train = shlex.join(plan.train_command)
    lines = [
        "#!/bin/bash",
        f"# {plan.written_by}" if plan.written_by else "# written by python -m experiments.launch",
        *_sbatch_lines(plan),
        "set -euo pipefail",
        f"cd {quote(plan.repo)}",
        *plan.setup,
        f"PYTHON={quote(plan.python)}",
        f"RUN={quote(plan.run_dir)}",
        f"WAIT_S={plan.wait_s}",
        f'DRY="${{{DRY_RUN_VARIABLE}:-0}}"  # 1: print each command instead of running it',
        'mkdir -p "$RUN/logs"',
        "STEPS=()",
        "run() { if [ \"$DRY\" = 1 ]; then echo \"+ ${*@Q}\"; else \"$@\"; fi; }",
        "start() {  # a server step in the background, cancelled when the job script exits",
        "  if [ \"$DRY\" = 1 ]; then echo \"+ ${*@Q} &\"; else \"$@\" & STEPS+=($!); fi",
        "}",
        "stop_steps() { if [ ${#STEPS[@]} -gt 0 ]; then kill \"${STEPS[@]}\" 2>/dev/null || true; fi; }",
        "trap stop_steps EXIT",
        _WAIT_HEALTHY,
        "",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'if [ ${{#NODES[@]}} -lt {plan.nodes} ]; then echo "launch: {plan.nodes} nodes needed, the job has '
        '${#NODES[@]}" >&2; exit 1; fi',
        f'LEARNER_NODES=("${{NODES[@]:0:{plan.learner_nodes}}}")',
        f'ROLLOUT_NODES=("${{NODES[@]:{plan.learner_nodes}:{plan.rollout_nodes}}}")',
        f'SANDBOX_NODES=("${{NODES[@]:{plan.learner_nodes + plan.rollout_nodes}:{plan.sandbox_nodes}}}")',
        "",
        "# sandbox servers (root, cgroup v1 pids and memory, util-linux unshare on their hosts; no authentication:",
        "# keep the cluster's network private)",
        "SANDBOX_URLS=()",
        f'for node in "${{{sandbox_hosts}[@]}}"; do',
        '  start srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --output="$RUN/logs/sandbox-$node.log" \\',
        f'    "$PYTHON" -m sandbox_server --host 0.0.0.0 --port {plan.sandbox_port} --workers {plan.sandbox_workers}',
        f'  SANDBOX_URLS+=("http://$node:{plan.sandbox_port}")',
        "done",
        "",
        f"# vLLM servers: {plan.servers_per_node} per rollout node"
        + (f", {plan.gpus_per_server} GPU(s) each" if plan.gpus_per_node else ""),
        f"NODE_SERVERS={quote(_node_servers(plan))}",
        "VLLM_URLS=()",
        'for node in "${ROLLOUT_NODES[@]}"; do',
        f'  start srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap{step_gpus} bash -c "$NODE_SERVERS"',
        f"  for k in $(seq 0 {plan.servers_per_node - 1}); do VLLM_URLS+=(\"http://$node:$(({plan.vllm_port} + k))\");"
        " done",
        "done",
        'wait_healthy "${SANDBOX_URLS[@]}" "${VLLM_URLS[@]}"',
        "",
        "# the learner: one JAX process per learner node (jax.distributed reads SLURM's environment)",
        "BINDINGS=(--gin_param 'distributed.initialize = True')",
        "if [ ${#VLLM_URLS[@]} -gt 0 ]; then",
        "  quoted=(); for url in \"${VLLM_URLS[@]}\"; do quoted+=(\"'$url'\"); done",
        "  BINDINGS+=(--gin_param \"RolloutBackend.backend = 'vllm'\")",
        '  BINDINGS+=(--gin_param "RolloutBackend.vllm_urls = [$(IFS=,; echo "${quoted[*]}")]")',
        "fi",
        'for url in "${SANDBOX_URLS[@]}"; do BINDINGS+=(--sandbox_url "$url"); done',
        "set +e",
        f'run srun --nodes={plan.learner_nodes} --ntasks={plan.learner_nodes} --ntasks-per-node=1 '
        f'--nodelist="$(IFS=,; echo "${{LEARNER_NODES[*]}}")" --overlap --kill-on-bad-exit=1{step_gpus} \\',
        f'  {train} "${{BINDINGS[@]}}"',
        "status=$?",
        'echo "launch: the learner exited with status $status"',
        "exit $status",
        "",
    ]
    return "\n".join(lines)


def submit(script_path: str, extra_args: Sequence[str] = ()) -> str:
    """`sbatch --parsable [extra_args] script`; the job id (CalledProcessError with sbatch's message on failure)."""
    import subprocess

    result = subprocess.run(["sbatch", "--parsable", *extra_args, script_path], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
    return result.stdout.strip().split(";")[0]
