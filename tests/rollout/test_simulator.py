"""The fleet simulator (SPEC section 6, issue 10): virtual time, the engine model's numbers by hand (a paged cache
with shared prompt blocks too: issue 26 item 3), the real balancer driven through it, recorded rollouts replayed,
engines dying mid-rollout, and the benchmark's targets at the paper's batch."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest

from experiments.bench import balancer as bench
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.engine import FINISH_LENGTH, FINISH_STOP, RoutingKey, SamplingParams
from rstar_jax.rollout.sim_clock import run_in_virtual_time
from rstar_jax.rollout.sim_engine import EngineProfile, SimEngine
from rstar_jax.rollout.sim_profiles import profile
from rstar_jax.rollout.sim_workload import ContextIds, TrajectoryPlan, TurnScript, Workload, plan_batch
from rstar_jax.rollout.simulate import simulate

FLAT = EngineProfile("flat", kv_tokens=1000, max_num_seqs=8, step_s=0.01, sequence_s=0.005, context_token_s=0.0,
                     prefill_token_s=0.0)
KEY_A, KEY_B, KEY_C = RoutingKey(1), RoutingKey(2), RoutingKey(3)


def test_virtual_time_jumps_to_the_next_timer_and_a_lost_wake_up_is_an_error():
    async def sleeper() -> float:
        await asyncio.sleep(3600)
        return asyncio.get_running_loop().time()

    assert run_in_virtual_time(sleeper()) == 3600.0

    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(RuntimeError, match="simulation stalled"):
        run_in_virtual_time(stuck())


def test_decode_time_is_the_closed_form_of_the_step_cost():
    growing = EngineProfile("growing", 10**6, 8, step_s=0.002, sequence_s=0.001, context_token_s=1e-6,
                            prefill_token_s=0.0)
    seconds = growing.seconds_for(1000, batch=4, context=2000)
    by_steps = sum(0.002 + 0.004 + 1e-6 * (2000 + 4 * k) for k in range(1000))
    assert seconds == pytest.approx(by_steps, rel=1e-3)  # the fluid form of 1,000 discrete steps
    assert growing.steps_in(seconds, batch=4, context=2000) == pytest.approx(1000, rel=1e-12)


async def run_turns(engine: SimEngine, script: TurnScript, turns: list[tuple[RoutingKey, int, int, int]]):
    """(key, prompt, planned tokens, max new) turns sent together; their generations and the end time."""
    for key, prompt, planned, _ in turns:
        script.expect(key, prompt, planned)
    generations = await asyncio.gather(*(engine.generate(range(prompt), SamplingParams(max_new_tokens=max_new,
                                                                                        routing_key=key))
                                         for key, prompt, _, max_new in turns))
    return generations, asyncio.get_running_loop().time()


def test_an_engine_decodes_a_batch_at_its_step_time_and_reports_why_turns_end():
    script = TurnScript()
    engine = SimEngine(FLAT, script)
    (stop, cut), end = run_in_virtual_time(run_turns(engine, script, [(KEY_A, 10, 100, 500), (KEY_B, 10, 300, 200)]))
    assert (len(stop.token_ids), stop.finish_reason) == (100, FINISH_STOP)
    assert (len(cut.token_ids), cut.finish_reason) == (200, FINISH_LENGTH)
    # 100 steps of two sequences (0.02 s each), then 100 of one (0.015 s)
    assert end == pytest.approx(100 * 0.02 + 100 * 0.015)
    assert engine.stats.turns == 2 and engine.stats.generated_tokens == 300 and engine.stats.preemptions == 0


def test_an_overflowing_cache_preempts_the_newest_sequence_which_must_be_computed_again():
    script = TurnScript()
    engine = SimEngine(FLAT, script)  # 1,000 tokens of KV; three sequences growing to 500 each
    turns = [(key, 100, 400, 400) for key in (KEY_A, KEY_B, KEY_C)]
    generations, end = run_in_virtual_time(run_turns(engine, script, turns))
    assert [len(g.token_ids) for g in generations] == [400, 400, 400]
    assert engine.stats.preemptions >= 1
    # the victim's context was computed twice: from scratch, or (here, the cache kept it) read from the prefix cache
    assert engine.stats.prefill_tokens + engine.stats.prefix_hit_tokens > 3 * 100
    assert end > 400 * 0.02  # it ran alone after the others instead of alongside


def test_the_next_turn_of_a_trajectory_hits_the_prefix_cache():
    script = TurnScript()
    engine = SimEngine(FLAT, script)

    async def two_turns() -> None:
        await run_turns(engine, script, [(KEY_A, 50, 30, 100)])
        await run_turns(engine, script, [(KEY_A, 90, 20, 100)])  # 50 + 30 generated + 10 of tool response

    run_in_virtual_time(two_turns())
    assert engine.stats.prefix_hit_tokens == 80 and engine.stats.prefill_tokens == 50 + 10


BLOCKS = EngineProfile("blocks", kv_tokens=4 * 128, max_num_seqs=8, step_s=0.01, sequence_s=0.005,
                       context_token_s=0.0, prefill_token_s=0.0, block_size=128, shares_prefixes=True)


def test_a_paged_cache_preempts_when_a_step_asks_for_a_block_none_is_free():
    script = TurnScript()
    engine = SimEngine(BLOCKS, script)  # 4 blocks of 128; two sequences growing from 100 to 300 tokens
    generations, end = run_in_virtual_time(run_turns(engine, script, [(KEY_A, 100, 200, 300), (KEY_B, 100, 200, 300)]))
    assert [len(g.token_ids) for g in generations] == [200, 200]
    # blocks hold all but the last sampled token (99 + k after k steps): 2 blocks each from step 30; at step 157
    # (256 stored) both ask for a third with none free: B, the newer, is preempted and its blocks freed tail first;
    # A's third block is B's second, so B comes back after A (step 200) to its first block cached and 257 - 128
    # tokens to compute again, then runs its 43 steps alone
    assert engine.stats.preemptions == 1
    assert engine.stats.prefix_hit_tokens == 128 and engine.stats.recomputed_tokens == 129
    assert end == pytest.approx(157 * 0.02 + 43 * 0.015 + 43 * 0.015)


def test_running_sequences_hold_a_shared_prompt_block_once():
    script = TurnScript()
    engine = SimEngine(BLOCKS, script)
    plans = [TrajectoryPlan(index, 0, 300, (60,), (), ()) for index in range(2)]  # one group's prompt

    async def together():
        for plan in plans:
            script.expect(RoutingKey(plan.index), 300, 60)
        turns = [engine.generate(ContextIds(plan, 300), SamplingParams(max_new_tokens=60,
                                                                        routing_key=RoutingKey(plan.index)))
                 for plan in plans]
        first = asyncio.ensure_future(turns[0])
        second = asyncio.ensure_future(turns[1])
        await asyncio.sleep(0.05)
        capacity = await engine.capacity()
        return capacity, await first, await second

    capacity, *generations = run_in_virtual_time(together())
    assert [len(g.token_ids) for g in generations] == [60, 60]
    assert (capacity.block_size, capacity.shares_prefixes) == (128, True)
    assert capacity.kv_tokens_used == (2 + 1 + 1) * 128  # its 2 full blocks once: 6 would not fit in 4
    assert engine.stats.preemptions == 0 and engine.stats.prefix_hit_tokens == 256  # the second computes 44 tokens


def test_a_finished_samples_prompt_blocks_stay_cached_for_the_next_one():
    script = TurnScript()
    engine = SimEngine(BLOCKS, script)
    first, second = (TrajectoryPlan(index, 0, 300, (60,), (), ()) for index in range(2))  # one group's prompt

    async def one_after_the_other():
        for plan in (first, second):
            key = RoutingKey(plan.index)
            script.expect(key, 300, 60)
            await engine.generate(ContextIds(plan, 300), SamplingParams(max_new_tokens=60, routing_key=key))

    run_in_virtual_time(one_after_the_other())
    assert engine.stats.prefix_hit_tokens == 256  # the prompt's two full blocks; its last 44 tokens are computed
    assert engine.stats.prefill_tokens == 300 + 44


def test_a_recorded_rollout_replays_turn_for_turn():
    workload = Workload(prompts=4, samples=4, max_response_tokens=400)
    plans = [TrajectoryPlan(index, index // 4, 150, turns, tools, (0.02,) * len(tools))
             for index, (turns, tools) in enumerate([((90, 40, 200), (30, 30)), ((120,), ()), ((300,), ()),
                                                     ((80, 70), (25,))] * 4)]
    for policy in ("kv_aware", "least_requests"):
        result = simulate(policy, [dataclasses.replace(BLOCKS, kv_tokens=8 * 128)] * 2, workload, plans=plans,
                          part_tokens=64)
        assert [record.turn_tokens for record in result.records] == [plan.turn_tokens for plan in plans]
    with pytest.raises(ValueError, match="indexed"):
        simulate("kv_aware", [BLOCKS], workload, plans=plans[1:])


def expected_turns(plan: TrajectoryPlan, workload: Workload) -> tuple[int, ...]:
    """The tokens of each turn by the agent loop's rules alone, without any engine."""
    response, turns = 0, []
    for turn, planned in enumerate(plan.turn_tokens):
        left = workload.max_response_tokens - response
        turns.append(min(planned, left))
        response += turns[-1]
        if planned > left or turn == len(plan.turn_tokens) - 1:
            break
        if response + plan.tool_tokens[turn] >= workload.max_response_tokens:
            break
        response += plan.tool_tokens[turn]
    return tuple(turns)


