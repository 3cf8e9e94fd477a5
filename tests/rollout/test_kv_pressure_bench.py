"""experiments/bench/kv_pressure.py (issue 26 item 2): stop ids spread over the vocabulary, a trajectory played by
the agent loop's budget rules and kept as the simulator's plan, and the turn figures by hand."""

from __future__ import annotations

import asyncio

import pytest

from experiments.bench import kv_pressure
from experiments.bench.engine import ScriptedTrajectory
from rstar_jax.rollout.engine import FINISH_LENGTH, FINISH_STOP, Generation, RoutingKey, SamplingParams


class TurnsOf:
    """Answers the i-th request with `lengths[i]` tokens, ending at a stop id unless that fills max_new_tokens."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.requests = lengths, []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> Generation:
        self.requests.append((len(prompt_ids), sampling.max_new_tokens))
        tokens = min(self.lengths[len(self.requests) - 1], sampling.max_new_tokens)
        finish = FINISH_STOP if tokens < sampling.max_new_tokens else FINISH_LENGTH
        return Generation((7,) * tokens, (-1.0,) * tokens, finish)


def trajectory(turns: int) -> ScriptedTrajectory:
    return ScriptedTrajectory(prompt=tuple(range(1, 101)), turn_tokens=(0,) * turns,
                              tool_responses=((5,) * 20,) * (turns - 1), seed=3, key=RoutingKey(9, 4, 8), group=2)


def test_stop_ids_are_spread_over_the_vocabulary_and_never_the_padding_id():
    stops = kv_pressure.stop_ids(2048, 160.0)
    assert len(stops) == 13 and stops[0] == 1 and stops[-1] == 2047 and 0 not in stops
    assert len(set(stops)) == 13 and kv_pressure.stop_ids(10, 1e6) == (1,)


def test_a_trajectory_shares_its_budget_between_turns_and_tool_responses_and_becomes_a_plan():
    engine, records = TurnsOf([60, 150, 500]), []
    plan = asyncio.run(kv_pressure.run_open_trajectory(engine, trajectory(3), 300, (1, 2), 0.0, records))
    # budget 300: turn 1 asks 300 (60 sampled), + 20 tool; turn 2 asks 220 (150), + 20; turn 3 asks the 50 left
    assert engine.requests == [(100, 300), (180, 220), (350, 50)]
    assert (plan.index, plan.group, plan.prompt_tokens) == (4, 2, 100)
    assert plan.turn_tokens == (60, 150, 50) and plan.tool_tokens == (20, 20) and plan.tool_latency_s == (0.0, 0.0)
    assert [(r.context_tokens, r.sampled_tokens) for r in records] == [(100, 60), (180, 150), (350, 50)]


def test_a_tool_response_that_would_fill_the_budget_ends_the_trajectory():
    engine, records = TurnsOf([285, 10]), []
    plan = asyncio.run(kv_pressure.run_open_trajectory(engine, trajectory(3), 300, (1,), 0.0, records))
    assert len(engine.requests) == 1 and plan.turn_tokens == (285,) and plan.tool_tokens == ()


def test_turn_figures_by_hand():
    records = [kv_pressure.TurnRecord(seconds, 100 * i, 10 * i) for i, seconds in enumerate([1.0, 2.0, 3.0, 4.0], 1)]
    figures = kv_pressure.turn_figures(5.0, records)
    assert figures["sampled_tokens"] == 100 and figures["throughput_tokens_per_s"] == 20.0
    assert figures["mean_turn_tokens"] == 25.0 and figures["mean_context_tokens"] == 250.0
    assert figures["p50_turn_s"] == 2.5 and figures["p95_turn_s"] == pytest.approx(3.85)
