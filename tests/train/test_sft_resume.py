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
    "train_sft.short_batch_size = 4", "train_sft.steps = 6", "train_sft.batch_size = 4", "train_sft.num_transcripts = 8", "train_sft.save_every = 2",
    "train_sft.pad_multiple = 256",
]


@pytest.fixture
def small_sft_config():
    parse_gin([TINY_MODEL_GIN, DEFAULT_GIN], SMALL_RUN)
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
    assert train_sft(interrupted, stop_at_step=7) is None  # dies after step 7; last checkpoint: step 6
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir() if p.name.isdigit())[-1] == "6"
    assert train_sft(interrupted) == interrupted / "model"

    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["resumed_from_step"] == 6 and json.loads((whole / "summary.json").read_text())[
        "resumed_from_step"] == 0
    log, reference = read_metrics(interrupted / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert [e["step"] for e in log] == list(range(1, 9))
    assert [e["phase"] for e in log] == ["drills", "short"] + ["transcripts"] * 6
    assert [e["loss"] for e in log] == [e["loss"] for e in reference]
    resumed, uninterrupted = load_file(interrupted / "model" / "model.safetensors"), load_file(
        model_dir / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert resumed[name].tobytes() == uninterrupted[name].tobytes(), name
    assert (whole / "model" / "tokenizer.json").is_file()
