"""Packed rows (issue 12): segment ids give the old padding-mask numbers on 0/1 masks, positions restart at each
packed sequence, and a sequence packed with others gets exactly the log-probs it gets alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.model import causal_padding_mask, init_params, positions_from_mask, token_logprobs
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.segments import allowed_keys, segment_positions

CONFIG = ModelConfig(family="qwen3", vocab_size=50, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8)


def test_positions_of_a_0_1_mask_are_the_padded_batch_rule_holes_included():
    mask = np.array([[0, 0, 1, 1, 1, 0], [1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    expected = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    np.testing.assert_array_equal(positions_from_mask(jnp.asarray(mask)), expected)
    np.testing.assert_array_equal(positions_from_mask(jnp.asarray(mask.astype(bool))), expected)


def test_packed_positions_restart_at_each_segment():
    ids = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 2, 2, 2, 2], [4, 4, 2, 2, 2, 1, 1, 0]])
    np.testing.assert_array_equal(segment_positions(ids), [[0, 1, 2, 0, 1, 0, 5, 5],
                                                          [0, 0, 0, 1, 0, 1, 2, 3],
                                                          [0, 1, 0, 1, 2, 0, 1, 6]])


def test_the_mask_of_a_0_1_mask_is_causal_padding_and_segments_never_cross():
    mask = jnp.asarray([[0, 1, 1, 0], [1, 1, 1, 1]])
    causal = np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(causal_padding_mask(mask), causal[None] & np.asarray(mask, bool)[:, None, :])
    packed = causal_padding_mask(jnp.asarray([[1, 1, 2, 2]]))[0]
    np.testing.assert_array_equal(packed, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
    # a padding query reads every real key (as under a 0/1 mask); nobody reads a padding key
    np.testing.assert_array_equal(allowed_keys(jnp.asarray([0, 1, 2]), jnp.asarray([0, 1, 2])),
                                  [[0, 1, 1], [0, 1, 0], [0, 0, 1]])


@pytest.mark.parametrize("attention", [dict(attention_impl="dense"),
                                       dict(attention_impl="causal_blockwise", attention_block_size=4)])
def test_a_packed_sequence_gets_the_logprobs_it_gets_alone(attention):
    config = dataclasses.replace(CONFIG, **attention)
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    lengths = (7, 5, 3)
    sequences = [rng.integers(1, 50, n).astype(np.int32) for n in lengths]
    row = np.concatenate(sequences + [np.zeros(1, np.int32)])[None]  # 15 tokens packed + 1 padding
    segments = np.concatenate([np.full(n, k + 1) for k, n in enumerate(lengths)] + [[0]])[None].astype(np.int32)
    targets = np.roll(row, -1, axis=1)
    packed = token_logprobs(params, config, row, positions_from_mask(jnp.asarray(segments)), segments, targets)
    start = 0
    for sequence in sequences:
        n = len(sequence)
        ids = sequence[None]
        alone = token_logprobs(params, config, ids, np.arange(n)[None], np.ones((1, n), np.int32),
                               np.roll(ids, -1, axis=1))
        # the last token of each sequence predicts the next sequence's first token: not a trained target
        np.testing.assert_allclose(packed[0, start:start + n - 1], alone[0, :n - 1], rtol=1e-5, atol=1e-5)
        start += n
