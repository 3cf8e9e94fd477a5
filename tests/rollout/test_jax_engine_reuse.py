"""The JAX engine keeps a trajectory's cache between its turns (issue 26 item 1): exact, and cheaper.

Every multi-turn rollout here runs twice, on an engine that reuses held caches (`reuse_turns=True`, the default)
and on one that prefills each turn's whole prompt (`reuse_turns=False`), and must give the same tokens and
log-probs (greedy, and sampled with the same seeds), while the reusing engine's counters show fewer prompt tokens
prefilled. Same model and shapes as tests/rollout/test_jax_engine.py (programs compile once per test process).
"""

import asyncio

import numpy as np
import pytest

from rstar_jax.rollout.engine import Generation, SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from test_jax_engine import (CONFIG, DECODE_STEPS, MAX_LEN, SLOTS, WINDOWS, count_compiles, full_forward_greedy,
                             learner_logprobs, random_prompts, run)
from test_jax_engine import other_params, params  # noqa: F401 (the same module-scoped fixtures)

pytestmark = pytest.mark.slow


def make_engine(params, **kwargs) -> JaxEngine:
    engine = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_steps=DECODE_STEPS,
                       decode_windows=WINDOWS, **kwargs)
    engine.wait_ready(timeout=600)
    return engine


@pytest.fixture(scope="module")
def reusing(params):
    engine = make_engine(params, park_rows=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prefilling(params):
    engine = make_engine(params, reuse_turns=False)
    yield engine
    engine.close()


async def together(*coroutines):
    return await asyncio.gather(*coroutines)


def delta(engine: JaxEngine, before: dict[str, int]) -> dict[str, int]:
    return {key: value - before[key] for key, value in engine.stats().items()}


async def trajectory(engine: JaxEngine, prompt: list[int], budgets: list[int], tools: list[list[int]],
                     temperature: float, seed: int, tool_s: float = 0.0) -> tuple[list[Generation], list[int]]:
    """One multi-turn rollout as the agent loop runs it: each turn's prompt is the last one plus the sampled tokens
    plus a 'tool response'; returns the turns and the final token ids."""
    ids, turns = list(prompt), []
    for turn, budget in enumerate(budgets):
        sampling = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=budget, seed=seed * 100 + turn)
        generation = await engine.generate(ids, sampling)
        turns.append(generation)
        ids += generation.token_ids
        if turn < len(tools):
            await asyncio.sleep(tool_s)
            ids += tools[turn]
    return turns, ids


