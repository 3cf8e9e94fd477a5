"""The fleet simulator (SPEC section 6): one RL rollout batch through the REAL balancer over simulated engines, in
virtual time.

Every trajectory of the batch (`sim_workload`) is an asyncio task that behaves like the agent loop: each turn asks
the balancer (`balancer.Balancer`, the class a real run uses) for the budget left with the trajectory's routing key,
waits for the planned tool latency, adds the tool response, and stops by the agent loop's rules (a turn that
used its budget, the last planned turn, a tool response that would overflow the budget). The balancer routes over
`SimEngine`s (`sim_engine`: KV cache, batch-dependent decode speed, prefill, preemption with recomputation,
prefix cache) through the `GenerationEngine` protocol, exactly as it would over vLLM servers; engines can be
killed at given times. Everything runs on a virtual-time loop (`sim_clock`), so the result is a function of the
workload's seed and the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from typing import Any, Sequence

import numpy as np

from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.engine import FINISH_LENGTH, RoutingKey, SamplingParams
from rstar_jax.rollout.sim_clock import run_in_virtual_time
from rstar_jax.rollout.sim_engine import EngineProfile, SimEngine
from rstar_jax.rollout.sim_workload import ContextIds, TrajectoryPlan, TurnScript, Workload, plan_batch


@dataclasses.dataclass(frozen=True)
class TrajectoryRecord:
    """What one simulated trajectory did: its turns, the tokens each generated, when it started and ended."""

    index: int
    turn_tokens: tuple[int, ...]
    started_s: float
    finished_s: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """One policy's rollout of the batch: the figures the benchmark reports (SPEC section 6)."""

    policy: str
    engines: int
    trajectories: int
    turns: int
    generated_tokens: int
    makespan_s: float
    throughput_tokens_per_s: float
    preemptions: int
    recomputed_tokens: int
    prefix_hit_rate: float
    idle_fraction: float
    mean_batch: float
    kv_utilization: float
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    retries: int
    max_queue: int
    wall_s: float
    records: tuple[TrajectoryRecord, ...] = dataclasses.field(repr=False, compare=False, default=())

    def figures(self) -> dict[str, Any]:
        """The figures without the per-trajectory records (what goes into JSON)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "records"}


async def run_trajectory(balancer: Balancer, plan: TrajectoryPlan, workload: Workload, script: TurnScript,
                         batch_size: int) -> TrajectoryRecord:
    """Play one planned trajectory of a batch through `balancer` with the agent loop's budget and stop rules (SPEC
    2); its context goes as `ContextIds` (a GRPO group's samples share their prompt's ids)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    key = RoutingKey(plan.index, plan.index, batch_size)
    context, response, generated = plan.prompt_tokens, 0, []
    for turn in range(len(plan.turn_tokens)):
        script.expect(key, context, plan.turn_tokens[turn])
        sampling = SamplingParams(max_new_tokens=workload.max_response_tokens - response, routing_key=key)
        generation = await balancer.generate(ContextIds(plan, context), sampling)
        tokens = len(generation.token_ids)
        generated.append(tokens)
        context, response = context + tokens, response + tokens
        if generation.finish_reason == FINISH_LENGTH or turn == len(plan.turn_tokens) - 1:
            break
        await asyncio.sleep(plan.tool_latency_s[turn])
        if response + plan.tool_tokens[turn] >= workload.max_response_tokens:
            break  # the tool response would use the rest of the budget: the trajectory stops
        context, response = context + plan.tool_tokens[turn], response + plan.tool_tokens[turn]
    return TrajectoryRecord(plan.index, tuple(generated), started, loop.time())


async def _rollout(policy: str, fleet: Sequence[EngineProfile], workload: Workload,
                   plans: Sequence[TrajectoryPlan], kills: Sequence[tuple[float, int]],
                   balancer_options: dict[str, Any]) -> tuple[list[TrajectoryRecord], list[SimEngine], Balancer, float]:
    script = TurnScript()
    engines = [SimEngine(profile, script) for profile in fleet]
    balancer = Balancer(engines, policy=policy, **balancer_options)
    loop = asyncio.get_running_loop()
    for at_s, index in kills:
        loop.call_at(at_s, engines[index].kill, f"engine {index} killed at {at_s} s (simulated)")
    records = await asyncio.gather(*(run_trajectory(balancer, plan, workload, script, len(plans)) for plan in plans))
    end = loop.time()
    for engine in engines:
        engine.settle(end)
    return list(records), engines, balancer, end


def simulate(policy: str, fleet: Sequence[EngineProfile], workload: Workload = Workload(),
             kills: Sequence[tuple[float, int]] = (), plans: Sequence[TrajectoryPlan] | None = None,
             **balancer_options: Any) -> SimResult:
    """Roll out `workload`'s batch over simulated engines of `fleet` through a `Balancer` with `policy` (SPEC 6).

    `kills`: (virtual second, engine index) pairs: that engine dies then. `plans`: the trajectories to replay (a
    recorded rollout, `index` 0..n-1 in order) instead of the batch `workload` draws; `workload` still gives the
    response budget. `balancer_options` go to `Balancer`.
    """
    plans = plan_batch(workload) if plans is None else plans
    if [plan.index for plan in plans] != list(range(len(plans))):
        raise ValueError("plans must be indexed 0..n-1 in order")
    wall = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # millions of short-lived tuples and no cycles worth collecting: the cyclic GC cost a quarter
    try:
        records, engines, balancer, makespan = run_in_virtual_time(
            _rollout(policy, fleet, workload, plans, kills, balancer_options))
    finally:
        if collecting:
            gc.enable()
    stats = [engine.stats for engine in engines]
    latencies = np.asarray([record.finished_s - record.started_s for record in records])
    generated = sum(sum(record.turn_tokens) for record in records)
    computed = sum(s.prefill_tokens + s.prefix_hit_tokens for s in stats)
    return SimResult(
        policy=policy, engines=len(engines), trajectories=len(records),
        turns=sum(len(record.turn_tokens) for record in records), generated_tokens=generated,
        makespan_s=makespan, throughput_tokens_per_s=generated / makespan,
        preemptions=sum(s.preemptions for s in stats), recomputed_tokens=round(sum(s.recomputed_tokens for s in stats)),
        prefix_hit_rate=sum(s.prefix_hit_tokens for s in stats) / computed if computed else 0.0,
        idle_fraction=1.0 - sum(s.busy_s for s in stats) / (makespan * len(engines)),
        mean_batch=sum(s.sequence_s for s in stats) / (makespan * len(engines)),
        kv_utilization=sum(s.kv_token_s for s in stats) / (makespan * sum(p.kv_tokens for p in fleet)),
        latency_p50_s=float(np.percentile(latencies, 50)), latency_p99_s=float(np.percentile(latencies, 99)),
        latency_max_s=float(latencies.max()), retries=balancer.retries, max_queue=balancer.max_queue,
        wall_s=time.perf_counter() - wall, records=tuple(records))
