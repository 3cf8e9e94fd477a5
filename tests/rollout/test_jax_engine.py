"""The JAX engine end to end against the learner's model (issue 5, item 3).

References are the learner's own functions: greedy decoding by re-running the full `forward` over the whole
sequence at every step, and `token_logprobs` over prompt + generated tokens. Every engine here has the same
shapes (4 slots of 64 tokens, buckets 16/32/64, decode windows 16/32/64 so sequences cross windows, 4 decode
steps per call; one more engine decodes 1 step per call), so the programs compile once per test process.
"""

import asyncio
import contextlib
import dataclasses
from typing import Iterator

import gin
import jax
import jax.monitoring
import numpy as np
import pytest

from rstar_jax.model import ModelConfig, forward, init_params, positions_from_mask, token_logprobs
from rstar_jax.rollout.engine import EngineUnavailable, GenerationEngine, SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine

pytestmark = pytest.mark.slow

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, tie_word_embeddings=False)  # untied: greedy does not just repeat
SLOTS, MAX_LEN, DECODE_STEPS = 4, 64, 4
WINDOWS = (16, 32, 64)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def other_params():
    return init_params(CONFIG, jax.random.key(1))


@pytest.fixture(scope="module")
def engine(params):
    engine = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_steps=DECODE_STEPS,
                    decode_windows=WINDOWS)
    engine.wait_ready(timeout=600)
    yield engine
    engine.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT))


async def generate_all(engine: JaxEngine, prompts, samplings):
    return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, samplings)))


def padded(sequences: list[list[int]], width: int = MAX_LEN) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids and mask [N, width]."""
    ids = np.zeros((len(sequences), width), np.int32)
    mask = np.zeros((len(sequences), width), np.int32)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = sequence
        mask[row, :len(sequence)] = 1
    return ids, mask


def full_forward_greedy(params, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """Greedy continuations, each token the argmax of a full forward pass over the sequence so far."""
    sequences = [list(p) for p in prompts]
    for _ in range(max(new_tokens)):
        ids, mask = padded(sequences)
        logits = np.asarray(forward(params, CONFIG, ids, positions_from_mask(mask), mask))
        for row, sequence in enumerate(sequences):
            if len(sequence) - len(prompts[row]) < new_tokens[row] and len(sequence) < MAX_LEN:
                sequence.append(int(logits[row, len(sequence) - 1].argmax()))
    return [sequence[len(prompt):] for sequence, prompt in zip(sequences, prompts)]


def learner_logprobs(params, prompts, generated) -> list[np.ndarray]:
    """log p(generated token | everything before it) from the learner's token_logprobs."""
    sequences = [list(p) + list(g) for p, g in zip(prompts, generated)]
    ids, mask = padded(sequences)
    targets = np.concatenate([ids[:, 1:], np.zeros((len(ids), 1), np.int32)], axis=1)
    logprobs = np.asarray(token_logprobs(params, CONFIG, ids, positions_from_mask(mask), mask, targets))
    return [logprobs[row, len(p) - 1:len(p) - 1 + len(g)] for row, (p, g) in enumerate(zip(prompts, generated))]


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CONFIG.vocab_size, n).tolist() for n in lengths]


@contextlib.contextmanager
def count_compiles() -> Iterator[list[float]]:
    """Durations of every XLA backend compilation in the block (any function, any thread)."""
    compiles: list[float] = []

    def listener(event: str, duration: float, **_) -> None:
        if event == BACKEND_COMPILE:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_is_a_generation_engine(engine):
    assert isinstance(engine, GenerationEngine)


def test_greedy_equals_full_forward_greedy_while_requests_join_and_leave(engine, params):
    # 7 requests on 4 slots, every bucket, different budgets: slots free and refill between steps.
    lengths, budgets = [1, 5, 17, 33, 40, 60, 12], [20, 7, 30, 12, 24, 10, 3]
    prompts = random_prompts(lengths, seed=0)
    samplings = [SamplingParams(temperature=0.0, top_p=0.5, max_new_tokens=b, seed=i) for i, b in enumerate(budgets)]
    generations = run(generate_all(engine, prompts, samplings))
    expected = full_forward_greedy(params, prompts, budgets)
    for generation, tokens, length, budget in zip(generations, expected, lengths, budgets):
        assert list(generation.token_ids) == tokens
        assert generation.finish_reason == "length"
        assert len(tokens) == min(budget, MAX_LEN - length)  # the 60-token prompt stops at a full slot


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_logprobs_equal_the_learners(engine, params, temperature, top_p):
    prompts = random_prompts([3, 20, 45, 9, 30], seed=1)
    samplings = [SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=18, seed=10 + i)
                 for i in range(len(prompts))]
    generations = run(generate_all(engine, prompts, samplings))
    expected = learner_logprobs(params, prompts, [g.token_ids for g in generations])
    for generation, reference in zip(generations, expected):
        np.testing.assert_allclose(generation.logprobs, reference, atol=1e-4, rtol=0)


