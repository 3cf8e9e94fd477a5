"""The SFT's drill batches (rstar_jax.train.sft_run.drill_batch): snippet drills pad to their longest row, filled
drills are exactly `length` predictions each, every token trained (or the assistant turns' only); number tokens
weighted in the loss."""

import numpy as np
import pytest

from rstar_jax.data.copy_drills import assistant_mask
from rstar_jax.data.synthetic import KINDS
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.train.batching import make_batch
from rstar_jax.train.sft_run import drill_batch, number_token_weights


def test_filled_drills_make_an_unpadded_batch_of_the_asked_length():
    tokenizer = load_tokenizer("tiny")
    batch = make_batch(drill_batch(3, 4, tokenizer, seed=0, snippets=3, length=256), pad_id=0)
    assert batch.shape == (4, 256)
    assert np.all(np.asarray(batch.attention_mask) == 1) and np.all(np.asarray(batch.loss_mask) == 1)
    # Trained on the assistant turns only, the same rows keep every input and lose the other turns' targets.
    rows = drill_batch(3, 4, tokenizer, seed=0, snippets=3, length=256, assistant_only=True)
    assert [row.token_ids for row in rows] == [row.token_ids for row in drill_batch(3, 4, tokenizer, 0, 3, 256)]
    assert [row.loss_mask for row in rows] == [assistant_mask(row.token_ids, tokenizer) for row in rows]
    assert 0.3 < np.mean(np.asarray(make_batch(rows, pad_id=0).loss_mask)) < 0.7


def test_snippet_drills_are_the_steps_own_drills_padded_to_the_longest():
    tokenizer = load_tokenizer("tiny")
    rows = drill_batch(3, 4, tokenizer, seed=0, snippets=3)
    assert rows == drill_batch(3, 4, tokenizer, seed=0, snippets=3) and rows != drill_batch(4, 4, tokenizer, 0, 3)
    lengths = [len(row.token_ids) - 1 for row in rows]
    batch = make_batch(rows, pad_id=0)
    assert np.asarray(batch.loss_mask).sum(axis=1).tolist() == lengths


def test_drill_kinds_choose_the_questions_and_a_kind_named_twice_comes_twice_as_often():
    tokenizer = load_tokenizer("tiny")

    def questions(kinds: tuple[str, ...]) -> list[str]:
        texts = [tokenizer.decode(list(row.token_ids))
                 for row in drill_batch(0, 64, tokenizer, seed=0, snippets=3, kinds=kinds)]
        return [line for text in texts for line in text.splitlines()
                if line.startswith(("Compute", "What is the remainder", "What is the sum", "How many times"))]

    assert questions(("multiply",)) and all(line.startswith("Compute") for line in questions(("multiply",)))
    drawn = questions(("multiply", "multiply", "digit_count"))
    products = sum(line.startswith("Compute") for line in drawn)
    assert {line.split()[0] for line in drawn} == {"Compute", "How"}
    assert 0.55 < products / len(drawn) < 0.78, (products, len(drawn))  # 2/3 expected, ~100 questions
    # The default is every kind once, the stream the demo was tuned on.
    assert drill_batch(0, 4, tokenizer, 0, 3) == drill_batch(0, 4, tokenizer, 0, 3, kinds=KINDS)
    with pytest.raises(ValueError, match="synthetic kinds among"):
        drill_batch(0, 1, tokenizer, 0, 3, kinds=("multiply", "long_division"))


def test_number_token_weights_weigh_exactly_the_tokens_that_spell_digits():
    tokenizer = load_tokenizer("tiny")
    weights = number_token_weights(tokenizer, 2048, 3.0)
    ids = tokenizer.encode("x = 1234 + 56; print(x)\nThe answer is 1290.", add_special_tokens=False)
    pieces = [tokenizer.decode([token]) for token in ids]
    assert [piece for piece, token in zip(pieces, ids) if weights[token] == 3.0] == ["123", "4", "56", "129", "0"]
    assert all(weights[token] == 1.0 for piece, token in zip(pieces, ids) if not piece.strip().isdigit())
    assert weights.shape == (2048,) and set(np.unique(weights)) == {1.0, 3.0}
    assert number_token_weights(tokenizer, 2048, 1.0) is None  # the plain loss
    with pytest.raises(ValueError, match="must be positive"):
        number_token_weights(tokenizer, 2048, 0.0)
