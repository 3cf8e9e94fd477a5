"""experiments.launch and rstar_jax/grid/sbatch.py: the sbatch script of a multi-node run is valid bash; run in its
dry-run mode under a fake allocation it starts a sandbox server per rollout node, the gin file's vLLM servers per
rollout node and one learner step of N processes whose gin bindings parse (distributed.initialize, the servers' URLs in
RolloutBackend.vllm_urls) and whose --sandbox_url name the sandbox servers; each server of a node gets its own GPUs
and port; and --submit submits it to the one-node SLURM cluster of tests/slurm_cluster.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import gin
import pytest

from experiments.launch import main
from rstar_jax.gin_setup import parse_gin
from rstar_jax.grid.sbatch import LaunchPlan, sbatch_script
from rstar_jax.rollout.backends import RolloutBackend
from tests.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401 - the fixture

FAKE_SCONTROL = '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo "$3" | tr , "\\n"\n'


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def dry_run(script: Path, nodes: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `script` in dry-run mode as if SLURM had allocated `nodes` (a fake `scontrol show hostnames`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": nodes,
           "RSTAR_LAUNCH_DRY_RUN": "1"}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)


def learner_arguments(output: str) -> list[str]:
    """The learner step's command line from a dry run's output."""
    [line] = [line for line in output.splitlines() if "experiments.train" in line]
    return shlex.split(line[2:])


def values(arguments: list[str], flag: str) -> list[str]:
    return [arguments[i + 1] for i, arg in enumerate(arguments[:-1]) if arg == flag]


def test_the_paper_runs_script_is_valid_bash_and_its_bindings_parse(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["--model", str(model), "--out", str(out), "--gin_file", "paper/qwen3_14b.gin", "--learner_nodes", "2",
                 "--rollout_nodes", "2", "--gpus_per_node", "8", "--partition", "gpu", "--time", "48:00:00",
                 "--gin_param", "RLSettings.seed = 3"]) == 0
    script = out / "launch.sbatch"
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    for option in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu", "--time=48:00:00",
                   f"--output={out}/slurm-%j.out"):
        assert f"#SBATCH {option}\n" in text

    result = dry_run(script, "l0,l1,r0,r1", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sandboxes = [line for line in lines if "sandbox_server" in line]
    assert len(sandboxes) == 2 and all(f"'--nodelist=r{i}'" in sandboxes[i] for i in range(2))
    servers = [line for line in lines if "vllm.entrypoints" in line]
    assert len(servers) == 2 and all("'--gpus-per-node=8'" in line and line.endswith("&") for line in servers)
    assert "--gpu-memory-utilization 0.85" in servers[0] and "VLLM_SERVER_DEV_MODE=1" in servers[0]
    arguments = learner_arguments(result.stdout)
    assert arguments[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=l0,l1",
                             "--overlap"]
    assert "--kill-on-bad-exit=1" in arguments and arguments[arguments.index("-m") + 1] == "experiments.train"
    assert values(arguments, "--sandbox_url") == ["http://r0:8080", "http://r1:8080"]
    urls = tuple(f"http://r{node}:{8000 + k}" for node in range(2) for k in range(8))
    try:
        parse_gin(values(arguments, "--gin_file"), values(arguments, "--gin_param"))
        assert gin.query_parameter("distributed.initialize") is True
        assert gin.query_parameter("RLSettings.seed") == 3
        backend = RolloutBackend()
        assert backend.backend == "vllm" and backend.vllm_urls == urls
    finally:
        gin.clear_config()
    assert result.stdout.rstrip().endswith("launch: the learner exited with status 0")

    short = dry_run(script, "l0,l1,r0", tmp_path)
    assert short.returncode == 1 and "launch: 4 nodes needed, the job has 3" in short.stderr


def test_each_server_of_a_node_gets_its_own_gpus_and_port(tmp_path: Path) -> None:
    echo = ("sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES $HIP_VISIBLE_DEVICES $EXTRA $*"', "server", "--port", "0",
            "--flag")
    plan = LaunchPlan(repo=str(tmp_path), run_dir=str(tmp_path), python="python", train_command=("true",),
                      server_command=echo, server_env=(("EXTRA", "a b"),), rollout_nodes=1, gpus_per_node=4,
                      gpus_per_server=2, servers_per_node=2)
    program = re.search(r"^NODE_SERVERS=(.*?)^VLLM_URLS", sbatch_script(plan), re.S | re.M).group(1)
    (tmp_path / "logs").mkdir()
    subprocess.run(["bash", "-c", shlex.split(program)[0]], check=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    logs = sorted((tmp_path / "logs").glob("vllm-*.log"))
    assert [path.read_text().strip() for path in logs] == [
        "4,5 4,5 a b --flag --port 8000 --tensor-parallel-size 2",
        "6,7 6,7 a b --flag --port 8001 --tensor-parallel-size 2"]
    with pytest.raises(ValueError, match="3 servers x 2 GPUs do not fit a node's 4 GPUs"):
        sbatch_script(LaunchPlan(str(tmp_path), str(tmp_path), "python", ("true",), echo, rollout_nodes=1,
                                 gpus_per_node=4, gpus_per_server=2, servers_per_node=3))


def test_a_bad_binding_or_model_stops_it_before_any_script(model: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--model", str(model), "--out", str(tmp_path / "run"), "--gin_param", "RLSettings.group_sise = 2"])
    assert "group_sise" in capsys.readouterr().err and not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "run")])
    assert "is not a model folder" in capsys.readouterr().err


@pytest.mark.slow
def test_submit_runs_it_on_the_one_node_cluster(slurm_cluster: SlurmCluster, model: Path,  # noqa: F811
                                                tmp_path: Path, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSTAR_LAUNCH_DRY_RUN", "1")  # sbatch exports it: the job prints its commands
    out = tmp_path / "run"
    assert main(["--model", str(model), "--out", str(out), "--partition", slurm_cluster.partition,
                 "--time", "5", "--submit"]) == 0
    job = re.search(r"submitted job (\d+)", capsys.readouterr().out).group(1)
    deadline = time.monotonic() + 120
    while slurm_cluster.command("squeue", "-h", "-j", job).strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    output = (out / f"slurm-{job}.out").read_text()
    node = slurm_cluster.node
    assert f"'--nodelist={node}'" in output and f"http://{node}:8080" in output, output
    arguments = learner_arguments(output)
    assert values(arguments, "--sandbox_url") == [f"http://{node}:8080"]
    assert values(arguments, "--gin_param") == ["distributed.initialize = True"], "no rollout nodes: no vllm_urls"
    assert output.rstrip().endswith("launch: the learner exited with status 0")
