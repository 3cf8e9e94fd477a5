"""The staged RL trainer end to end on the format-SFT'd tiny model, a real sandbox and the JAX engine (issue 9):
a run killed with SIGKILL at an arbitrary moment and started again with the same command continues exactly as the
uninterrupted run: the same metrics step for step and bit-identical final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from rstar_jax.train.metrics import read_metrics

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
    "RolloutBackend.slots = 16",
]


def _train_command(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "experiments.train", "--model", str(model), "--out", str(out),
            *(arg for param in SMALL_RL for arg in ("--gin_param", param))]


def _environment() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def _run(model: Path, out: Path) -> None:
    result = subprocess.run(_train_command(model, out), cwd=REPO_ROOT, env=_environment(), capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def _kill_during_step(model: Path, out: Path, after_steps: int, delay_s: float) -> int:
    """Start the run and SIGKILL its whole process group `delay_s` after `after_steps` steps were logged; returns
    the steps logged when it died."""
    process = subprocess.Popen(_train_command(model, out), cwd=REPO_ROOT, env=_environment(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 1500
        while len(read_metrics(out / "metrics.jsonl")) < after_steps:
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(delay_s)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return len(read_metrics(out / "metrics.jsonl"))


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


def test_a_killed_run_resumes_to_the_same_metrics_and_weights(sft_model_dir: Path, tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(sft_model_dir, whole)
    reference = read_metrics(whole / "metrics.jsonl")
    assert [entry["step"] for entry in reference] == [1, 2, 3]
    assert [entry["stage"] for entry in reference] == ["a", "a", "b"]
    assert any(entry["groups_kept"] for entry in reference), "some group had mixed rewards, so weights moved"
    logged = _kill_during_step(sft_model_dir, killed, after_steps=1, delay_s=3.0)  # in step 2's rollouts or update
    assert logged < 3, "killed before the end"
    _run(sft_model_dir, killed)
    resumed_metrics = read_metrics(killed / "metrics.jsonl")
    assert _without_timings(resumed_metrics) == _without_timings(reference)
    resumed_gaps, reference_gaps = _logprob_gaps(resumed_metrics), _logprob_gaps(reference)
    assert resumed_gaps.keys() == reference_gaps.keys()
    assert list(resumed_gaps.values()) == pytest.approx(list(reference_gaps.values()), rel=0.02)
    resumed, uninterrupted = load_file(killed / "model" / "model.safetensors"), load_file(
        whole / "model" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert resumed[name].tobytes() == uninterrupted[name].tobytes(), name
    for entry in reference[1:]:
        if "logprob_gap" in entry:  # rollouts after a weight push were sampled by the pushed weights
            assert entry["logprob_gap"] < 1e-4, entry
    assert (whole / "plots" / "accuracy.png").is_file() and (whole / "tensorboard").is_dir()
    print(json.dumps(_without_timings(reference), indent=1))
