"""The format SFT end to end on a shrunken model: copy drills, real sandbox transcripts, composite checkpoints of the
train state and the data iterator, and a run stopped mid-way resumed to bit-identical weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gin
import pytest
from safetensors.numpy import load_file

from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN
from rstar_jax.gin_setup import parse_gin
from rstar_jax.train.metrics import read_metrics
from rstar_jax.train.sft_run import train_sft

pytestmark = pytest.mark.slow

SMALL_RUN = [
    "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128", "ModelConfig.num_layers = 2",
    "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1",
    "train_sft.drill_steps = 1", "train_sft.drill_batch_size = 4", "train_sft.short_steps = 1",
    "train_sft.short_batch_size = 4", "train_sft.steps = 6", "train_sft.batch_size = 4",
    "train_sft.num_transcripts = 8", "train_sft.save_every = 2", "train_sft.pad_multiple = 256",
    "train_sft.copy_gate = None",
]


@pytest.fixture
def small_sft_config():
    parse_gin([TINY_MODEL_GIN, DEFAULT_GIN], SMALL_RUN + ["train_sft.drill_steps = 3"])
    yield
    gin.clear_config()


def test_killed_run_resumes_to_bit_identical_params(tmp_path: Path, small_sft_config: None) -> None:
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    model_dir = train_sft(whole)
    assert model_dir == whole / "model"
    transcripts = [json.loads(line) for line in (whole / "transcripts.jsonl").read_text().splitlines()]
    assert transcripts[0]["key"]["count"] == 8 and len(transcripts) == 9
    assert all(len(t["token_ids"]) == len(t["loss_mask"]) and 0 < sum(t["loss_mask"]) for t in transcripts[1:])

    interrupted.mkdir()
    shutil.copyfile(whole / "transcripts.jsonl", interrupted / "transcripts.jsonl")  # the cache: no sandbox rerun
    # Killed twice: inside the drills (their batches come from the step number, not a checkpointed iterator), then
    # among the transcripts.
    assert train_sft(interrupted, stop_at_step=3) is None  # dies after step 3; last checkpoint: step 2
    assert train_sft(interrupted, stop_at_step=9) is None  # resumes after step 2, dies after step 9; checkpoint: 8
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir() if p.name.isdigit())[-1] == "8"
    assert train_sft(interrupted) == interrupted / "model"

    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8 and json.loads((whole / "summary.json").read_text())[
        "resumed_from_step"] == 0
    log, reference = read_metrics(interrupted / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert [e["step"] for e in log] == list(range(1, 11))
    assert [e["phase"] for e in log] == ["drills"] * 3 + ["short"] + ["transcripts"] * 6
    assert [e["loss"] for e in log] == [e["loss"] for e in reference]
    resumed, uninterrupted = load_file(interrupted / "model" / "model.safetensors"), load_file(
        model_dir / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert resumed[name].tobytes() == uninterrupted[name].tobytes(), name
    assert (whole / "model" / "tokenizer.json").is_file()


def test_copy_gate_adds_rounds_on_a_restarted_rate_and_resumes_bit_exact(tmp_path: Path) -> None:
    """A gate no untrained model passes: both extra rounds run (short then whole transcripts), each on a rate that
    warms up again, every check is recorded, and a run killed inside a round resumes to the same weights."""
    gate = ["train_sft.copy_gate = @CopyGate()", "CopyGate.min_multi_digit = 1.0", "CopyGate.transcripts = 4",
            "CopyGate.rounds = 2", "CopyGate.short_steps = 1", "CopyGate.steps = 2", "CopyGate.peak_fraction = 0.5"]
    parse_gin([TINY_MODEL_GIN, DEFAULT_GIN], SMALL_RUN + gate)
    try:
        whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
        model_dir = train_sft(whole)
        interrupted.mkdir()
        for cached in ("transcripts.jsonl", "copy_gate_transcripts.jsonl"):
            shutil.copyfile(whole / cached, interrupted / cached)
        assert train_sft(interrupted, stop_at_step=10) is None  # inside the first round; last checkpoint: step 8
        assert train_sft(interrupted) == interrupted / "model"
    finally:
        gin.clear_config()
    summary = json.loads((whole / "summary.json").read_text())
    assert (summary["scheduled_steps"], summary["steps"], summary["extra_rounds"]) == (8, 14, 2)
    assert [check["step"] for check in summary["copy_checks"]] == [8, 11, 14]
    assert not any(check["passed"] for check in summary["copy_checks"])
    assert all(0.0 <= check["multi_digit"] < 1.0 for check in summary["copy_checks"])
    log = [entry for entry in read_metrics(whole / "metrics.jsonl") if "loss" in entry]
    assert [e["phase"] for e in log][8:] == ["short", "transcripts", "transcripts"] * 2
    rates = [e["learning_rate"] for e in log]
    assert rates[8] > rates[7] and rates[11] > rates[10]  # each round warms up again
    assert max(rates[8:]) <= 0.5 * max(rates[:8]) + 1e-12
    resumed_log = [entry for entry in read_metrics(interrupted / "metrics.jsonl") if "loss" in entry]
    assert [e["loss"] for e in resumed_log] == [e["loss"] for e in log]
    assert json.loads((interrupted / "summary.json").read_text())["copy_checks"] == summary["copy_checks"]
    resumed, uninterrupted = (load_file(d / "model.safetensors") for d in (interrupted / "model", model_dir))
    for name in uninterrupted:
        assert resumed[name].tobytes() == uninterrupted[name].tobytes(), name
