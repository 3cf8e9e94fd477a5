"""The staged RL trainer end to end on the format-SFT'd tiny model, a real sandbox and the JAX engine (issue 9):
the learner split over two local JAX processes of 4 CPU devices each (issue 23 items 1-2) matches one process of 8
devices, and a run whose process is killed with SIGKILL mid-step, started again with the same commands, continues
exactly as the uninterrupted run: the same metrics step for step and bit-identical final weights."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import portpicker
import pytest
import transformers
from safetensors.numpy import load_file

from rstar_jax.train.metrics import read_metrics
from tests.engine_shapes import few_engine_shapes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
REPO_ROOT = Path(__file__).resolve().parents[2]
# Three steps in two stages (the second resets the optimiser), 4 prompts x 4 rollouts (RoC keeps 2 of 4). The first
# stage draws digit counts, the kind the fixture's briefly drilled SFT model solves most often, so groups with mixed
# rewards (and so weight updates) come early.
SMALL_RL = [
    "RLSettings.stages = [@a/Stage(), @b/Stage()]",
    "a/Stage.name = 'a'", "a/Stage.steps = 2", "a/Stage.max_response_tokens = 384", "a/Stage.max_turns = 3",
    "a/Stage.data = @a/ProblemSource()", "a/ProblemSource.source = 'synthetic'", "a/ProblemSource.count = 64",
    "a/ProblemSource.seed = 31", "a/ProblemSource.split = 'train'", "a/ProblemSource.kinds = ('digit_count',)",
    "b/Stage.name = 'b'", "b/Stage.steps = 1", "b/Stage.max_response_tokens = 384", "b/Stage.max_turns = 3",
    "b/Stage.reset_optimizer = True", "b/Stage.data = @b/ProblemSource()", "b/ProblemSource.source = 'synthetic'",
    "b/ProblemSource.count = 64", "b/ProblemSource.seed = 32", "b/ProblemSource.difficulty = 2",
    "b/ProblemSource.split = 'train'",
    "RLSettings.prompts_per_step = 4", "RLSettings.group_size = 2", "RLSettings.micro_batch_rows = 4",
    "RolloutBackend.slots = 16", *few_engine_shapes(),
]


def _train_command(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "experiments.train", "--model", str(model), "--out", str(out),
            *(arg for param in SMALL_RL for arg in ("--gin_param", param))]


def _environment(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}


def _commands(model: Path, out: Path, processes: int) -> list[tuple[list[str], dict[str, str]]]:
    """The command line and environment of each process of a run: one process of 8 devices, or `processes` local
    JAX processes of 8 / processes devices each forming one distributed system (fsdp over all 8 either way)."""
    mesh = ["--gin_param", "make_mesh.fsdp = 8"]
    if processes == 1:
        return [(_train_command(model, out) + mesh, _environment(8))]
    port = portpicker.pick_unused_port()
    return [(_train_command(model, out) + mesh + [
        "--gin_param", "distributed.initialize = True",
        "--gin_param", f"distributed.coordinator_address = '127.0.0.1:{port}'",
        "--gin_param", f"distributed.num_processes = {processes}", "--gin_param", f"distributed.process_id = {index}",
        "--gin_param", "distributed.heartbeat_timeout_s = 10"],
        _environment(8 // processes)) for index in range(processes)]


def _start(model: Path, out: Path, processes: int) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=(out.parent / f"{out.name}.{index}.log").open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
            for index, (command, env) in enumerate(_commands(model, out, processes))]


def _run(model: Path, out: Path, processes: int = 1) -> None:
    started = _start(model, out, processes)
    try:
        codes = [process.wait(timeout=1800) for process in started]
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    logs = "\n".join((out.parent / f"{out.name}.{index}.log").read_text()[-4000:] for index in range(processes))
    assert codes == [0] * processes, logs


# Not bit-exact across runs: the rollout side of `logprob_gap` (the engine's own log-probs of its samples). Seen once:
# 4.4310e-07 against 4.4389e-07 at step 2, every other metric and the final weights bit-identical. The likely cause
# (not isolated): a decode call attends over the smallest window that holds the longest co-running sequence, which
# trajectories run together depends on when sandbox calls return, and another window rounds the same sums
# differently in the last bit. Training never reads these log-probs (the learner recomputes old log-probs).
NOT_BIT_EXACT = ("seconds", "logprob_gap")


def _without_timings(entries: list[dict]) -> list[dict]:
    return [{key: value for key, value in entry.items() if key not in NOT_BIT_EXACT} for entry in entries]


def _logprob_gaps(entries: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["logprob_gap"] for entry in entries if "logprob_gap" in entry}


@pytest.fixture(scope="module")
def whole(sft_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, one process of 8 devices."""
    out = tmp_path_factory.mktemp("rl") / "whole"
    _run(sft_model_dir, out)
    return out


def _weights(run: Path) -> dict[str, np.ndarray]:
    return load_file(run / "model" / "model.safetensors")


