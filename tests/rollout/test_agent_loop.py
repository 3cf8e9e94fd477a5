"""The agent loop end to end: a real sandbox server, real JAX engines serving a tiny tool-calling model (issue 5
items 4-5 and the must-show with JAX engines).

Checked against references: each trajectory's rollout logprobs equal the learner's `token_logprobs` on the same
ids; its tool responses are the sandbox's answers in the order of its calls; SPEC section 2's four stop rules;
an engine closed mid-rollout loses and duplicates nothing; a dead sandbox becomes tool errors the model reads.
Sampling is seeded per turn, but the engine's batched numerics depend on which requests share a step, so
trajectories are checked against the learner, not against a second rollout.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Iterator

import numpy as np
import pytest

from agent_loop_fixtures import INVALID_CALL, check_trajectory, learner_logprobs, run_rollout
from rstar_jax.agent.trajectory import FinishReason
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.model import CausalLM
from rstar_jax.processes import free_port
from rstar_jax.rollout.agent_loop import RolloutSample
from rstar_jax.rollout.engine import SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.rollout import rollout_stats
from rstar_jax.rollout.router import AllEnginesDown, FailoverEngine
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.api import Status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SLOTS, MAX_LEN = 16, 1024
BUCKETS = (512, 1024)  # prompts are ~330 tokens, later turns' contexts up to ~850: two prefill programs to compile


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def new_engine(model: CausalLM) -> JaxEngine:
    engine = JaxEngine(model.config, model.params, slots=SLOTS, max_len=MAX_LEN, prefill_buckets=BUCKETS)
    engine.wait_ready(timeout=900)
    return engine


@pytest.fixture(scope="module")
def engines(model: CausalLM) -> Iterator[list[JaxEngine]]:
    """Two healthy engines shared by the tests that do not break engines."""
    pair = [new_engine(model), new_engine(model)]
    yield pair
    for engine in pair:
        engine.close()


def test_rollout_of_64_trajectories_with_tool_calls_on_two_jax_engines(engines, sandbox, model, tokenizer):
    """Must-show (JAX): 16 problems x 4 samples through a FailoverEngine over two engines and the real sandbox."""
    router = FailoverEngine(engines)
    problems = synthetic_problems(16, seed=5)
    start = time.perf_counter()
    samples = asyncio.run(run_rollout(router, [sandbox.url], problems, 4, seed=100))
    stats = rollout_stats(samples, time.perf_counter() - start)
    print(f"\nJAX rollout: {stats}\n  {stats.trajectories_per_s:.2f} trajectories/s, "
          f"{stats.tool_calls_per_s:.2f} tool calls/s")

    assert [(s.group, s.sample) for s in samples] == [(g, k) for g in range(16) for k in range(4)]
    assert [s.problem for s in samples] == [p for p in problems for _ in range(4)]
    assert len({s.seed for s in samples}) == 64
    for sample in samples:
        check_trajectory(sample.trajectory, tokenizer)
    assert stats.trajectories == 64 and stats.with_tool_calls >= 48, stats
    assert stats.tool_statuses.get(Status.OK, 0) >= 16, "many calls ran in the sandbox and succeeded"
    assert router.down == {} and router.retries == 0
    # ids go end to end: the engine's logprobs are the learner's on exactly the trajectory's ids
    for sample in samples[::16]:
        trajectory = sample.trajectory
        sampled = np.asarray(trajectory.loss_mask[1:]) == 1
        np.testing.assert_allclose(np.asarray(trajectory.rollout_logprobs[1:])[sampled],
                                   learner_logprobs(model, trajectory)[sampled], atol=2e-3)


def test_tool_responses_carry_the_sandbox_output_of_each_call(engines, sandbox, tokenizer):
    samples = asyncio.run(run_rollout(engines[0], [sandbox.url], synthetic_problems(4, seed=6), 2, seed=7))
    seen_output = 0
    for sample in samples:
        trajectory = sample.trajectory
        text = tokenizer.decode(list(trajectory.token_ids[trajectory.prompt_length:]), skip_special_tokens=False)
        calls = re.findall(r'"code": "(.*?)", "input"', text)
        for code, response, call in zip(calls, check_trajectory(trajectory, tokenizer), trajectory.tool_calls):
            product = re.fullmatch(r"print\((\d+) \* (\d+)\)", code)
            if product and call.ok:  # the model printed a product: the sandbox's answer is checkable by hand
                assert f"stdout:\n{int(product.group(1)) * int(product.group(2))}\n" in response + "\n"
                seen_output += 1
    assert seen_output >= 1


def test_stop_rules_turn_limit_budget_and_overflow(engines, sandbox, tokenizer):
    """One trajectory at a time, so the engine's numerics and hence the seeded turns repeat exactly."""
    problem = synthetic_problems(1, seed=9)[0]
    calling = None
    for seed in range(21, 31):
        free = asyncio.run(run_rollout(engines[0], [sandbox.url], [problem], 1, seed=seed))[0]
        if free.trajectory.tool_calls:
            calling = free
            break
    assert calling is not None, "the tool-calling model made no call in 10 trajectories"
    first_turn = int(np.argmin(np.asarray(calling.trajectory.loss_mask[calling.trajectory.prompt_length:])))
    one_problem, sample = [problem], calling

    limited = asyncio.run(run_rollout(engines[0], [sandbox.url], one_problem, 1, seed=sample.seed, max_turns=1))[0]
    assert limited.trajectory.finish_reason == FinishReason.MAX_TURNS
    assert limited.trajectory.turns == 1 and limited.trajectory.tool_calls == ()
    assert limited.trajectory.response_length == first_turn

    short = asyncio.run(run_rollout(engines[0], [sandbox.url], one_problem, 1, seed=sample.seed,
                                    max_response_tokens=first_turn - 3))[0]
    assert short.trajectory.finish_reason == FinishReason.MAX_LENGTH
    assert short.trajectory.response_length == first_turn - 3
    assert short.trajectory.token_ids == sample.trajectory.token_ids[:len(short.trajectory.token_ids)]

    overflow = asyncio.run(run_rollout(engines[0], [sandbox.url], one_problem, 1, seed=sample.seed,
                                       max_response_tokens=first_turn + 3))[0]
    assert overflow.trajectory.finish_reason == FinishReason.TOOL_RESPONSE_OVERFLOW
    assert overflow.trajectory.response_length == first_turn
    assert len(overflow.trajectory.tool_calls) >= 1, "the call ran and is recorded, its response left out"
    for trajectory in (limited.trajectory, short.trajectory, overflow.trajectory):
        check_trajectory(trajectory, tokenizer)


