"""The main job's second half (experiments/demo.py): the format-SFT'd model rolls out new problems through the
JAX engine, the agent loop and a real sandbox server, and every trajectory is verified and counted."""

from __future__ import annotations

from pathlib import Path

import gin
import pytest

from experiments.demo import DEMO_GIN, rollout_demo
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.gin_setup import parse_gin


@pytest.mark.slow
def test_demo_rollouts_of_the_sft_model_are_all_accounted_for(sft_model_dir: Path) -> None:
    parse_gin([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN])  # the demo's own prompt wording, turn limit and budget
    try:
        summary = rollout_demo(sft_model_dir, problems=4, samples_per_problem=4)
    finally:
        gin.clear_config()
    assert summary["trajectories"] == 16
    assert sum(summary["finish_reasons"].values()) == 16
    assert summary["tool_calls"] >= 8, "the SFT'd model calls the tool in most trajectories"
    assert summary["tool_calls"] == sum(summary["tool_statuses"].values())
    assert 0.0 <= summary["accuracy"] <= 1.0 and summary["solved_problems"] <= 4
    assert summary["example"], "the example trajectory's text is reported"
