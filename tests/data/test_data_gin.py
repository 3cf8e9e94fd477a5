"""The data/reward gin file parses and its bindings reach the pipeline and the verifier pool."""

from __future__ import annotations

import pathlib

import gin
import pytest

from rstar_jax.data.pipeline import prompt_batches
from rstar_jax.data.problem import Problem
from rstar_jax.reward import VerifierPool

GIN_FILE = pathlib.Path(__file__).resolve().parents[2] / "gin" / "data" / "prompts_and_rewards.gin"


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_gin_file_binds_pipeline_and_pool(clean_gin) -> None:
    gin.parse_config_files_and_bindings(
        [str(GIN_FILE)], ["prompt_batches.batch_size = 3", "VerifierPool.num_workers = 1"]
    )
    problems = [Problem(f"t/{i}", "q", str(i), "t") for i in range(7)]
    assert [len(batch) for batch in prompt_batches(problems)] == [3, 3, 1]
    with VerifierPool() as pool:
        assert (pool.num_workers, pool.timeout_s) == (1, 10.0)
        assert pool.verify_batch(["\\boxed{3}"], ["3"]) == [True]
