"""The format SFT's copy gate: measure held-out copies after the SFT, and optionally train on while they fall short
(issue 24; SPEC section 5).

Whether the tiny demo model learns to copy a question's numbers into its program and an output into its answer is a
transition whose outcome depends on the seed: on the same schedule some seeds end past it and others short of it,
and RL from a model that miscopies has little to build on. After the scheduled steps the gate measures
teacher-forced copy accuracy on held-out transcripts (`rstar_jax.train.copies`) and records it in the SFT's metrics
and summary; while the copies of 2- and 3-digit numbers fall short of `min_multi_digit`, the SFT runs another round
of short then whole transcripts on a warm restart of the learning rate (`rstar_jax.train.optim`), at most `rounds`
times (0: measure only).

Measured (BENCHMARKS.md, "Copying numbers"): two such rounds did not rescue a seed whose 3-digit copies had not
formed (0.0% of them right before, 2.6% after), so the demo's config only measures (`CopyGate.rounds = 0`); what
formed that copy was a change to the drills (`train_sft.drill_repeats`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gin

from rstar_jax.train.copies import copy_accuracy, held_out_copies
from rstar_jax.model import ModelConfig
from rstar_jax.train.sft_data import cached_sft_sequences

GATE_SEED = 20_000  # the held-out transcripts' data seed: no demo or probe seed draws it
GATE_TRANSCRIPTS_FILE = "copy_gate_transcripts.jsonl"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CopyGate:
    """Keep training until held-out copies of 2- and 3-digit numbers are right at least `min_multi_digit` of the
    time (teacher-forced, on `transcripts` held-out transcripts), adding up to `rounds` rounds of `short_steps` short
    then `steps` whole transcripts, each on a learning rate that warms up again to `peak_fraction` of the SFT's."""

    min_multi_digit: float = 0.85
    transcripts: int = 32
    rounds: int = 2
    short_steps: int = 60
    steps: int = 30
    peak_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.min_multi_digit <= 1.0:
            raise ValueError(f"CopyGate.min_multi_digit must be within (0, 1], got {self.min_multi_digit}")
        if min(self.transcripts, self.round_steps) < 1 or min(self.rounds, self.short_steps, self.steps) < 0:
            raise ValueError(f"CopyGate needs transcripts >= 1, rounds, short_steps and steps >= 0 and a round of at "
                             f"least one step, got {self}")
        if not 0.0 < self.peak_fraction <= 1.0:
            raise ValueError(f"CopyGate.peak_fraction must be within (0, 1], got {self.peak_fraction}")

    @property
    def round_steps(self) -> int:
        """Steps in one round."""
        return self.short_steps + self.steps


def gate_batch(path: Path, gate: CopyGate, tokenizer: Any) -> tuple[Any, Any, Any]:
    """The gate's held-out transcripts (generated once against a sandbox server, cached at `path`) as a batch with
    each target's copy kind and digits (`held_out_copies`)."""
    sequences = cached_sft_sequences(path, gate.transcripts, GATE_SEED, tokenizer)
    return held_out_copies(tokenizer, [tokenizer.decode(list(sequence.token_ids)) for sequence in sequences])


def check_copies(params: Any, config: ModelConfig, batch: tuple[Any, Any, Any], gate: CopyGate) -> dict[str, Any]:
    """The gate's figures for `params`: 'passed', 'multi_digit' (the share of right 2- and 3-digit copies) and
    accuracy by digit count and by kind of copy."""
    figures = copy_accuracy(params, config, *batch)
    return {"passed": figures["multi_digit"] >= gate.min_multi_digit, "multi_digit": figures["multi_digit"],
            "copy_accuracy": figures["copy_accuracy"], "by_digits": figures["by_digits"],
            "by_kind": figures["by_kind"]}
