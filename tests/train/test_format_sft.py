"""The format SFT's goal (gin/sft/tiny_format.gin): new problems get parseable tool calls, some get solved."""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest

from experiments.sft import DEFAULT_GIN
from rstar_jax.eval.format_probe import calls_parse, probe_format
from rstar_jax.gin_setup import parse_gin
from rstar_jax.reward import VerifierPool
from rstar_jax.train.metrics import read_metrics
from tests.engine_shapes import few_engine_shapes

CALL = ('<tool_call>\n{"name": "execute_python_code_with_standard_io", '
        '"arguments": {"code": "print(1)", "input": ""}}\n</tool_call>')


def test_calls_parse_needs_every_call_to_parse() -> None:
    assert calls_parse(f"<reason>x</reason>\n{CALL}<|im_end|>")
    assert not calls_parse("<reason>no call</reason><|im_end|>")
    assert not calls_parse(CALL + '\n<tool_call>\n{"name": "execute_python_code_with_standard_io"')
    assert not calls_parse(CALL.replace('"code"', '"cod"'))


@pytest.mark.slow
def test_sft_model_calls_the_tool_on_new_problems(sft_model_dir: Path, verifier: VerifierPool) -> None:
    losses = [entry["loss"] for entry in read_metrics(sft_model_dir.parent / "metrics.jsonl")]
    assert losses[-1] < 0.25 * losses[0], losses
    parse_gin([DEFAULT_GIN], few_engine_shapes())  # the SFT's prompt wording
    try:
        result = probe_format(sft_model_dir, verifier, num_problems=32)
    finally:
        gin.clear_config()
    # Measured with gin/sft/tiny_format.gin (copy drills, short transcripts, whole transcripts), 32 new problems:
    # sampled (T=1) first turns parse in 94-100%, greedy solves make ~1 tool call each. Greedy accuracy was 34-41%
    # with the earlier drills, 56% with the demo's 400 drill steps (seed 1) and 6% with the fixture's 100 (numbers
    # are copied badly after so few). Thresholds leave room for run-to-run variation.
    assert result["tool_call_rate"] >= 0.75, json.dumps(result["samples"][:3], indent=1)
    assert result["greedy_tool_calls"] >= 0.75
    # Greedy accuracy is reported, not asserted: a few problems in 32 flip with the JAX engine's batch
    # composition, and a test that can flip on that would be flaky.
    print(f"greedy accuracy on {len(result['samples'])} new problems: {result['greedy_accuracy']:.2f}")