def test_an_engine_closed_mid_rollout_loses_and_duplicates_nothing(model, sandbox, tokenizer):
    problems = synthetic_problems(8, seed=10)
    doomed, survivor = new_engine(model), new_engine(model)
    router = FailoverEngine([doomed, survivor])

    async def rollout_with_a_crash() -> list[RolloutSample]:
        rollout = asyncio.create_task(run_rollout(router, [sandbox.url], problems, 2, seed=50))
        while (await doomed.capacity()).requests_running == 0 and not rollout.done():
            await asyncio.sleep(0.01)
        await asyncio.to_thread(doomed.close)
        return await rollout

    try:
        samples = asyncio.run(rollout_with_a_crash())
    finally:
        doomed.close()
        survivor.close()
    assert list(router.down) == [0] and "closed" in router.down[0] and router.retries >= 1
    assert [(s.group, s.sample) for s in samples] == [(g, k) for g in range(8) for k in range(2)]
    for sample in samples:  # every turn appended once: one assistant turn per response, logprobs of these ids
        trajectory = sample.trajectory
        check_trajectory(trajectory, tokenizer)
        sampled = np.asarray(trajectory.loss_mask[1:]) == 1
        np.testing.assert_allclose(np.asarray(trajectory.rollout_logprobs[1:])[sampled],
                                   learner_logprobs(model, trajectory)[sampled], atol=2e-3)


def test_a_dead_sandbox_becomes_tool_errors_the_model_reads(engines, tokenizer):
    dead = f"http://127.0.0.1:{free_port()}"
    samples = asyncio.run(run_rollout(engines[0], [dead], synthetic_problems(4, seed=12), 2, seed=13))
    assert len(samples) == 8
    calls = [call for s in samples for call in s.trajectory.tool_calls]
    assert calls and {call.status for call in calls} <= {Status.UNAVAILABLE, INVALID_CALL}
    assert any(call.status == Status.UNAVAILABLE for call in calls)
    continued = 0
    for sample in samples:
        responses = check_trajectory(sample.trajectory, tokenizer)
        for call, response in zip(sample.trajectory.tool_calls, responses):
            if call.status == Status.UNAVAILABLE:
                assert response.startswith("failed (unavailable)")
        continued += sample.trajectory.turns > 1
    assert continued >= 1, "after a failed call the model gets another turn"


def test_update_weights_fans_out_and_all_engines_down_is_a_clear_error(model, engines):
    router = FailoverEngine(engines)
    asyncio.run(router.update_weights(model.params, 7))
    assert [engine.weights_version for engine in engines] == [7, 7]
    capacity = asyncio.run(router.capacity())
    assert capacity.kv_tokens_total == 2 * SLOTS * MAX_LEN

    closed = new_engine(model)
    closed.close()
    lonely = FailoverEngine([closed])
    with pytest.raises(AllEnginesDown, match=r"all 1 engines are down \(engine 0: EngineUnavailable: .*closed"):
        asyncio.run(lonely.generate([5, 6, 7], SamplingParams(max_new_tokens=2)))
    mixed = FailoverEngine([closed, engines[1]])
    asyncio.run(mixed.update_weights(model.params, 8))
    assert mixed.live == [1] and engines[1].weights_version == 8
