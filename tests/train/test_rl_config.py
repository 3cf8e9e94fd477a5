"""A misconfigured RL run stops before any work with a message naming what is wrong (issue 9 item 3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gin
import jax
import pytest

from rstar_jax.data.problem_source import ProblemSource
from rstar_jax.gin_setup import GinConfigError, parse_gin
from rstar_jax.model import ModelConfig, init_params
from rstar_jax.rollout.backends import RolloutBackend
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.router import FailoverEngine
from rstar_jax.train.rl_setup import RLSettings, rl_setup
from rstar_jax.train.rl_trainer import RLTrainer
from rstar_jax.train.stages import Stage, stage_at
from tests.engine_shapes import few_engine_shapes

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = ModelConfig(family="qwen3", vocab_size=2048, hidden_size=32, intermediate_size=40, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=32, max_position_embeddings=4096)
SYNTHETIC = ProblemSource(source="synthetic", count=8, seed=3, split="train")


def _trainer(tmp_path: Path, stage: Stage, **settings: object) -> RLTrainer:
    params = init_params(CONFIG, jax.random.key(0))
    parse_gin([], ["rl_optimizer.warmup_steps = 0"])  # the recipe's 20 warm-up steps do not fit a 1-step run
    try:
        setup = rl_setup(RLSettings(stages=(stage,), **settings), backend=RolloutBackend(max_len=1024))
    finally:
        gin.clear_config()
    return RLTrainer(tmp_path, CONFIG, params, "tiny", setup)


def test_a_prompt_and_budget_larger_than_the_engine_slot_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"stage 'long'.*exceeds the engine's 1024 tokens per sequence; lower Stage.max_response_tokens"):
        _trainer(tmp_path, Stage(name="long", max_response_tokens=900, data=SYNTHETIC))
    assert not any(tmp_path.iterdir()), "nothing is written before the check"


def test_missing_data_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no_such_set"):
        _trainer(tmp_path, Stage(data=ProblemSource(source="/no/such/dir/no_such_set.jsonl")))


@pytest.mark.parametrize("settings, message", [
    ({"group_size": 1}, "group_size must be >= 2"),
    ({"prompts_per_step": 0}, "prompts_per_step must be >= 1"),
    ({"zero_variance": "keep"}, "zero_variance must be one of"),
    ({"stages": ()}, "at least one stage"),
])
def test_impossible_settings_are_named(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RLSettings(**{"stages": (Stage(data=SYNTHETIC),), **settings})


def test_stage_checks_and_positions() -> None:
    with pytest.raises(ValueError, match="data_filter"):
        Stage(data_filter="hardest")
    with pytest.raises(ValueError, match="distinct"):
        RLSettings(stages=(Stage(name="a"), Stage(name="a")))
    stages = (Stage(name="a", steps=3), Stage(name="b", steps=2))
    assert [stage_at(stages, step) for step in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]


def test_stages_come_from_scoped_gin_bindings() -> None:
    try:
        parse_gin([], ["RLSettings.stages = [@one/Stage(), @two/Stage()]", "one/Stage.name = 'one'",
                       "one/Stage.steps = 2", "two/Stage.name = 'two'", "two/Stage.max_turns = 15",
                       "two/Stage.reset_optimizer = True", "two/Stage.data = @two/ProblemSource()",
                       "two/ProblemSource.source = 'synthetic'", "two/ProblemSource.count = 5"])
        settings = RLSettings()
    finally:
        gin.clear_config()
    assert [s.name for s in settings.stages] == ["one", "two"] and settings.total_steps == 3
    assert settings.stages[1].max_turns == 15 and settings.stages[1].reset_optimizer
    assert settings.stages[1].data == ProblemSource(source="synthetic", count=5)


def test_an_unknown_gin_binding_stops_the_command_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(GinConfigError, match="RLSettings.prompts_per_stp"):
        parse_gin([], ["RLSettings.prompts_per_stp = 4"])
    gin.clear_config()
    result = subprocess.run([sys.executable, "-m", "experiments.train", "--model", str(tmp_path / "none"), "--out",
                             str(tmp_path / "run"), "--gin_param", "RLSettings.prompts_per_stp = 4"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "prompts_per_stp" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_rollout_router_is_one_gin_switch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown rollout router 'fastest'; choose from \('failover', 'balancer'\)"):
        RolloutBackend(router="fastest")
    params = init_params(CONFIG, jax.random.key(0))
    parse_gin([], few_engine_shapes(256))
    try:
        for router, kind in (("failover", FailoverEngine), ("balancer", Balancer)):
            with RolloutBackend(router=router, jax_engines=2, slots=2, max_len=256).start(
                    CONFIG, params, tmp_path, "tiny") as engines:
                assert type(engines.engine) is kind and len(engines.engine.engines) == 2
    finally:
        gin.clear_config()