@pytest.mark.parametrize("policy", ["kv_aware", "least_requests", "static_split"])
def test_engines_dying_mid_rollout_lose_and_duplicate_nothing(policy):
    workload = Workload(prompts=24, samples=8, response_tokens_mean=1500.0, seed=3)
    fleet = [profile("gpu_h100")] * 4
    result = simulate(policy, fleet, workload, kills=[(20.0, 1), (60.0, 3)])
    plans = plan_batch(workload)
    assert [record.index for record in result.records] == list(range(len(plans)))
    for record, plan in zip(result.records, plans):
        assert record.turn_tokens == expected_turns(plan, workload)  # every token once: none lost, none twice
    assert result.retries >= 2 and result.generated_tokens == sum(sum(r.turn_tokens) for r in result.records)


def test_kv_aware_never_preempts_where_least_requests_does_and_queues_instead():
    workload = Workload(prompts=16, samples=16, response_tokens_mean=2500.0, seed=1)
    small = EngineProfile("small", kv_tokens=60_000, max_num_seqs=256, step_s=6e-3, sequence_s=0.3e-3,
                          context_token_s=4e-8, prefill_token_s=3e-5)
    kv = simulate("kv_aware", [small] * 2, workload)
    least = simulate("least_requests", [small] * 2, workload)
    assert least.preemptions > 0 and least.recomputed_tokens > 0
    assert kv.preemptions == 0 and kv.max_queue > 0
    assert kv.generated_tokens == least.generated_tokens