def _assert_same_run(resumed: Path, reference_run: Path) -> None:
    """The same metrics step for step (log-prob gaps within 2%: see NOT_BIT_EXACT) and bit-identical weights."""
    resumed_metrics, reference = read_metrics(resumed / "metrics.jsonl"), read_metrics(reference_run / "metrics.jsonl")
    assert _without_timings(resumed_metrics) == _without_timings(reference)
    resumed_gaps, reference_gaps = _logprob_gaps(resumed_metrics), _logprob_gaps(reference)
    assert resumed_gaps.keys() == reference_gaps.keys()
    # Gaps of ~5e-7 are float rounding; since the engine keeps caches between turns (extend vs prefill) a resumed
    # run's differ by more than 2% of that (seen: 5.03e-7 vs 5.14e-7), hence the absolute floor of 1e-6.
    assert list(resumed_gaps.values()) == pytest.approx(list(reference_gaps.values()), rel=0.02, abs=1e-6)
    weights, uninterrupted = _weights(resumed), _weights(reference_run)
    assert weights.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert weights[name].tobytes() == uninterrupted[name].tobytes(), name


def test_the_uninterrupted_run_trains_three_steps_in_two_stages_on_pushed_weights(whole: Path) -> None:
    """The reference both processes' runs are held to. (A killed single-process run resumed exactly too; that test
    was folded into the two-process one below, which kills and resumes the same code path, to keep CI in budget.)"""
    reference = read_metrics(whole / "metrics.jsonl")
    assert [entry["step"] for entry in reference] == [1, 2, 3]
    assert [entry["stage"] for entry in reference] == ["a", "a", "b"]
    assert any(entry["groups_kept"] for entry in reference), "some group had mixed rewards, so weights moved"
    for entry in reference[1:]:
        if "logprob_gap" in entry:  # rollouts after a weight push were sampled by the pushed weights
            assert entry["logprob_gap"] < 1e-4, entry
    assert (whole / "plots" / "accuracy.png").is_file() and (whole / "tensorboard").is_dir()
    print(json.dumps(_without_timings(reference), indent=1))


def test_two_processes_of_four_devices_train_as_one_of_eight_and_resume_exactly(
        sft_model_dir: Path, whole: Path, tmp_path: Path) -> None:
    """Issue 23 items 1-2: the learner over two JAX processes (process 0 drives rollouts, tools and rewards and
    broadcasts each step's batch; every process feeds its own 4 devices; the weight push gathers) gives the single
    process's metrics within 1e-5 and its weights within 1e-5 but for rounding-sized gradients (see below), writes a
    model folder transformers loads; when one process is killed (-9) mid-step, the other stops by itself with JAX's
    message naming the dead task (no hang), and the same two commands rerun continue exactly as the uninterrupted
    two-process run."""
    split, killed = tmp_path / "split", tmp_path / "killed"
    _run(sft_model_dir, split, processes=2)
    one, two = read_metrics(whole / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert any(entry["groups_kept"] for entry in one), "some group had mixed rewards, so weights moved"
    assert [sorted(entry) for entry in _without_timings(two)] == [sorted(entry) for entry in _without_timings(one)]
    for a, b in zip(_without_timings(one), _without_timings(two)):
        for key, value in a.items():
            assert b[key] == (pytest.approx(value, rel=1e-5, abs=1e-5) if isinstance(value, float) else value), key
    weights_one, weights_two = _weights(whole), _weights(split)
    assert weights_one.keys() == weights_two.keys()
    # Adam steps each weight by lr x m / sqrt(v): where a gradient is no larger than float rounding (a row of the
    # embedding few tokens touch) the two summation orders can step it by anything up to the learning rate, either
    # way. Seen once: 1 of 524,288 embedding weights 1.3e-5 apart. So all but a few weights within 1e-5, and every
    # one within the most two such runs can part: twice the summed learning rate of all updates.
    bound = 2 * sum(entry.get("learning_rate", 0.0) * entry.get("updates", 0) for entry in one)  # updating steps
    for name, value in weights_one.items():
        apart = np.abs(weights_two[name].astype(np.float64) - value)
        assert np.mean(apart > 1e-5 + 1e-5 * np.abs(value)) <= 1e-4, name
        assert apart.max() <= bound, (name, apart.max(), bound)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(split / "model")
    assert loaded.config.hidden_size == json.loads((split / "model" / "config.json").read_text())["hidden_size"]
    assert not (split / "train.process1.log").read_text().count("Traceback")

    # Process 1 dies: process 0 stops by itself, naming it, instead of waiting forever in its next collective.
    started = _start(sft_model_dir, killed, processes=2)
    try:
        while len(read_metrics(killed / "metrics.jsonl")) < 1:
            assert all(process.poll() is None for process in started), "the run ended before it could be killed"
            time.sleep(0.2)
        time.sleep(3.0)
        os.killpg(started[1].pid, signal.SIGKILL)
        assert started[0].wait(timeout=180) != 0
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    # JAX names the dead task in one of two wordings, by which side of its coordination service noticed first.
    assert re.search(r"Task 1 heartbeat timeout|unhealthy \(stopped sending heartbeats\):\s*1\b",
                     (tmp_path / "killed.0.log").read_text())
    assert len(read_metrics(killed / "metrics.jsonl")) == 1, "process 0 stopped in step 2, at its next collective"
    # The same two commands resume from the last checkpoint (both processes died mid-step 2): the uninterrupted run.
    _run(sft_model_dir, killed, processes=2)
    _assert_same_run(killed, split)
