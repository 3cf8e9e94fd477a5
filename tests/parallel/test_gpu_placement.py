"""One node shared by the learner and the vLLM servers it launches (issue 22 item 5): each side's GPUs from gin, the
servers' environments and flags, and the errors for placements that overlap or leave the node. Pure functions (no
GPU here); one subprocess checks that this JAX version takes the learner's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gin
import jax
import pytest

import experiments.train  # noqa: F401  (registers every configurable the paper configs bind)
from rstar_jax.gin_setup import parse_gin
from rstar_jax.parallel.gpu_placement import (LearnerDevices, apply_learner_devices, check_gpu_placement,
                                              learner_devices, server_gpu_placement)
from rstar_jax.paths import REPO_ROOT
from rstar_jax.rollout import vllm_server
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.rollout.kv_budget import flag_value
from rstar_jax.rollout.vllm_server import launch_servers, server_command, server_launch_options


def test_a_server_on_its_gpus_gets_them_as_visible_devices_and_as_its_tensor_parallel_size() -> None:
    env, args = server_gpu_placement((5,), environ={})
    assert env == {"CUDA_VISIBLE_DEVICES": "5", "HIP_VISIBLE_DEVICES": "5"}
    assert args == ["--tensor-parallel-size", "1"]
    env, args = server_gpu_placement([6, 7], environ={})
    assert env["CUDA_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == "6,7"
    assert args == ["--tensor-parallel-size", "2"]


def test_server_gpus_index_the_gpus_the_trainer_itself_sees() -> None:
    # a scheduler gave the trainer physical GPUs 2, 3, 6, 7: index 1 is physical GPU 3
    env, _ = server_gpu_placement((1, 3), environ={"CUDA_VISIBLE_DEVICES": "2,3,6,7"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3,7"
    env, _ = server_gpu_placement((0,), environ={"HIP_VISIBLE_DEVICES": "4,5"})
    assert env["HIP_VISIBLE_DEVICES"] == "4"
    with pytest.raises(ValueError, match="placed on GPU 4, but this process sees only 4 GPUs"):
        server_gpu_placement((4,), environ={"CUDA_VISIBLE_DEVICES": "2,3,6,7"})


def test_the_launched_command_ends_with_the_servers_tensor_parallel_size(tmp_path: Path) -> None:
    gin.parse_config("server_command.extra_args = ['--tensor-parallel-size', '8', '--gpu-memory-utilization', "
                     "'0.85']")
    try:
        env, args = server_launch_options({"VLLM_X": "1", "CUDA_VISIBLE_DEVICES": "all"}, ["--enforce-eager"],
                                          (2, 3), {"EXTRA": "e"})
        command = [*server_command(tmp_path, 8000), *args]
    finally:
        gin.clear_config()
    assert env == {"VLLM_X": "1", "CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "2,3", "EXTRA": "e"}
    assert flag_value(command, "--tensor-parallel-size") == "2"           # the last flag wins, as in vLLM's argparse
    assert flag_value(command, "--gpu-memory-utilization") == "0.85" and "--enforce-eager" in command


def test_launch_servers_gives_each_server_its_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[dict[str, str], list[str]]] = []

    class Stub:
        def close(self) -> None:
            pass

    def start(model_dir, extra_env=None, extra_args=(), **options):
        started.append((extra_env, list(extra_args)))
        return Stub()

    monkeypatch.setattr(vllm_server, "start_server", start)
    monkeypatch.setattr(vllm_server, "wait_healthy", lambda server: server)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    launch_servers(tmp_path, 3, per_server_gpus=[(4,), (5, 6), (7,)], extra_env={"A": "1"},
                   extra_args=["--max-num-seqs", "8"])
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in started] == ["4", "5,6", "7"]
    assert all(env["A"] == "1" for env, _ in started)
    assert [args for _, args in started] == [["--max-num-seqs", "8", "--tensor-parallel-size", str(n)]
                                             for n in (1, 2, 1)]
    with pytest.raises(ValueError, match="per_server_gpus has 2 entries for 3 servers"):
        launch_servers(tmp_path, 3, per_server_gpus=[(4,), (5,)])
    with pytest.raises(ValueError, match="GPU 5 is given to both vLLM server 0"):
        launch_servers(tmp_path, 2, per_server_gpus=[(4, 5), (5,)])


def test_overlapping_or_out_of_node_placements_are_refused() -> None:
    check_gpu_placement((0, 1, 2, 3), [(4,), (5,), (6,), (7,)], node_gpus=8)
    check_gpu_placement(None, [(0,), (1,)])
    with pytest.raises(ValueError, match=r"GPU 3 is given to both the learner \(learner_devices.gpus\) and vLLM "
                                         r"server 1 \(RolloutBackend.vllm_per_server_gpus\[1\]\)"):
        check_gpu_placement((0, 1, 2, 3), [(4,), (3,)], node_gpus=8)
    with pytest.raises(ValueError, match="placed on GPU 8, but the node has 8 GPUs"):
        check_gpu_placement((0, 1), [(7,), (8,)], node_gpus=8)
    with pytest.raises(ValueError, match="names a GPU twice"):
        check_gpu_placement((0, 0), [])
    with pytest.raises(ValueError, match="non-negative int"):
        check_gpu_placement((0,), [(-1,)])
    with pytest.raises(ValueError, match="non-empty"):
        check_gpu_placement(None, [()])


def test_rollout_backend_checks_its_server_gpus() -> None:
    backend = RolloutBackend(backend="vllm", vllm_servers=2, vllm_per_server_gpus=[[4], [5, 6]])
    assert backend.launched_server_gpus == ((4,), (5, 6))
    assert RolloutBackend(backend="jax", vllm_servers=1, vllm_per_server_gpus=[[0]]).launched_server_gpus == ()
    with pytest.raises(ValueError, match="2 entries for vllm_servers = 3"):
        RolloutBackend(backend="vllm", vllm_servers=3, vllm_per_server_gpus=[[4], [5]])
    with pytest.raises(ValueError, match="bind one of the two"):
        RolloutBackend(backend="vllm", vllm_servers=1, vllm_urls=["http://a:8000"], vllm_per_server_gpus=[[4]])
    with pytest.raises(ValueError, match="GPU 4 is given to both"):
        RolloutBackend(backend="vllm", vllm_servers=2, vllm_per_server_gpus=[[4], [4]])


def test_learner_devices_validate_their_fields() -> None:
    assert LearnerDevices() == LearnerDevices(None, None, None)
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        LearnerDevices(memory_fraction=1.5)
    with pytest.raises(ValueError, match="node_gpus must be >= 1"):
        LearnerDevices(node_gpus=0)


def test_the_one_node_config_places_learner_and_servers_apart() -> None:
    gin.add_config_file_search_path(str(REPO_ROOT))
    try:
        parse_gin(["paper/one_node_qwen3_1_7b.gin"], [])
        learner, backend = learner_devices(), RolloutBackend()
        assert learner == LearnerDevices((0, 1, 2, 3), 0.9, 8)
        assert backend.launched_server_gpus == ((4,), (5,), (6,), (7,)) and backend.vllm_servers == 4
        check_gpu_placement(learner.gpus, backend.launched_server_gpus, learner.node_gpus)
        gin.clear_config()
        parse_gin(["paper/one_node_qwen3_1_7b.gin"], ["learner_devices.gpus = (0, 1, 2, 3, 4)"])
        with pytest.raises(ValueError, match="GPU 4 is given to both the learner"):
            apply_learner_devices(learner_devices(), RolloutBackend().launched_server_gpus, environ={})
    finally:
        gin.clear_config()


def test_applying_learner_devices_after_jax_started_is_refused() -> None:
    jax.devices()
    environ: dict[str, str] = {}
    apply_learner_devices(LearnerDevices(), [(4,)], environ=environ)  # nothing placed: nothing to do
    with pytest.raises(RuntimeError, match="before JAX creates its backends"):
        apply_learner_devices(LearnerDevices(gpus=(0,), memory_fraction=0.5), [(4,)], environ=environ)
    assert environ == {}


def test_this_jax_takes_the_learners_visible_devices_and_memory_fraction() -> None:
    script = (
        "import json, os, jax\n"
        "from rstar_jax.parallel.gpu_placement import LearnerDevices, apply_learner_devices\n"
        "apply_learner_devices(LearnerDevices(gpus=(0, 1), memory_fraction=0.6, node_gpus=4), [(2,), (3,)])\n"
        "print(json.dumps([jax.config.read('jax_cuda_visible_devices'), jax.config.read('jax_rocm_visible_devices'),"
        " os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], jax.device_count() >= 1]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["0,1", "0,1", "0.6", True]
