"""The balancer over real JAX engines (SPEC section 6, issue 10): turns queue when the fleet is full and flow again
as capacity frees, no engine ever holding more than its slots; an engine closed mid-rollout (agent loop, real
sandbox, the tiny tool-calling model) loses and duplicates nothing, and leaves no reservation behind."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from agent_loop_fixtures import check_trajectory, learner_logprobs, run_rollout
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.model import CausalLM, ModelConfig, init_params
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.engine import SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.tokenizers import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, tie_word_embeddings=False)


def test_turns_queue_when_the_fleet_is_full_and_flow_again():
    params = init_params(TINY, jax.random.key(0))
    engines = [JaxEngine(TINY, params, slots=2, max_len=64, decode_steps=4) for _ in range(2)]
    balancer = Balancer(engines, part_tokens=None, scrape_interval_s=0.0)
    sampling = SamplingParams(max_new_tokens=30, seed=1)  # 20 + 30 tokens: one slot each, 2 slots per engine

    async def burst() -> tuple[int, int, list]:
        tasks = [asyncio.create_task(balancer.generate(list(range(1, 21)), sampling)) for _ in range(10)]
        # Until every turn is queued, running or (on a slow, shared machine, before the last were queued) done.
        while balancer.queued + sum(balancer.in_flight) + sum(task.done() for task in tasks) < 10:
            await asyncio.sleep(0.01)
        queued_at_start = balancer.queued
        most_held = 0  # requests an engine holds: running, or handed over and about to take the freed slot
        while not all(task.done() for task in tasks):
            capacities = await asyncio.gather(*(engine.capacity() for engine in engines))
            most_held = max(most_held, *(c.requests_running + c.requests_waiting for c in capacities))
            await asyncio.sleep(0.01)
        return queued_at_start, most_held, [task.result() for task in tasks]

    try:
        for engine in engines:
            engine.wait_ready(timeout=600)
        queued_at_start, most_held, generations = asyncio.run(asyncio.wait_for(burst(), timeout=600))
    finally:
        for engine in engines:
            engine.close()
    assert queued_at_start == 6  # 4 slots in the fleet: the other 6 turns wait in the balancer
    assert most_held == 2  # and never inside an engine beyond its slots
    assert [len(g.token_ids) for g in generations] == [30] * 10
    assert balancer.queued_requests == 6 and balancer.max_queue == 6
    assert balancer.reserved == (0, 0) and balancer.in_flight == (0, 0)


def test_an_engine_closed_mid_rollout_loses_and_duplicates_nothing(model: CausalLM, sandbox):
    engines = [JaxEngine(model.config, model.params, slots=16, max_len=1024, prefill_buckets=(512, 1024))
               for _ in range(2)]
    doomed = engines[0]
    balancer = Balancer(engines)

    async def rollout_with_a_crash():
        rollout = asyncio.create_task(run_rollout(balancer, [sandbox.url], synthetic_problems(8, seed=10), 4,
                                                  seed=50))
        while (await doomed.capacity()).requests_running == 0 and not rollout.done():
            await asyncio.sleep(0.01)
        await asyncio.to_thread(doomed.close)
        return await rollout

    try:
        for engine in engines:
            engine.wait_ready(timeout=900)
        samples = asyncio.run(rollout_with_a_crash())
    finally:
        for engine in engines:
            engine.close()
    assert list(balancer.down) == [0] and balancer.retries >= 1
    assert balancer.reserved == (0, 0) and balancer.in_flight == (0, 0) and balancer.queued == 0
    assert [(s.group, s.sample) for s in samples] == [(g, k) for g in range(8) for k in range(4)]
    tokenizer = load_tokenizer("tiny")
    for sample in samples:  # each turn appended once, with the logprobs of exactly these ids
        trajectory = sample.trajectory
        check_trajectory(trajectory, tokenizer)
        sampled = np.asarray(trajectory.loss_mask[1:]) == 1
        np.testing.assert_allclose(np.asarray(trajectory.rollout_logprobs[1:])[sampled],
                                   learner_logprobs(model, trajectory)[sampled], atol=2e-3)
