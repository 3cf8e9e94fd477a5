"""The format-SFT'd tiny model as a test fixture: `experiments.sft` run once, as a subprocess, into a temp folder.

Wrap it session-scoped where a test needs a model that writes tool calls (e.g. rollouts through the sandbox):

    from tests.train.sft_fixture import sft_model_dir as build_sft_model_dir

    @pytest.fixture(scope="session")
    def sft_model_dir(tmp_path_factory):
        return build_sft_model_dir(tmp_path_factory)

The folder is a Hugging Face model folder with the tiny tokenizer. Its prompts must use the SFT's system prompt
(gin/sft/tiny_format.gin binds prompt_messages.system_prompt): include that gin file when rolling it out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SFT_GIN = "sft/tiny_format.gin"
# The fixture's tests need the agent format (tool calls that parse, answers in tags), which the transcripts teach, not
# the copying of numbers the drills teach: 100 of the demo's 400 drill steps, and half its transcript steps (the
# demo's count until 51e7892), keep the session's SFT at ~6 minutes (368 s measured) and CI within its 45. Number
# tokens keep their plain weight in the loss and the drills hold no repeated number lists and train on every token, as
# when the tests' thresholds were measured, and the copy gate measures nothing.
FIXTURE_BINDINGS = ("train_sft.drill_steps = 100", "train_sft.short_steps = 100", "train_sft.steps = 40",
                    "train_sft.number_loss_weight = 1.0", "train_sft.drill_repeats = 0.0",
                    "train_sft.drill_assistant_only = False", "train_sft.copy_gate = None")


def run_format_sft(out: Path, gin_params: Sequence[str] = (), timeout_s: float = 1800) -> Path:
    """Run `python -m experiments.sft --out OUT` on one CPU device (the 8-device test flag removed); returns the
    trained HF folder, with the command's output in the error when it fails."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "experiments.sft", "--out", str(out), "--gin_file", SFT_GIN,
               *(arg for param in gin_params for arg in ("--gin_param", param))]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-6000:]}")
    return out / "model"


def sft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tiny model's HF folder (gin/sft/tiny_format.gin, fewer drill steps); wrap in a session-scoped
    fixture."""
    return run_format_sft(tmp_path_factory.mktemp("format_sft"), FIXTURE_BINDINGS)
