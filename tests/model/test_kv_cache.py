"""KV-cache decoding equals the full forward pass token by token (issue 2 item 4), slot by slot.

Each row is a prompt followed by continuation tokens. The reference is the full forward pass over the whole
left-padded sequences (itself checked against transformers in test_parity); the cached path must give the same
logits at every real position: prompt positions from prefill, the rest from decode_step / extend. Tolerances as in
test_parity (rtol 1e-4, atol 1e-5 x logit scale). Decode steps run in the XLA attention and, for a model whose
attention_impl is 'cpu_fused', in the C++ kernel that reads the stacked cache in place.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import assert_logits_close

from rstar_jax.model import decode_step, extend, forward, init_cache, load_hf, positions_from_mask, prefill
from rstar_jax.model import prefill_slot
from rstar_jax.model.kv_cache import _prefill_slot

FAMILIES = {
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, attention_bias=True)),
    "qwen2_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
}
PROMPT_LENGTHS = [5, 2, 4]
NEW_TOKENS = 4
MAX_LEN = 16


def left_padded(rows: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack token rows of different lengths, left-padded with id 0, and their mask."""
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = row
        mask[index, width - len(row):] = 1
    return ids, mask


def reference_logits(model, rows: list[np.ndarray]) -> list[np.ndarray]:
    """Full-forward logits of each row alone ([len(row), V]), computed as one left-padded batch."""
    width = max(len(row) for row in rows)
    ids, mask = left_padded(rows, width)
    logits = np.asarray(forward(model.params, model.config, ids, positions_from_mask(mask), mask))
    return [logits[index, width - len(row):] for index, row in enumerate(rows)]


def close(actual, expected) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert_logits_close(actual, expected, np.ones(expected.shape[:-1], bool))


@pytest.fixture(params=sorted(FAMILIES))
def model(request, hf_checkpoint):
    family, overrides = FAMILIES[request.param]
    return load_hf(hf_checkpoint(family, seed=1, **overrides)[0])


def random_rows(vocab_size: int, lengths: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, length).astype(np.int32) for length in lengths]


@pytest.mark.parametrize("window", [None, 9])  # 9: the longest row holds 5 + 3 cached tokens at its last step
@pytest.mark.parametrize("attention_impl", ["dense", "cpu_fused"])  # cpu_fused: decode steps in the C++ kernel
def test_prefill_then_decode_steps_equal_full_forward(model, window, attention_impl):
    config = dataclasses.replace(model.config, attention_impl=attention_impl)
    rows = random_rows(config.vocab_size, [n + NEW_TOKENS for n in PROMPT_LENGTHS], seed=0)
    expected = reference_logits(model, rows)
    prompts, prompt_mask = left_padded([row[:n] for row, n in zip(rows, PROMPT_LENGTHS)], max(PROMPT_LENGTHS))

    logits, cache = prefill(model.params, config, init_cache(config, len(rows), MAX_LEN), prompts, prompt_mask)
    width = max(PROMPT_LENGTHS)
    for index, n in enumerate(PROMPT_LENGTHS):
        close(logits[index, width - n:], expected[index][:n])
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENGTHS)

    for step in range(NEW_TOKENS):
        tokens = jnp.asarray([row[n + step] for row, n in zip(rows, PROMPT_LENGTHS)])
        step_logits, cache = decode_step(model.params, config, cache, tokens, window=window)
        assert step_logits.shape == (len(rows), config.vocab_size) and step_logits.dtype == jnp.float32
        close(step_logits, np.stack([expected[i][n + step] for i, n in enumerate(PROMPT_LENGTHS)]))
    np.testing.assert_array_equal(cache.lengths, [n + NEW_TOKENS for n in PROMPT_LENGTHS])


def test_a_window_outside_the_cache_is_rejected(model):
    cache = init_cache(model.config, 1, MAX_LEN)
    for window in (0, MAX_LEN + 1):
        with pytest.raises(ValueError, match="window must be in"):
            decode_step(model.params, model.config, cache, jnp.asarray([1]), window=window)


def test_extend_appends_right_padded_chunks_and_returns_last_logits(model):
    """A tool response of a different length per row appended at once (right padding) continues each row."""
    config = model.config
    chunk_lengths = [3, 1, 2]
    rows = random_rows(config.vocab_size, [n + c for n, c in zip(PROMPT_LENGTHS, chunk_lengths)], seed=1)
    expected = reference_logits(model, rows)
    prompts, prompt_mask = left_padded([row[:n] for row, n in zip(rows, PROMPT_LENGTHS)], max(PROMPT_LENGTHS))
    _, cache = prefill(model.params, config, init_cache(config, len(rows), MAX_LEN), prompts, prompt_mask,
                       all_logits=False)

    chunk = np.zeros((len(rows), max(chunk_lengths)), np.int32)
    chunk_mask = np.zeros_like(chunk)
    for index, (n, c) in enumerate(zip(PROMPT_LENGTHS, chunk_lengths)):
        chunk[index, :c], chunk_mask[index, :c] = rows[index][n:n + c], 1
    last_logits, cache = extend(model.params, config, cache, chunk, chunk_mask, all_logits=False)
    close(last_logits, np.stack([expected[i][-1] for i in range(len(rows))]))
    np.testing.assert_array_equal(cache.lengths, [n + c for n, c in zip(PROMPT_LENGTHS, chunk_lengths)])


