"""experiments.sft end to end on a shrunken model: real sandbox transcripts, checkpoints, a killed run resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gin
import pytest
from safetensors.numpy import load_file

from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN, train_sft
from rstar_jax.gin_setup import parse_gin

pytestmark = pytest.mark.slow

SMALL_RUN = [
    "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128", "ModelConfig.num_layers = 2",
    "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1",
    "train_sft.steps = 6", "train_sft.batch_size = 4", "train_sft.num_transcripts = 8",
    "checkpoint_manager.save_every = 2", "bucket_length.multiple = 256",
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
    assert train_sft(interrupted, stop_at_step=5) is None  # dies after step 5; last checkpoint: step 4
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir() if p.name.isdigit())[-1] == "4"
    assert train_sft(interrupted) == interrupted / "model"

    metrics = json.loads((interrupted / "metrics.json").read_text())
    reference = json.loads((whole / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 4 and reference["resumed_from_step"] == 0
    assert [e["step"] for e in metrics["log"]] == list(range(1, 7))
    assert [e["loss"] for e in metrics["log"]] == [e["loss"] for e in reference["log"]]
    resumed, uninterrupted = load_file(interrupted / "model" / "model.safetensors"), load_file(
        model_dir / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert resumed[name].tobytes() == uninterrupted[name].tobytes(), name
    assert (whole / "model" / "tokenizer.json").is_file()
