"""Session fixture of the train tests: the format-SFT'd tiny model, built once (see sft_fixture.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sft_fixture import sft_model_dir as build_sft_model_dir


@pytest.fixture(scope="session")
def sft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF folder of the tiny model after `python -m experiments.sft` with gin/sft/tiny_format.gin."""
    return build_sft_model_dir(tmp_path_factory)
