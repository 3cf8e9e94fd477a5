"""The SFT's drill batches (rstar_jax.train.sft_run.drill_batch): snippet drills pad to their longest row, filled
drills are exactly `length` predictions each, every token trained."""

import numpy as np

from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.batching import make_batch
from rstar_jax.train.sft_run import drill_batch


def test_filled_drills_make_an_unpadded_batch_of_the_asked_length():
    tokenizer = load_tokenizer("tiny")
    batch = make_batch(drill_batch(3, 4, tokenizer, seed=0, snippets=3, length=256), pad_id=0)
    assert batch.shape == (4, 256)
    assert np.all(np.asarray(batch.attention_mask) == 1) and np.all(np.asarray(batch.loss_mask) == 1)


def test_snippet_drills_are_the_steps_own_drills_padded_to_the_longest():
    tokenizer = load_tokenizer("tiny")
    rows = drill_batch(3, 4, tokenizer, seed=0, snippets=3)
    assert rows == drill_batch(3, 4, tokenizer, seed=0, snippets=3) and rows != drill_batch(4, 4, tokenizer, 0, 3)
    lengths = [len(row.token_ids) - 1 for row in rows]
    batch = make_batch(rows, pad_id=0)
    assert np.asarray(batch.loss_mask).sum(axis=1).tolist() == lengths
