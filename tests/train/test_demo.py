"""The main job's wiring (experiments/demo.py) on a shrunken run: SFT, held-out evaluation, GRPO-RoC (which must
move the weights), evaluation, the comparison and its files. (The full-size demo's figures are in the README and
BENCHMARKS.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from rstar_jax.train.metrics import read_metrics
from tests.engine_shapes import few_engine_shapes

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
SHRUNKEN = [
    "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128", "ModelConfig.num_layers = 2",
    "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1",
    "train_sft.drill_steps = 2", "train_sft.short_steps = 100", "train_sft.steps = 3", "train_sft.num_transcripts = 8",
    "train_sft.batch_size = 4", "train_sft.number_loss_weight = 1.0", "CopyGate.rounds = 0",
    "train_sft.drill_repeats = 0.0", "train_sft.drill_assistant_only = False",
    "RLSettings.stages = [@short/Stage()]", "short/Stage.steps = 1", "RLSettings.prompts_per_step = 2",
    # RL on the one problem the shrunken SFT solves in some samples: the first of its 8 transcripts (synthetic tasks
    # of the data seed, --seed 3 below), whose 'short' phase it has memorised. Mixed rewards, so the step updates.
    # (Those transcripts as they were drawn with half of them faulty, the demo's earlier mix: with a quarter this
    # shrunken SFT never solved the problem; number tokens at their plain loss weight, as then.)
    "short/ProblemSource.count = 1", "short/ProblemSource.seed = 3", "sft_transcripts.faulty_fraction = 0.5",
    "HeldOutEval.problems = @small/ProblemSource()", "small/ProblemSource.source = 'synthetic'",
    "small/ProblemSource.count = 4", "small/ProblemSource.split = 'heldout'", "HeldOutEval.samples = 2",
    *few_engine_shapes(),  # instead of the demo's 8 prefill buckets and 6 decode windows
]


def test_the_demo_runs_every_phase_and_reports_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "experiments.demo", "--out", str(out), "--seed", "3",
               *(arg for param in SHRUNKEN for arg in ("--gin_param", param))]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "XLA_FLAGS": ""}, capture_output=True,
                            text=True, timeout=1500)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    assert lines[0] == f"log: {out / 'demo.log'}"
    for label in ("[1/4] format SFT", "[2/4] held-out evaluation", "[3/4] GRPO-RoC", "[4/4] held-out evaluation"):
        assert any(line.startswith(label) and ": done in" in line for line in lines), label
    assert "accuracy at T=1" in result.stdout and "reference answer:" in result.stdout
    assert "accuracy by kind" in result.stdout
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["seed"] == 3 and set(summary["phase_seconds"]) == {"sft", "eval_before", "rl", "eval_after"}
    assert "train_sft.model_seed = 3" in (out / "operative_config.gin").read_text()
    changes = summary["paired_change"]  # per problem, after RL minus after SFT: its mean is the accuracy change
    assert set(changes) == {"sampled", "greedy"} and changes["sampled"]["problems"] == 4
    for mode, change in changes.items():
        assert change["mean"] == pytest.approx(summary["after_rl"][mode]["accuracy"]
                                               - summary["after_sft"][mode]["accuracy"])
    assert "T=1 accuracy change:" in result.stdout and "greedy accuracy change:" in result.stdout
    # The SFT's copy check (measured only: no extra rounds) is in the summary, as the SFT recorded it.
    (check,) = json.loads((out / "sft" / "summary.json").read_text())["copy_checks"]
    copies = summary["sft_copies"]
    assert copies["by_digits"] == check["by_digits"] and copies["copy_accuracy"] == check["copy_accuracy"]
    assert set(copies["by_digits"]) <= {"1", "2", "3"} and all(0 <= v <= 1 for v in copies["by_digits"].values())
    # Read against the committed seed range (its figures; another config than the shrunken one's), or told it is
    # missing and how to make it.
    against = summary["against_seed_range"]
    assert all(line in result.stdout for line in against)
    assert ("is missing" in against[0] and "experiments.demo_seeds" in against[0]) or any(
        line.startswith("-> your config differs") for line in against), against
    for when in ("after_sft", "after_rl"):
        sampled = summary[when]["sampled"]
        assert sampled["problems"] == 4 and sampled["samples"] == 2
        assert sum(sampled["finish_reasons"].values()) == 8
        assert summary[when]["greedy"]["samples"] == 1
        by_kind = summary["accuracy_by_kind"][when]["sampled"]
        assert set(by_kind) <= {"multiply", "modpow", "digit_sum", "digit_count"} and len(by_kind) >= 2
        records = [json.loads(line) for line in (out / f"heldout_{when}_sampled.jsonl").read_text().splitlines()]
        assert len(records) == 4 and all(len(record["correct"]) == 2 for record in records)
        assert sum(record["solved"] for record in records) / 8 == pytest.approx(sampled["accuracy"])
    assert (out / "rl" / "metrics.jsonl").is_file() and (out / "rl" / "model" / "config.json").is_file()
    assert (out / "operative_config.gin").is_file() and (out / "demo.log").read_text().count("[3/4]") == 2
    # RL moved the weights: the step had groups with reward spread and made one optimiser step with a gradient ...
    (step,) = read_metrics(out / "rl" / "metrics.jsonl")
    assert step["groups_kept"] > 0 and step["updates"] == 1 and step["trained_tokens"] > 0, step
    assert step["grad_norm"] > 0 and step["learning_rate"] == pytest.approx(1e-4)  # gin/demo/cpu_demo.gin
    # ... which the RL model folder holds: Adam's first step moves each weight by lr * g / (|g| + eps), so every
    # tensor changed, by at most the learning rate and by about that much somewhere.
    sft, rl = (load_file(out / phase / "model" / "model.safetensors") for phase in ("sft", "rl"))
    assert sft.keys() == rl.keys()
    moved = {name: float(np.max(np.abs(rl[name].astype(np.float64) - sft[name]))) for name in sft}
    assert all(value > 0 for value in moved.values()), moved
    assert max(moved.values()) == pytest.approx(1e-4, rel=0.05), moved
    # Run again into the same folder, it resumes: SFT and RL are not redone (their phases find their models), and
    # the config it fingerprints against the seed range (its bound config) is the first run's, though the resumed
    # phases read fewer bindings (sft_transcripts, synthetic_tasks, ... were not called: the SFT was done).
    bound, operative = ((out / name).read_text() for name in ("bound_config.gin", "operative_config.gin"))
    again = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "XLA_FLAGS": ""}, capture_output=True,
                           text=True, timeout=1500)
    assert again.returncode == 0, f"{again.stdout[-4000:]}\n{again.stderr[-4000:]}"
    assert (out / "bound_config.gin").read_text() == bound
    assert "sft_transcripts.max_concurrency" in operative
    assert "sft_transcripts.max_concurrency" not in (out / "operative_config.gin").read_text()
    assert len(read_metrics(out / "rl" / "metrics.jsonl")) == 1
