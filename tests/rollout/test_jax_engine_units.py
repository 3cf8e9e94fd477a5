"""The JAX engine's pure parts: the sampler (greedy, temperature, top-p, per-request keys), buckets, finish rules.

Sampling is checked against hand-computed distributions: logits log([0.5, 0.3, 0.15, 0.05]) make every nucleus
and tempered probability a number one can write down.
"""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rollout.engine import SamplingParams
from rstar_jax.rollout.jax_engine_slots import CacheMemo, Request, SlotTable, Start, common_prefix
from rstar_jax.rollout.jax_engine_steps import bucket_for, check_buckets, power_of_two_buckets, suffix_chunks
from rstar_jax.rollout.sampling import first_argmax, nucleus_mask, request_key, sample_tokens, seed_words

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)
DRAWS = 4000


def draw(temperature: float, top_p: float, seed: int = 3, draws: int = DRAWS) -> tuple[np.ndarray, np.ndarray]:
    """`draws` samples from LOGITS, one per position of one request (so each uses a fresh key)."""
    sample = jax.jit(sample_tokens)
    tokens, logprobs = sample(jnp.tile(LOGITS, (draws, 1)), jnp.full(draws, temperature, jnp.float32),
                              jnp.full(draws, top_p, jnp.float32), jnp.tile(seed_words(seed), (draws, 1)),
                              jnp.arange(draws, dtype=jnp.int32))
    return np.asarray(tokens), np.asarray(logprobs)


def assert_frequencies(tokens: np.ndarray, expected: np.ndarray) -> None:
    """Empirical frequencies within 4 standard errors of `expected` (zero-probability tokens never drawn)."""
    counts = np.bincount(tokens, minlength=len(expected)) / len(tokens)
    tolerance = 4 * np.sqrt(expected * (1 - expected) / len(tokens))
    np.testing.assert_array_less(np.abs(counts - expected), tolerance + 1e-12)


def test_seed_words_keep_64_bit_identity_and_wrap_negative_seeds():
    np.testing.assert_array_equal(seed_words(0), [0, 0])
    np.testing.assert_array_equal(seed_words((5 << 32) + 7), [5, 7])
    np.testing.assert_array_equal(seed_words(-1), [0xFFFFFFFF, 0xFFFFFFFF])
    assert seed_words(1).dtype == np.uint32


@pytest.mark.parametrize("top_p, kept", [(1.0, [0, 1, 2, 3]), (0.9, [0, 1, 2]), (0.8, [0, 1]), (0.7, [0, 1]),
                                         (0.5, [0]), (0.01, [0])])
def test_nucleus_is_the_smallest_top_set_reaching_top_p(top_p, kept):
    shuffled = np.array([2, 0, 3, 1])  # the order must not matter
    mask = np.asarray(nucleus_mask(jnp.asarray(LOGITS[shuffled])[None], jnp.asarray([top_p])))[0]
    assert sorted(shuffled[mask].tolist()) == kept


def test_temperature_one_samples_the_softmax_and_reports_its_logprob():
    tokens, logprobs = draw(1.0, 1.0)
    assert_frequencies(tokens, PROBS)
    np.testing.assert_allclose(logprobs, np.log(PROBS)[tokens], atol=1e-6)


def test_top_p_renormalises_over_the_nucleus():
    tokens, logprobs = draw(1.0, 0.7)
    assert_frequencies(tokens, np.array([0.625, 0.375, 0.0, 0.0]))  # 0.5 and 0.3 renormalised
    np.testing.assert_allclose(logprobs, np.log(PROBS)[tokens], atol=1e-6)  # still the untruncated policy


def test_temperature_sharpens_but_logprobs_stay_at_temperature_one():
    tokens, logprobs = draw(0.5, 1.0)
    tempered = PROBS ** 2 / np.sum(PROBS ** 2)  # p^(1/T) renormalised, T = 0.5
    assert_frequencies(tokens, tempered)
    np.testing.assert_allclose(logprobs, np.log(PROBS)[tokens], atol=1e-6)


def test_temperature_zero_is_argmax_whatever_the_seed():
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    tokens, logprobs = jax.jit(sample_tokens)(jnp.asarray(logits), jnp.zeros(6), jnp.full(6, 0.3), jnp.asarray(
        [seed_words(s) for s in range(6)]), jnp.arange(6, dtype=jnp.int32))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, log_softmax[np.arange(6), logits.argmax(-1)], atol=1e-5)


