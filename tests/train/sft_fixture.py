"""The format-SFT'd tiny model as a test fixture: `experiments.sft` run once a session, as a subprocess.

tests/train/conftest.py starts it in the background as soon as collection shows that a selected test needs the
session fixture `sft_model_dir`, and that fixture waits for it. The folder is a Hugging Face model folder with the
tiny tokenizer. Its prompts must use the SFT's system prompt (gin/sft/tiny_format.gin binds
prompt_messages.system_prompt): include that gin file when rolling it out.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SFT_GIN = "sft/tiny_format.gin"
# The fixture's tests need the agent format (tool calls that parse, answers in tags), which the transcripts teach, not
# the copying of numbers the drills teach: 100 of the demo's 400 drill steps, and half its transcript steps (the
# demo's count until 51e7892), keep the session's SFT at ~4 minutes (244-266 s measured on the AVX2 machine). Number
# tokens keep their plain weight in the loss and the drills hold no repeated number lists and train on every token, as
# when the tests' thresholds were measured, and the copy gate measures nothing.
FIXTURE_BINDINGS = ("train_sft.drill_steps = 100", "train_sft.short_steps = 100", "train_sft.steps = 40",
                    "train_sft.number_loss_weight = 1.0", "train_sft.drill_repeats = 0.0",
                    "train_sft.drill_assistant_only = False", "train_sft.copy_gate = None")
# The background run trains in the cycles the tests leave idle (they keep ~1.35 of the 2 cores busy on average), under
# Linux's SCHED_IDLE policy, which gives way to any normal thread that wants a core. Tests that overlap it still slow
# down, less than at nice 19 (the policy before): the held-out backend test took 141 s beside it under SCHED_IDLE,
# 168 s at nice 19 and 102 s alone (2026-12-08).
BACKGROUND_POLICY = ("chrt", "--idle", "0")


@dataclasses.dataclass
class BackgroundSFT:
    """A running `python -m experiments.sft --out OUT` on one CPU device (the 8-device test flag removed), its output
    in `log`, in a temporary folder of its own that `remove` deletes."""

    process: subprocess.Popen
    command: list[str]
    out: Path
    log: Path

    def model_dir(self, timeout_s: float = 1800) -> Path:
        """Wait for the run; the trained HF folder, or an error holding the command's output."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"{' '.join(self.command)} still ran after {timeout_s} s:\n{self._output()}") from None
        if code != 0:
            raise RuntimeError(f"{' '.join(self.command)} failed ({code}):\n{self._output()}")
        return self.out / "model"

    def stop(self) -> None:
        """Kill the run, and the sandbox server it starts, if it is still going."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def remove(self) -> None:
        """Stop the run and delete its folder."""
        self.stop()
        shutil.rmtree(self.out.parent, ignore_errors=True)

    def _output(self) -> str:
        return self.log.read_text(errors="replace")[-8000:]


def start_fixture_sft() -> BackgroundSFT:
    """Start the session fixture's format SFT (gin/sft/tiny_format.gin with FIXTURE_BINDINGS) in the background, under
    BACKGROUND_POLICY, in a new temporary folder; its output goes to format_sft.log there."""
    root = Path(tempfile.mkdtemp(prefix="rstar-jax-tests-format-sft-"))
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    command = [*BACKGROUND_POLICY, sys.executable, "-m", "experiments.sft", "--out",
               str(root / "run"), "--gin_file", SFT_GIN,
               *(arg for param in FIXTURE_BINDINGS for arg in ("--gin_param", param))]
    log = root / "format_sft.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return BackgroundSFT(process, command, root / "run", log)
