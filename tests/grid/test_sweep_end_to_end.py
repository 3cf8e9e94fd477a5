"""experiments/sweep.py end to end on a shrunken random model: a 2-point grid (two stage lengths) of one RL step each,
every point in its own process through experiments.train, the held-out evaluation (start model evaluated once for
both points) and the report; then a rerun that skips both points and only rewrites the report.

Kept small for CI (~1 minute): 2 prompts x 4 rollouts, 48-64 response tokens, one prefill and one decode shape, 2
held-out problems solved once. A random model gets no reward, so no update is compiled: the point is the machinery.
"""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest

from rstar_jax.gin_setup import parse_gin
from rstar_jax.model.folder import seeded_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SHRUNKEN_MODEL = ["ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128", "ModelConfig.num_layers = 2",
                  "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1"]
TINY_RUN = [
    "RLSettings.stages = [@short/Stage()]", "short/Stage.steps = 1", "short/Stage.max_turns = 2",
    "RLSettings.prompts_per_step = 2", "RLSettings.group_size = 2", "RolloutBackend.slots = 8",
    "RolloutBackend.max_len = 384", "JaxEngine.prefill_buckets = (384,)", "JaxEngine.decode_windows = (384,)",
    "HeldOutEval.problems = @small/ProblemSource()", "small/ProblemSource.source = 'synthetic'",
    "small/ProblemSource.count = 2", "small/ProblemSource.split = 'heldout'", "HeldOutEval.samples = 1",
    "HeldOutEval.greedy = False", "HeldOutEval.max_response_tokens = 48",
]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF folder of a seeded, shrunken tiny-config model (untrained)."""
    out = tmp_path_factory.mktemp("random_model")
    try:
        parse_gin(["model/tiny.gin"], SHRUNKEN_MODEL)
        seeded_model(out, seed=0)
    finally:
        gin.clear_config()
    return out


def test_a_two_point_sweep_runs_reports_and_skips_on_rerun(random_model: Path, tmp_path: Path,
                                                           capfd: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.sweep import main  # run in this process (it only checks, spawns and reports): saves an import

    monkeypatch.setenv("XLA_FLAGS", "")  # the points' processes: one CPU device, not the tests' eight
    grid = tmp_path / "sweep"
    arguments = ["--model", str(random_model), "--out", str(grid), "--grid",
                 "short/Stage.max_response_tokens=[48, 64]", *(arg for p in TINY_RUN for arg in ("--gin_param", p))]
    capfd.readouterr()
    assert main(arguments) == 0, capfd.readouterr().out[-4000:]
    output = capfd.readouterr().out
    names = ["short.Stage.max_response_tokens=48", "short.Stage.max_response_tokens=64"]
    for length, name in zip((48, 64), names):
        point = grid / "points" / name
        summary = json.loads((point / "summary.json").read_text())
        assert summary["after"]["sampled"]["problems"] == 2 and summary["start"]["sampled"]["samples"] == 1
        assert [entry["step"] for entry in map(json.loads, (point / "metrics.jsonl").read_text().splitlines())] == [1]
        config = (point / "operative_config.gin").read_text()
        assert f"short/Stage.max_response_tokens = {length}" in config and "HeldOutEval.samples = 1" in config
        assert (point / "checkpoints").is_dir() and (point / "model" / "config.json").is_file()
    assert len(list((grid / "start_eval").glob("*.json"))) == 1, "both points share the start model's evaluation"
    assert output.count("held-out evaluation of the start model") == 2, "evaluated once: its start and done lines"
    report = (grid / "report.md").read_text()
    assert "2 of 2 runs finished" in report and all(f"| {name} | 1 |" in report for name in names)
    assert (grid / "curves.png").is_file() and (grid / "heldout.png").is_file()

    assert main(arguments) == 0
    output = capfd.readouterr().out
    assert output.count("finished before, skipped") == 2 and "starting" not in output
    assert "2 of 2 runs finished" in (grid / "report.md").read_text()
