"""Fixtures for the model tests: tiny transformers checkpoints written to a temporary folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hf_reference import build_hf_model


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Factory: (folder written by save_pretrained, the torch model) for a family and config overrides."""

    def make(family: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any):
        model = build_hf_model(family, seed, **overrides)
        folder = tmp_path / f"{family}-{seed}-{len(list(tmp_path.iterdir()))}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(folder, **kwargs)
        return folder, model

    return make