def test_a_rows_sample_depends_on_its_seed_and_position_only():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 64)).astype(np.float32)
    seeds = np.array([seed_words(s) for s in rng.integers(0, 1 << 40, 8)])
    positions = rng.integers(0, 500, 8).astype(np.int32)
    temperature, top_p = np.full(8, 0.9, np.float32), np.full(8, 0.95, np.float32)
    sample = jax.jit(sample_tokens)
    batched, _ = sample(logits, temperature, top_p, seeds, positions)
    permutation = rng.permutation(8)
    permuted, _ = sample(logits[permutation], temperature[permutation], top_p[permutation], seeds[permutation],
                         positions[permutation])
    np.testing.assert_array_equal(np.asarray(permuted), np.asarray(batched)[permutation])
    for row in range(8):
        alone, _ = sample(logits[row:row + 1], temperature[:1], top_p[:1], seeds[row:row + 1],
                          positions[row:row + 1])
        assert int(alone[0]) == int(batched[row])
    different_seed, _ = draw(1.0, 1.0, seed=4, draws=200)
    assert not np.array_equal(different_seed, draw(1.0, 1.0, seed=3, draws=200)[0])


def test_the_sampled_tokens_are_jax_random_categoricals_token_for_token():
    """The sampler's Gumbel-max with its vectorised argmax draws exactly what `jax.random.categorical` draws from
    the same keys (the engine's tokens did not change with it), ties and masked tokens included."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(64, 300)).astype(np.float32)
    logits[:8, :40] = -np.inf  # a nucleus mask
    logits[8:16] = np.round(logits[8:16])  # ties
    seeds = np.array([seed_words(s) for s in rng.integers(0, 1 << 40, 64)])
    positions = rng.integers(0, 900, 64).astype(np.int32)
    tokens, _ = jax.jit(sample_tokens)(logits, np.ones(64, np.float32), np.ones(64, np.float32), seeds, positions)
    keys = jax.vmap(request_key)(seeds, positions)
    np.testing.assert_array_equal(tokens, jax.vmap(jax.random.categorical)(keys, logits))
    np.testing.assert_array_equal(first_argmax(logits[8:16]), np.argmax(logits[8:16], axis=-1))
    assert int(first_argmax(jnp.full((1, 5), jnp.nan))[0]) == 4


def test_buckets_cover_every_admissible_prompt():
    assert power_of_two_buckets(64) == (16, 32, 64)
    assert power_of_two_buckets(100) == (16, 32, 64, 100)
    assert power_of_two_buckets(8) == (8,)
    assert check_buckets([64, 8, 8, 32], 64) == (8, 32, 64)
    assert check_buckets([63], 64) == (63,)  # the longest prompt is max_len - 1
    assert [bucket_for(n, (8, 32, 64)) for n in (1, 8, 9, 32, 33, 63)] == [8, 8, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="cannot hold the longest admissible prompt"):
        check_buckets([16, 32], 64)
    with pytest.raises(ValueError, match="within"):
        check_buckets([16, 128], 64)
    with pytest.raises(ValueError, match="exceeds the largest prefill bucket"):
        bucket_for(65, (16, 64))
    with pytest.raises(ValueError, match="max_len"):
        power_of_two_buckets(1)


def make_request(prompt_length: int, **sampling) -> Request:
    loop = asyncio.new_event_loop()
    request = Request(np.arange(prompt_length, dtype=np.int32), SamplingParams(**sampling), seed_words(0), loop,
                      loop.create_future())
    loop.close()
    return request


def test_a_stop_token_ends_the_turn_and_is_kept():
    request = make_request(3, stop_token_ids=(9, 7), max_new_tokens=10)
    assert [request.record(t, -0.5, max_len=100) for t in (4, 5, 7)] == [None, None, "stop"]
    generation = request.generation("stop")
    assert generation.token_ids == (4, 5, 7) and generation.logprobs == (-0.5,) * 3


def test_length_ends_at_max_new_tokens_or_a_full_slot():
    request = make_request(3, max_new_tokens=2)
    assert [request.record(t, 0.0, max_len=100) for t in (4, 5)] == [None, "length"]
    request = make_request(6, max_new_tokens=10)
    assert [request.record(t, 0.0, max_len=8) for t in (4, 5)] == [None, "length"]  # 6 + 2 = max_len
    request = make_request(3, max_new_tokens=1, stop_token_ids=(4,))
    assert request.record(4, 0.0, max_len=100) == "stop"  # a stop token wins over the budget


def test_slot_table_tracks_decode_inputs_and_live_tokens():
    table = SlotTable(3)
    request = make_request(5, temperature=0.7, top_p=0.9)
    assert table.free_slot() == 0
    table.occupy(0, request, pending_token=11)
    request.record(11, 0.0, max_len=100)
    assert table.free_slot() == 1 and table.running == 1 and table.live_tokens() == 6
    np.testing.assert_array_equal(table.active, [1, 0, 0])
    assert table.pending_tokens[0] == 11 and table.temperature[0] == np.float32(0.7)
    with pytest.raises(RuntimeError, match="already occupied"):
        table.occupy(0, request, 1)
    table.release(0)
    assert table.running == 0 and table.live_tokens() == 0 and table.occupied() == []


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int32)


def test_cache_memo_copies_a_whole_prompt_held_with_its_logits():
    memo = CacheMemo(slots=3)
    first, second = ids(5, 6, 7), ids(5, 6)
    assert memo.plan(first, free=[0, 1, 2], busy=[]) == Start("prefill")
    memo.hold(0, first, "logits of first")
    memo.hold(1, first, "logits of first")  # a copy
    memo.hold(2, second, "logits of second")
    assert memo.plan(first, free=[], busy=[0, 1, 2]) == Start("copy", 0, 3, False)
    assert memo.plan(first, free=[1], busy=[0, 2]) == Start("copy", 1, 3, True)  # in place: nothing lost
    assert memo.logits(1) == "logits of first"
    # A prefix is a different prompt: no logits after it, so without extension it is prefilled.
    assert memo.plan(ids(5), free=[], busy=[0, 1, 2]) == Start("prefill")
    assert memo.plan(second, free=[], busy=[0, 1, 2]) == Start("copy", 2, 2, False)
    memo.hold(0, second, "logits of second")  # slot 0 overwritten: the first prompt lives on in slot 1
    assert memo.plan(first, free=[], busy=[0, 1, 2]) == Start("copy", 1, 3, False)
    memo.forget()
    assert memo.plan(first, free=[0, 1, 2], busy=[]) == Start("prefill")


def test_cache_memo_extends_the_longest_held_prefix_when_worth_it():
    memo = CacheMemo(slots=2, park_rows=2)
    memo.hold(0, ids(1, 2, 3), "l0")
    memo.grow(0, ids(1, 2, 3, 4, 5))  # the turn ended: prompt + sampled tokens but the last
    memo.hold(3, ids(1, 2, 9), "l3")  # a parked row
    always = lambda shared: True  # noqa: E731
    # The trajectory's next turn continues slot 0's tokens: extended there in place.
    assert memo.plan(ids(1, 2, 3, 4, 5, 6, 7), free=[0, 1], busy=[], worth_extending=always) == Start(
        "extend", 0, 5, True)
    # A sibling shares only 3 tokens of slot 0: extended from it into another slot (slot 0 keeps its tokens).
    assert memo.plan(ids(1, 2, 3, 8), free=[0, 1], busy=[], worth_extending=always) == Start("extend", 0, 3, False)
    # The parked row shares more: extended from it.
    assert memo.plan(ids(1, 2, 9, 9), free=[1], busy=[0], worth_extending=always) == Start("extend", 3, 3, False)
    # The whole prompt held without logits after it: the last token is prefilled again for them.
    assert memo.plan(ids(1, 2, 3, 4), free=[0, 1], busy=[], worth_extending=always) == Start("extend", 0, 3, False)
    assert memo.plan(ids(1, 2, 3, 4, 5), free=[0, 1], busy=[], worth_extending=always) == Start(
        "extend", 0, 4, True)
    # Not worth it, no reuse asked for, or nothing shared: prefill.
    assert memo.plan(ids(1, 2, 3, 4, 5, 6), free=[0], busy=[], worth_extending=lambda shared: shared > 5) == Start(
        "prefill")
    assert memo.plan(ids(1, 2, 3, 4, 5, 6), free=[0], busy=[]) == Start("prefill")
    assert memo.plan(ids(7, 1, 2), free=[0, 1], busy=[], worth_extending=always) == Start("prefill")


def test_cache_memo_evicts_empty_rows_first_then_the_least_recently_used():
    memo = CacheMemo(slots=3, park_rows=2)
    assert list(memo.park) == [3, 4]
    memo.hold(0, ids(1), None)
    memo.hold(1, ids(2), None)
    assert memo.victim([0, 1, 2]) == 2
    assert memo.victim([0, 1]) == 0
    memo.touch(0)
    assert memo.victim([0, 1]) == 1
    memo.move(1, 3)  # slot 1 parked in row 3: the same entry, just used
    assert memo.tokens(3).tolist() == [2] and memo.victim([0, 3]) == 0
    memo.drop(0)
    assert memo.tokens(0) is None and memo.victim([1, 0]) == 0


def test_cache_memo_grows_a_slot_only_while_its_entry_is_valid():
    memo = CacheMemo(slots=1)
    memo.hold(0, ids(1, 2), "logits")
    memo.grow(0, ids(1, 2, 3))
    assert memo.tokens(0).tolist() == [1, 2, 3] and memo.logits(0) == "logits"
    with pytest.raises(RuntimeError, match="does not extend"):
        memo.grow(0, ids(1, 4, 3, 5))
    memo.forget()  # new weights while the turn ran: its cache mixes two versions
    memo.grow(0, ids(1, 2, 3, 4))
    assert memo.tokens(0) is None


def test_common_prefix_and_suffix_chunks():
    assert common_prefix(ids(1, 2, 3), ids(1, 2, 4, 5)) == 2
    assert common_prefix(ids(1, 2), ids(1, 2, 4)) == 2 and common_prefix(ids(3), ids(1)) == 0
    assert suffix_chunks(5, (4, 8)) == [(5, 8)]
    assert suffix_chunks(8, (4, 8)) == [(8, 8)]
    assert suffix_chunks(19, (4, 8)) == [(8, 8), (8, 8), (3, 4)]
    with pytest.raises(ValueError, match="at least one token"):
        suffix_chunks(0, (4, 8))
