"""A rollout workload that fills vLLM's KV caches (issue 26 item 2): the demo's multi-turn shape with turns whose
length no one knows in advance, on the tiny demo model with random weights.

The trained tool-calling model of the rollout tests writes turns of ~20-50 tokens, so its rollouts never fill a
server's cache and the balancer's reservations only cap concurrency (BENCHMARKS "Rollout balancer"). Here every turn
asks for the whole response budget left (as the agent loop does) and ends at one of a set of stop tokens: a random
model's next-token distribution is nearly flat over its 2,048 ids, so with k stop ids a turn ends each step with
probability about k / 2,048 and its length is close to geometric with mean 2,048 / k, unknown to the balancer. Turn
counts per trajectory, prompts (the demo's first-stage problems; a GRPO group shares its prompt) and tool responses
are `engine.demo_trajectories`'; after each turn but the last its tool-response block is appended after a sleep of
the sandbox's latency, by the agent loop's budget rules (model and tool-response tokens share the budget). Lengths
are capped by the budget, so the run's figures report the turn lengths it produced, and every trajectory is kept
as the fleet simulator's plan, for the simulator to replay (issue 26 item 3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Sequence

import numpy as np

from experiments.bench.engine import ScriptedTrajectory
from rstar_jax.rollout.engine import FINISH_STOP, GenerationEngine, SamplingParams
from rstar_jax.rollout.sim_workload import TrajectoryPlan


@dataclasses.dataclass
class TurnRecord:
    """What one turn cost: seconds from the request to its answer (queueing in the balancer included), the context
    it was sent with and the tokens it sampled."""

    seconds: float
    context_tokens: int
    sampled_tokens: int


def stop_ids(vocab_size: int, mean_turn_tokens: float) -> tuple[int, ...]:
    """k = round(vocab_size / mean_turn_tokens) ids spread evenly over the vocabulary (id 0, the padding id, never):
    a turn of a random model then ends each step with probability about k / vocab_size."""
    count = max(1, round(vocab_size / mean_turn_tokens))
    return tuple(int(i) for i in np.linspace(1, vocab_size - 1, count).round())


async def run_open_trajectory(engine: GenerationEngine, trajectory: ScriptedTrajectory, budget: int,
                              stops: Sequence[int], tool_s: float, records: list[TurnRecord]) -> TrajectoryPlan:
    """One of `engine.demo_trajectories` turn by turn, by the agent loop's rules, with its prompt, turn count, tool
    responses, seed and routing key, but not its scripted turn lengths: each turn is sent with everything so far
    and may take the budget of model and tool-response tokens left; it goes on after a stop token while turns
    remain and the tool response fits the budget. Returns what happened as the fleet simulator's plan (issue 26
    item 3: the simulator replays it)."""
    ids, response, turns = list(trajectory.prompt), 0, len(trajectory.turn_tokens)
    sampled: list[int] = []
    for turn in range(turns):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=budget - response, stop_token_ids=tuple(stops),
                                  seed=trajectory.seed * 16 + turn, routing_key=trajectory.key)
        start = time.perf_counter()
        generation = await engine.generate(ids, sampling)
        records.append(TurnRecord(time.perf_counter() - start, len(ids), len(generation.token_ids)))
        sampled.append(len(generation.token_ids))
        ids += generation.token_ids
        response += len(generation.token_ids)
        tool = trajectory.tool_responses[turn] if turn + 1 < turns else ()
        if generation.finish_reason != FINISH_STOP or not tool or response + len(tool) >= budget:
            break
        await asyncio.sleep(tool_s)
        ids += tool
        response += len(tool)
    calls = len(sampled) - 1
    return TrajectoryPlan(index=trajectory.key.index, group=trajectory.group,
                          prompt_tokens=len(trajectory.prompt), turn_tokens=tuple(sampled),
                          tool_tokens=tuple(len(t) for t in trajectory.tool_responses[:calls]),
                          tool_latency_s=(tool_s,) * calls)


async def run_pressure_rollout(engine: GenerationEngine, trajectories: Sequence[ScriptedTrajectory], budget: int,
                               stops: Sequence[int], tool_s: float
                               ) -> tuple[float, list[TurnRecord], list[TrajectoryPlan]]:
    """Every trajectory at once (a rollout batch); wall seconds, one record per turn, and each trajectory as the
    simulator's plan."""
    records: list[TurnRecord] = []
    start = time.perf_counter()
    plans = await asyncio.gather(*(run_open_trajectory(engine, t, budget, stops, tool_s, records)
                                   for t in trajectories))
    return time.perf_counter() - start, records, list(plans)


def turn_figures(seconds: float, records: Sequence[TurnRecord]) -> dict[str, float]:
    """Throughput and turn latency of one rollout: sampled tokens/s, turns, mean sampled and context tokens a turn,
    p50 / p95 seconds a turn."""
    latencies = np.array([record.seconds for record in records])
    sampled = sum(record.sampled_tokens for record in records)
    return {"seconds": seconds, "turns": len(records), "sampled_tokens": sampled,
            "throughput_tokens_per_s": sampled / seconds,
            "mean_turn_tokens": sampled / len(records),
            "mean_context_tokens": float(np.mean([record.context_tokens for record in records])),
            "p50_turn_s": float(np.percentile(latencies, 50)), "p95_turn_s": float(np.percentile(latencies, 95))}