def test_engines_decoding_in_the_cpu_kernel_equal_the_learner_side_by_side(params):
    # attention_impl 'cpu_fused': decode steps attend through the C++ kernel that reads the stacked cache in place
    # (prefills keep XLA's dots); greedy tokens and sampled log-probs as the learner's full forward pass gives them.
    # Two engines decode at once, as the demo's do: each kernel call shares its work over XLA's intra-op threads,
    # and a call must not wait for threads that are themselves inside the other engine's call.
    config = dataclasses.replace(CONFIG, attention_impl="cpu_fused")
    engines = [JaxEngine(config, params, slots=SLOTS, max_len=MAX_LEN, decode_steps=DECODE_STEPS,
                         decode_windows=WINDOWS) for _ in range(2)]
    try:
        prompts, budgets = random_prompts([1, 5, 17, 33, 40, 60, 12], seed=0), [20, 7, 30, 12, 24, 10, 3]
        greedy = [SamplingParams(temperature=0.0, max_new_tokens=b, seed=i) for i, b in enumerate(budgets)]
        sampled_prompts = random_prompts([3, 20, 45, 9, 30], seed=1)
        sampled = [SamplingParams(temperature=1.0, max_new_tokens=18, seed=10 + i) for i in range(len(sampled_prompts))]

        async def both():
            return await asyncio.gather(generate_all(engines[0], prompts, greedy),
                                        generate_all(engines[1], sampled_prompts, sampled))

        greedy_generations, sampled_generations = run(both())
        assert [list(g.token_ids) for g in greedy_generations] == full_forward_greedy(params, prompts, budgets)
        expected = learner_logprobs(params, sampled_prompts, [g.token_ids for g in sampled_generations])
        for generation, reference in zip(sampled_generations, expected):
            np.testing.assert_allclose(generation.logprobs, reference, atol=1e-4, rtol=0)
    finally:
        for engine in engines:
            engine.close()


def test_a_seeded_request_samples_the_same_whichever_slot_and_neighbours(engine):
    prompt = random_prompts([11], seed=2)[0]
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=25, seed=1234)
    alone = run(engine.generate(prompt, sampling))
    # Three other requests go first, so this one lands in another slot beside different company.
    crowd = random_prompts([7, 30, 2], seed=3)
    others = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=None) for n in (5, 40, 13)]
    crowded = run(generate_all(engine, crowd + [prompt], others + [sampling]))[-1]
    assert crowded.token_ids == alone.token_ids
    np.testing.assert_allclose(crowded.logprobs, alone.logprobs, atol=1e-5)
    reseeded = run(engine.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=25, seed=1235)))
    assert reseeded.token_ids != alone.token_ids


def test_a_repeated_prompt_is_copied_from_its_slot_and_samples_what_a_prefill_would(engine, params, other_params):
    # Six rollouts of one prompt (a GRPO group) on 4 slots, and one other prompt: 2 prefills, 5 copies. The last
    # rollouts start after the first ones finished, copying a slot that decoded further or was released (and is
    # the free slot they land in).
    prompt, other = random_prompts([13, 21], seed=20)
    budgets = [3, 9, 20, 14, 11, 6]
    samplings = [SamplingParams(temperature=t, top_p=0.9, max_new_tokens=n, seed=30 + i)
                 for i, (t, n) in enumerate(zip([1.0, 0.7, 1.0, 0.0, 1.0, 1.0], budgets))]
    other_sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=40)
    before = (engine.prefills, engine.copies)
    together = run(generate_all(engine, [prompt] * 6 + [other], samplings + [other_sampling]))
    assert (engine.prefills - before[0], engine.copies - before[1]) == (2, 5)
    assert len({g.token_ids for g in together[:6]}) == 6  # every rollout its own sample
    # References: each request alone after a weight update, which makes the engine forget every cached prompt.
    for generation, sampling in zip(together[:6], samplings):
        run(engine.update_weights(params, 0))
        prefills = engine.prefills
        alone = run(engine.generate(prompt, sampling))
        assert engine.prefills == prefills + 1
        assert alone.token_ids == generation.token_ids
        np.testing.assert_allclose(alone.logprobs, generation.logprobs, atol=1e-5)  # decode windows may differ
    assert list(together[3].token_ids) == full_forward_greedy(params, [prompt], [14])[0]
    # A prompt cached under the old weights is prefilled again under new ones.
    try:
        run(engine.update_weights(other_params, 1))
        greedy = run(engine.generate(prompt, samplings[3]))
        assert list(greedy.token_ids) == full_forward_greedy(other_params, [prompt], [14])[0]
    finally:
        run(engine.update_weights(params, 0))