def test_prefill_slot_replaces_one_slot_and_leaves_the_others(model):
    """Continuous batching: a new request enters slot 1 while slots 0 and 2 keep decoding, without recompiling."""
    config = model.config
    rows = random_rows(config.vocab_size, [6, 3, 5], seed=2)
    prompts, prompt_mask = left_padded([row[:-1] for row in rows], 5)
    _, cache = prefill(model.params, config, init_cache(config, 3, MAX_LEN), prompts, prompt_mask)
    before = jax.tree_util.tree_map(np.asarray, cache)

    newcomer = random_rows(config.vocab_size, [4], seed=3)[0]
    padded = np.zeros(6, np.int32)
    padded[:4] = newcomer
    slot_logits, cache = prefill_slot(model.params, config, cache, 1, padded, (padded > 0).astype(np.int32))
    close(slot_logits[:4], reference_logits(model, [newcomer])[0])
    for slot in (0, 2):
        np.testing.assert_array_equal(np.asarray(cache.keys[:, slot]), before.keys[:, slot])
        np.testing.assert_array_equal(np.asarray(cache.values[:, slot]), before.values[:, slot])
    np.testing.assert_array_equal(cache.lengths, [5, 4, 4])

    compiled = _prefill_slot._cache_size()
    _, cache = prefill_slot(model.params, config, cache, 2, padded, (padded > 0).astype(np.int32))
    assert _prefill_slot._cache_size() == compiled, "a different slot index must not recompile"
    with pytest.raises(ValueError, match="slot 3 is outside the cache's 3 slots"):
        prefill_slot(model.params, config, cache, 3, padded, (padded > 0).astype(np.int32))

    cache = cache._replace(lengths=cache.lengths.at[2].set(0))  # slot 2 is idle from now on
    tokens = jnp.asarray([rows[0][-1], 7, 0])
    step_logits, cache = decode_step(model.params, config, cache, tokens, jnp.asarray([1, 1, 0]))
    close(step_logits[0], reference_logits(model, [rows[0]])[0][-1])
    close(step_logits[1], reference_logits(model, [np.append(newcomer, 7)])[0][-1])
    np.testing.assert_array_equal(cache.lengths, [6, 5, 0])


def test_a_slot_prefilled_over_a_longer_sequence_never_reads_its_stale_keys(model):
    """`prefill_slot` writes only the new prompt's positions: the keys of a longer sequence the slot held before stay
    beyond its length, and neither the next decode step nor an extension attends to them."""
    config = model.config
    old, prompt = random_rows(config.vocab_size, [7, 3], seed=6)
    _, cache = prefill(model.params, config, init_cache(config, 1, MAX_LEN), old[None], np.ones((1, 7), np.int32))
    logits, cache = prefill_slot(model.params, config, cache, 0, prompt[:2], np.ones(2, np.int32), all_logits=False)
    close(logits, reference_logits(model, [prompt[:2]])[0][-1])
    assert not np.array_equal(np.asarray(cache.keys[:, 0, :, 2:7]), 0), "the stale keys are still there"
    step_logits, cache = decode_step(model.params, config, cache, jnp.asarray([prompt[2]]))
    close(step_logits[0], reference_logits(model, [prompt])[0][-1])
    np.testing.assert_array_equal(cache.lengths, [3])


def test_greedy_decoding_matches_transformers_generate(hf_checkpoint):
    """Same tokens as transformers' generate(do_sample=False) on left-padded prompts of different lengths."""
    folder, reference = hf_checkpoint("qwen3", seed=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    model = load_hf(folder)
    rows = random_rows(model.config.vocab_size, [6, 3], seed=5)
    prompts, mask = left_padded(rows, 6)
    with torch.no_grad():
        generated = reference.generate(torch.from_numpy(prompts).long(), attention_mask=torch.from_numpy(mask).long(),
                                       do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                                       eos_token_id=None)[:, 6:].numpy()

    logits, cache = prefill(model.params, model.config, init_cache(model.config, 2, MAX_LEN), prompts, mask,
                            all_logits=False)
    tokens = []
    for _ in range(6):
        next_tokens = jnp.argmax(logits, axis=-1)
        tokens.append(np.asarray(next_tokens))
        logits, cache = decode_step(model.params, model.config, cache, next_tokens)
    np.testing.assert_array_equal(np.stack(tokens, axis=1), generated)