def test_the_simulated_balancer_is_the_real_one():
    script = TurnScript()
    engines = [SimEngine(FLAT, script), SimEngine(FLAT, script)]
    balancer = Balancer(engines)

    async def one_turn():
        script.expect(KEY_A, 10, 600)
        return await balancer.generate(range(10), SamplingParams(max_new_tokens=900, routing_key=KEY_A))

    generation = run_in_virtual_time(one_turn())
    assert len(generation.token_ids) == 600 and generation.finish_reason == FINISH_STOP
    assert sum(engine.stats.turns for engine in engines) == math.ceil(600 / 256)  # in parts of 256 tokens
    assert balancer.reserved == (0, 0)


@pytest.mark.slow
def test_the_benchmark_meets_its_targets_at_the_papers_batch(tmp_path):
    """Issue 10: 64 engines x 512 prompts x 32 samples; kv_aware >= 1.5x static_split with no preemptions, and
    ahead of least_requests. Only the three policies the targets name run: this is the suite's slowest simulation,
    and the benchmark's other two policies have no target."""
    path = tmp_path / "balancer.json"
    result = bench.main(["--engines", "64", "--prompts", "512", "--samples", "32", "--json", str(path), "--workers",
                         "2", "--policies", "kv_aware,least_requests,static_split"])
    assert json.loads(path.read_text())["ratios"] == pytest.approx(result["ratios"])
    policies = result["policies"]
    assert set(policies) == {"kv_aware", "least_requests", "static_split"}
    for figures in policies.values():
        assert any("throughput" in key for key in figures) and any("preempt" in key for key in figures)
        assert figures["trajectories"] == 512 * 32
    assert policies["kv_aware"]["preemptions"] == 0
    assert result["ratios"]["kv_aware_vs_static_split"] >= 1.5
    assert result["ratios"]["kv_aware_vs_least_requests"] > 1.0