def test_a_stop_token_ends_the_turn_at_its_first_occurrence(engine, params):
    prompt = random_prompts([6], seed=4)[0]
    greedy = full_forward_greedy(params, [prompt], [20])[0]
    stop = greedy[4]
    first = greedy.index(stop)
    generation = run(engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20,
                                                            stop_token_ids=(stop, CONFIG.vocab_size - 1))))
    assert list(generation.token_ids) == greedy[:first + 1]
    assert generation.finish_reason == "stop"


def test_decode_windows_must_end_at_max_len(params):
    with pytest.raises(ValueError, match="decode windows"):
        JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_windows=(16, 32), warmup=False)
    with pytest.raises(ValueError, match="largest decode window must be max_len=64"):
        JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_windows=(16, 63), warmup=False)


def test_prompts_that_do_not_fit_or_are_not_token_ids_are_rejected(engine):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
    with pytest.raises(ValueError, match="no room"):
        run(engine.generate(list(range(MAX_LEN)), sampling))
    one = run(engine.generate(list(range(1, MAX_LEN)), sampling))  # 63 + 1 fills the slot
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    with pytest.raises(ValueError, match="non-empty"):
        run(engine.generate([], sampling))
    with pytest.raises(ValueError, match=r"lie in \[0, 256\)"):
        run(engine.generate([1, 256], sampling))
    with pytest.raises(ValueError, match="integers"):
        run(engine.generate([1.5], sampling))
    with pytest.raises(TypeError, match="SamplingParams, got dict"):
        run(engine.generate([1, 2], {"temperature": 0.0}))
    assert run(engine.generate([1, 2], sampling)).token_ids  # still serving


def test_capacity_reports_live_tokens_running_and_waiting(engine):
    prompts = random_prompts([10, 20, 5, 8, 3, 4], seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)

    async def scenario():
        tasks = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts]
        seen = []
        while not all(task.done() for task in tasks):
            seen.append(await engine.capacity())
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        return seen, await engine.capacity()

    seen, after = run(scenario())
    busy = [c for c in seen if c.requests_running == SLOTS]
    assert busy, "never saw every slot busy"
    assert all(c.kv_tokens_total == SLOTS * MAX_LEN for c in seen)
    assert any(c.requests_waiting == len(prompts) - SLOTS for c in busy)
    assert all(c.requests_running + c.requests_waiting <= len(prompts) for c in seen)
    # Four of the prompts (at least 3 + 4 + 5 + 8 tokens plus one sampled each) to the longest four at 40 tokens.
    assert all(24 <= c.kv_tokens_used <= 4 * (20 + 40) for c in busy)
    assert (after.kv_tokens_used, after.requests_running, after.requests_waiting) == (0, 0, 0)


def test_new_weights_serve_the_next_generation(engine, params, other_params):
    prompts = random_prompts([9, 25], seed=6)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=15)
    try:
        run(engine.update_weights(other_params, 7))
        assert engine.weights_version == 7
        after = run(generate_all(engine, prompts, [sampling] * 2))
        assert [list(g.token_ids) for g in after] == full_forward_greedy(other_params, prompts, [15, 15])
    finally:
        run(engine.update_weights(params, 0))
    back = run(generate_all(engine, prompts, [sampling] * 2))
    assert [list(g.token_ids) for g in back] == full_forward_greedy(params, prompts, [15, 15])


def test_weights_swap_between_steps_of_a_running_turn(engine, params, other_params):
    prompt = random_prompts([4], seed=7)[0]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=50)

    async def swap_midway():
        task = asyncio.create_task(engine.generate(prompt, sampling))
        while (await engine.capacity()).kv_tokens_used < len(prompt) + 10:
            await asyncio.sleep(0.001)
        await engine.update_weights(other_params, 1)
        return await task

    try:
        generation = run(swap_midway())
    finally:
        run(engine.update_weights(params, 0))
    old = full_forward_greedy(params, [prompt], [50])[0]
    assert len(generation.token_ids) == 50 and generation.finish_reason == "length"
    assert list(generation.token_ids[:10]) == old[:10]  # before the swap: the old weights' greedy tokens
    assert list(generation.token_ids) != old  # after it, within the same turn: the new weights'


def test_update_weights_rejects_another_models_parameters(engine, params):
    missing = {k: v for k, v in params.items() if k != "final_norm"}
    with pytest.raises(ValueError, match="missing.*final_norm"):
        run(engine.update_weights(missing, 1))
    wider = jax.tree.map(lambda x: x, params)
    wider["final_norm"] = {"scale": np.ones(CONFIG.hidden_size + 1, np.float32)}
    with pytest.raises(ValueError, match=r"\['final_norm'\]\['scale'\] has shape \(65,\)"):
        run(engine.update_weights(wider, 1))
    assert engine.weights_version == 0