def workload(seed: int, groups: int = 2, per_group: int = 3, turns: int = 3):
    """GRPO-like groups: each group's rollouts share their first prompt; turn budgets and tool responses differ."""
    rng = np.random.default_rng(seed)
    prompts = random_prompts(list(rng.integers(6, 14, groups)), seed=seed)
    jobs = []
    for index in range(groups * per_group):
        budgets = rng.integers(3, 9, turns).tolist()
        tools = [rng.integers(2, CONFIG.vocab_size, rng.integers(2, 7)).tolist() for _ in range(turns - 1)]
        jobs.append((prompts[index // per_group], budgets, tools, index))
    return jobs


def rollouts(engine: JaxEngine, jobs, temperature: float) -> list[tuple[list[Generation], list[int]]]:
    async def all_of_them():
        return await asyncio.gather(*(trajectory(engine, prompt, budgets, tools, temperature, seed,
                                                 tool_s=0.002 * (seed % 3))
                                      for prompt, budgets, tools, seed in jobs))
    return run(all_of_them())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_turn_rollouts_with_reuse_equal_re_prefilling_every_turn(reusing, prefilling, params, temperature):
    # 6 trajectories of 3 turns on 4 slots: turns wait for slots, parked caches are moved out and back.
    jobs = workload(seed=3 if temperature else 4)
    before_reusing, before_prefilling = reusing.stats(), prefilling.stats()
    reused = rollouts(reusing, jobs, temperature)
    prefilled = rollouts(prefilling, jobs, temperature)
    for (turns_a, ids_a), (turns_b, ids_b) in zip(reused, prefilled):
        assert ids_a == ids_b
        for a, b in zip(turns_a, turns_b):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    # Both against the learner: every sampled token's log-prob given the whole conversation before it.
    for (prompt, budgets, tools, _), (turns, ids) in zip(jobs, reused):
        start = len(prompt)
        for turn, generation in enumerate(turns):
            reference = learner_logprobs(params, [ids[:start]], [generation.token_ids])[0]
            np.testing.assert_allclose(generation.logprobs, reference, atol=1e-4, rtol=0)
            start += len(generation.token_ids) + (len(tools[turn]) if turn < len(tools) else 0)
    if temperature == 0.0:
        prompt, budgets, tools, _ = jobs[0]
        turns, _ = reused[0]
        assert list(turns[0].token_ids) == full_forward_greedy(params, [prompt], [budgets[0]])[0]
    counts_a, counts_b = delta(reusing, before_reusing), delta(prefilling, before_prefilling)
    assert counts_b["extends"] == 0 and counts_b["prefills"] + counts_b["copies"] == 18  # 6 x 3 turns
    assert counts_a["extends"] >= 1 and counts_a["prefills"] + counts_a["extends"] + counts_a["copies"] == 18
    assert counts_a["prefill_tokens"] < 0.6 * counts_b["prefill_tokens"], (counts_a, counts_b)
    assert counts_a["padded_prefill_tokens"] < counts_b["padded_prefill_tokens"]


def test_a_turn_prefills_only_its_new_tokens(reusing):
    prompt = random_prompts([10], seed=30)[0]
    tool = random_prompts([4], seed=31)[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    before = reusing.stats()
    first = run(reusing.generate(prompt, sampling))
    second_prompt = prompt + list(first.token_ids) + tool
    run(reusing.generate(second_prompt, SamplingParams(temperature=1.0, max_new_tokens=6, seed=6)))
    counts = delta(reusing, before)
    # Turn 2 holds prompt + 5 of the 6 sampled tokens (the last was never fed back): 15 reused, 1 + 4 prefilled.
    assert (counts["prefills"], counts["extends"], counts["copies"]) == (1, 1, 0)
    assert counts["reused_tokens"] == 15 and counts["prefill_tokens"] == 10 + 5
    assert counts["padded_prefill_tokens"] == 16 + 16


def test_a_parked_cache_moves_to_the_park_store_and_back_under_pressure(params, prefilling):
    engine = make_engine(params, park_rows=2)
    try:
        prompt, tool = random_prompts([12, 5], seed=40)
        others = random_prompts([9, 11, 13, 7], seed=41)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
        first = run(engine.generate(prompt, sampling))
        # Four other requests take every slot: three empty ones, then the parked one, whose cache moves out.
        fill = SamplingParams(temperature=1.0, max_new_tokens=4, seed=8)
        run(together(*(engine.generate(other, fill) for other in others)))
        assert engine.stats()["parked"] == 1
        second_prompt = prompt + list(first.token_ids) + tool
        second = SamplingParams(temperature=1.0, max_new_tokens=8, seed=9)
        before = engine.stats()
        again = run(engine.generate(second_prompt, second))
        counts = delta(engine, before)
        assert (counts["unparked"], counts["extends"], counts["reused_tokens"]) == (1, 1, 12 + 5)
        reference = run(prefilling.generate(second_prompt, second))
        assert again.token_ids == reference.token_ids
        np.testing.assert_allclose(again.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    finally:
        engine.close()


def test_without_a_park_store_the_least_recently_used_cache_is_evicted(params):
    engine = make_engine(params, park_rows=0)
    try:
        prompt, tool = random_prompts([12, 5], seed=50)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
        first = run(engine.generate(prompt, sampling))
        others = random_prompts([9, 11, 13, 7], seed=51)
        run(together(*(engine.generate(other, SamplingParams(temperature=1.0, max_new_tokens=4))
                       for other in others)))
        before = engine.stats()
        run(engine.generate(prompt + list(first.token_ids) + tool, sampling))
        counts = delta(engine, before)
        assert (counts["prefills"], counts["extends"], counts["prefill_tokens"]) == (1, 0, 12 + 6 + 5)
        assert engine.stats()["evicted"] >= 1 and engine.stats()["parked"] == 0
    finally:
        engine.close()


def test_suffixes_longer_than_the_largest_turn_bucket_go_in_several_calls(params, prefilling):
    engine = make_engine(params, turn_buckets=(4, 8), park_rows=1)
    try:
        prompt, tool = random_prompts([20, 13], seed=60)
        first = run(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)))
        second_prompt = prompt + list(first.token_ids) + tool  # 20 + 4 held; 1 + 13 = 14 new tokens: 8 + 8
        sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=2)
        before = engine.stats()
        chunked = run(engine.generate(second_prompt, sampling))
        counts = delta(engine, before)
        assert (counts["extends"], counts["prefill_tokens"], counts["padded_prefill_tokens"]) == (1, 14, 16)
        reference = run(prefilling.generate(second_prompt, sampling))
        assert chunked.token_ids == reference.token_ids
        np.testing.assert_allclose(chunked.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    finally:
        engine.close()


def test_new_weights_drop_every_held_cache(reusing, params, other_params):
    prompt, tool = random_prompts([9, 4], seed=70)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = run(reusing.generate(prompt, greedy))
    second_prompt = prompt + list(first.token_ids) + tool
    try:
        run(reusing.update_weights(other_params, 1))
        before = reusing.stats()
        second = run(reusing.generate(second_prompt, greedy))
        counts = delta(reusing, before)
        assert (counts["prefills"], counts["extends"], counts["invalidations"]) == (1, 0, 1)
        assert list(second.token_ids) == full_forward_greedy(other_params, [second_prompt], [6])[0]
    finally:
        run(reusing.update_weights(params, 0))


def test_a_turn_that_ran_across_a_weight_update_leaves_nothing_to_reuse(reusing, params, other_params):
    prompt, tool = random_prompts([4, 3], seed=80)
    long_turn = SamplingParams(temperature=0.0, max_new_tokens=50)

    async def swap_midway():
        task = asyncio.create_task(reusing.generate(prompt, long_turn))
        while (await reusing.capacity()).kv_tokens_used < len(prompt) + 10:
            await asyncio.sleep(0.001)
        await reusing.update_weights(other_params, 1)
        return await task

    try:
        first = run(swap_midway())
        before = reusing.stats()
        second_prompt = prompt + list(first.token_ids) + tool  # 57 tokens; its cache mixes two weight versions
        second = run(reusing.generate(second_prompt, SamplingParams(temperature=0.0, max_new_tokens=5)))
        counts = delta(reusing, before)
        assert (counts["prefills"], counts["extends"]) == (1, 0)
        assert reusing.stats()["invalidations"] > before["invalidations"] - 1
        assert list(second.token_ids) == full_forward_greedy(other_params, [second_prompt], [5])[0]
    finally:
        run(reusing.update_weights(params, 0))


def test_nothing_compiles_once_warm_with_reuse(reusing, params):
    jobs = workload(seed=90)
    programs = reusing.compiled_programs()
    with count_compiles() as compiles:
        rollouts(reusing, jobs, 1.0)
        run(reusing.update_weights(params, 2))
        rollouts(reusing, jobs, 0.0)
        run(reusing.update_weights(params, 0))
    assert compiles == []
    assert reusing.compiled_programs() == programs
    assert programs["extend"] >= len(reusing.turn_buckets) == 3 and programs["park"] >= 1


def test_reuse_knobs_are_validated(params):
    with pytest.raises(ValueError, match="park_rows must be >= 0"):
        JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, park_rows=-1, warmup=False)
    with pytest.raises(ValueError, match=r"turn buckets must be non-empty and within \[1, max_len=64\]"):
        JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, turn_buckets=(8, 128), warmup=False)
    engine = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_windows=WINDOWS, warmup=False)
    try:
        assert (engine.reuse_turns, engine.turn_buckets, engine.park_rows) == (True, (16, 32, 64), 2 * SLOTS)
    finally:
        engine.close()
    engine = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_windows=WINDOWS, reuse_turns=False,
                       park_rows=3, warmup=False)
    try:
        assert engine.park_rows == 0  # nothing to park without reuse
    finally:
        engine.close()
