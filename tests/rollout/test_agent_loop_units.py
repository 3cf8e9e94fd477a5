"""Pure parts of the agent loop and the fail-over router: routing policy, seeds, stats, argument checks."""

from __future__ import annotations

import asyncio

import gin
import pytest

from rstar_jax.agent import ToolCall, format_tool_response
from rstar_jax.agent.trajectory import FinishReason, ToolCallRecord, Trajectory
from rstar_jax.data.problem import Problem
from rstar_jax.gin_setup import parse_gin
from rstar_jax.rollout.agent_loop import AgentLoop, RolloutSample, single_token_id, turn_seed
from rstar_jax.rollout.engine import SamplingParams
from rstar_jax.rollout.rollout import rollout_stats
from rstar_jax.rollout.router import EngineLoad, FailoverEngine, least_in_flight
from rstar_jax.tokenizers import load_tokenizer


def test_least_in_flight_picks_the_idlest_live_engine_lowest_index_first():
    assert least_in_flight([EngineLoad(0, 3), EngineLoad(2, 1), EngineLoad(5, 1)]) == 2
    assert least_in_flight([EngineLoad(4, 0)]) == 4


def test_turn_seeds_differ_by_turn_and_trajectory_and_fit_in_63_bits():
    seeds = {turn_seed(trajectory, turn) for trajectory in range(50) for turn in range(30)}
    assert len(seeds) == 50 * 30
    assert 0 <= turn_seed(2**62, 7) < 2**63


def test_stop_tokens_are_single_ids_of_the_tiny_tokenizer():
    tokenizer = load_tokenizer("tiny")
    assert single_token_id(tokenizer, "</tool_call>") == tokenizer.convert_tokens_to_ids("</tool_call>")
    with pytest.raises(ValueError, match="splits 'print' into"):
        single_token_id(tokenizer, "print")


def test_failover_engine_rejects_an_empty_engine_list_and_a_policy_choosing_no_live_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        FailoverEngine([])
    with pytest.raises(ValueError, match=r"routing policy chose engine 5, which is not among the live engines \[0\]"):
        asyncio.run(FailoverEngine([None], policy=lambda loads: 5).generate([1], SamplingParams()))


class RaisingExecutor:
    """A tool executor whose transport breaks (the sandbox client never raises; other executors might)."""

    async def run(self, code: str, stdin: str = "", *, timeout_s: float | None = None):
        raise ConnectionResetError("peer went away")


def test_an_executor_that_raises_gives_a_failed_call_the_model_reads():
    loop = AgentLoop(None, RaisingExecutor(), load_tokenizer("tiny"))
    outcome = asyncio.run(loop._run_call(ToolCall("print(1)")))
    assert (outcome.status, outcome.ok, outcome.exit_code) == ("unavailable", False, None)
    assert format_tool_response(outcome, show_duration=False) == (
        "failed (unavailable)\nstderr:\nthe tool could not be run: ConnectionResetError: peer went away")


def _trajectory(statuses: list[tuple[str, bool]], reason: FinishReason, response: int) -> Trajectory:
    ids = (1,) * (3 + response)
    return Trajectory(token_ids=ids, loss_mask=(0,) * len(ids), rollout_logprobs=(0.0,) * len(ids), prompt_length=3,
                      tool_calls=tuple(ToolCallRecord(s, ok) for s, ok in statuses), turns=len(statuses) + 1,
                      answer_tags=0, finish_reason=reason)


def test_rollout_stats_count_calls_statuses_and_rates_by_hand():
    problem = Problem("p", "q", "1", "test")
    trajectories = [
        _trajectory([("ok", True), ("error", False)], FinishReason.ANSWERED, 10),
        _trajectory([], FinishReason.MAX_LENGTH, 20),
        _trajectory([("unavailable", False)], FinishReason.MAX_TURNS, 5),
        _trajectory([("ok", True)], FinishReason.ANSWERED, 1),
    ]
    samples = [RolloutSample(problem, 0, k, k, t) for k, t in enumerate(trajectories)]
    stats = rollout_stats(samples, seconds=2.0)
    assert (stats.trajectories, stats.with_tool_calls, stats.tool_calls, stats.tool_errors) == (4, 3, 4, 2)
    assert stats.response_tokens == 36
    assert stats.finish_reasons == {"answered": 2, "max_length": 1, "max_turns": 1}
    assert stats.tool_statuses == {"ok": 2, "error": 1, "unavailable": 1}
    assert (stats.trajectories_per_s, stats.tool_calls_per_s) == (2.0, 2.0)
    with pytest.raises(ValueError, match="seconds must be positive"):
        rollout_stats(samples, seconds=0.0)


def test_gin_file_binds_the_loop_and_the_router_and_bad_values_are_named():
    tokenizer = load_tokenizer("tiny")
    try:
        parse_gin(["rollout/agent_loop.gin"], ["AgentLoop.max_turns = 15"])
        loop = AgentLoop(engine=None, executor=None, tokenizer=tokenizer)
        router = FailoverEngine([None])
    finally:
        gin.clear_config()
    assert (loop.max_turns, loop.max_response_tokens, loop.temperature, loop.tool_timeout_s) == (15, 8192, 1.0, None)
    assert loop.stop_token_ids == tuple(tokenizer.convert_tokens_to_ids(["</tool_call>", "<|im_end|>"]))
    assert router.policy([EngineLoad(0, 2), EngineLoad(1, 0)]) == 1
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        AgentLoop(None, None, tokenizer, max_turns=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        AgentLoop(None, None, tokenizer, temperature=-1.0)