def test_nothing_compiles_once_warm(engine, params):
    prompts = random_prompts([2, 16, 17, 31, 50, 63, 8, 40], seed=8)
    samplings = [SamplingParams(temperature=t, top_p=p, max_new_tokens=12, seed=i, stop_token_ids=(5,))
                 for i, (t, p) in enumerate([(0.0, 1.0), (1.0, 1.0), (0.6, 0.9), (1.0, 0.5)] * 2)]
    host_params = jax.tree.map(np.asarray, params)
    programs = engine.compiled_programs()
    with count_compiles() as compiles:
        run(generate_all(engine, prompts, samplings))
        run(engine.update_weights(host_params, 3))
        run(generate_all(engine, prompts[::-1], samplings))
        run(engine.update_weights(params, 0))
    assert compiles == []
    assert engine.compiled_programs() == programs
    assert programs["prefill"] >= len(engine.buckets) == 3 and programs["decode"] >= len(engine.decode_windows) == 3
    assert programs["copy"] >= 1


def test_cancelled_requests_leave_and_the_engine_goes_on(engine):
    prompts = random_prompts([5] * 6, seed=9)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=55)

    async def cancel_some():
        tasks = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts]
        while (await engine.capacity()).requests_running < SLOTS:
            await asyncio.sleep(0.001)
        for task in tasks[:2] + tasks[-1:]:  # two running ones and a waiting one
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, await engine.capacity()

    results, after = run(cancel_some())
    assert [isinstance(r, asyncio.CancelledError) for r in results] == [True, True, False, False, False, True]
    assert all(len(r.token_ids) == 55 for r in results[2:5])
    assert (after.requests_running, after.requests_waiting) == (0, 0)


def test_close_fails_pending_requests_and_refuses_new_ones(params):
    engine = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_steps=DECODE_STEPS,
                    decode_windows=WINDOWS)
    prompts = random_prompts([3] * 6, seed=10)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=60)

    async def close_midway():
        tasks = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts]
        while (await engine.capacity()).requests_running < SLOTS:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.close)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(close_midway())
    assert all(isinstance(r, EngineUnavailable) and "closed" in str(r) for r in results)
    with pytest.raises(EngineUnavailable, match="closed"):
        run(engine.generate([1, 2], sampling))
    engine.close()  # idempotent


def test_a_dead_stepping_thread_fails_every_request_instead_of_hanging(params):
    engine = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_steps=DECODE_STEPS,
                    decode_windows=WINDOWS)
    engine.wait_ready(timeout=600)
    prompts = random_prompts([3] * 6, seed=11)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=60)

    async def break_midway():
        tasks = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts]
        while (await engine.capacity()).requests_running < SLOTS:
            await asyncio.sleep(0.001)
        # A device buffer of the served weights freed under the engine: the next jitted step raises.
        jax.tree_util.tree_leaves(engine._params)[0].delete()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(break_midway())
    assert all(isinstance(r, EngineUnavailable) and "died" in str(r) for r in results)
    with pytest.raises(EngineUnavailable, match="died"):
        run(engine.generate([1, 2], sampling))
    with pytest.raises(EngineUnavailable, match="died"):
        run(engine.capacity())
    engine.close()


def test_tokens_per_device_call_do_not_change_what_is_sampled(engine, params):
    prompts = random_prompts([4, 19, 33, 8, 50, 2], seed=12)
    samplings = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=n, seed=100 + i, stop_token_ids=(7,))
                 for i, n in enumerate([30, 9, 25, 14, 13, 40])]
    single = JaxEngine(CONFIG, params, slots=SLOTS, max_len=MAX_LEN, decode_steps=1,
                    decode_windows=WINDOWS)
    try:
        one_by_one = run(generate_all(single, prompts, samplings))
    finally:
        single.close()
    four_at_once = run(generate_all(engine, prompts, samplings))
    for a, b in zip(one_by_one, four_at_once):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_engine_knobs_are_gin_configurable(params):
    gin.parse_config(["JaxEngine.slots = 2", "JaxEngine.max_len = 48", "JaxEngine.prefill_buckets = (20, 48)",
                      "JaxEngine.dtype = 'bfloat16'", "JaxEngine.decode_steps = 3", "JaxEngine.warmup = False"])
    try:
        engine = JaxEngine(CONFIG, params)
    finally:
        gin.clear_config()
    try:
        assert (engine.slots, engine.max_len, engine.buckets, engine.decode_steps) == (2, 48, (20, 48), 3)
        assert engine.config.dtype == engine.config.param_dtype == "bfloat16"
        assert run(engine.capacity()).kv_tokens_total == 96
    finally:
        engine.close()
