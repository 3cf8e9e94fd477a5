"""Trajectories -> padded, length-bucketed [B, T] training arrays (DESIGN "Functional learner": bounded shapes).

A trajectory of n tokens becomes n - 1 next-token predictions: inputs are tokens 0..n-2, targets tokens 1..n-1,
and the loss mask moves with the targets (a target is trained when the trajectory's mask marks *that* token as
the model's own, SPEC section 2: tool-response tokens never are). Rows are right-padded to a bucketed length, so
the jitted step sees only a few distinct shapes however lengths vary.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import flax.struct
import jax
import numpy as np


class TokenSequence(Protocol):
    """Anything with token ids and a same-length 0/1 loss mask (a `Trajectory`, an SFT transcript's trajectory)."""

    token_ids: Sequence[int]
    loss_mask: Sequence[int]


@flax.struct.dataclass
class TokenBatch:
    """One padded batch, every array [B, T] int32: model inputs, their next-token targets, the attention mask
    (1 on real input tokens) and the loss mask aligned to the targets (0 on padding)."""

    input_ids: jax.Array | np.ndarray
    targets: jax.Array | np.ndarray
    attention_mask: jax.Array | np.ndarray
    loss_mask: jax.Array | np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, padded length)."""
        return tuple(self.input_ids.shape)


def bucket_length(length: int, multiple: int | None = None, minimum: int = 16) -> int:
    """The padded length for a batch whose longest row has `length` tokens.

    With `multiple` None: the next power of two (at least `minimum`); otherwise the next multiple of `multiple`.
    Either way the number of compiled shapes stays small (log2 of the range, or range / multiple).
    """
    if length < 1:
        raise ValueError(f"bucket_length needs a positive length, got {length}")
    if multiple is not None:
        if multiple < 1:
            raise ValueError(f"bucket multiple must be a positive integer, got {multiple}")
        return -(-length // multiple) * multiple
    if minimum < 1:
        raise ValueError(f"bucket minimum must be a positive integer, got {minimum}")
    return max(minimum, 1 << (length - 1).bit_length())


def make_batch(sequences: Sequence[TokenSequence], pad_id: int = 0, multiple: int | None = None) -> TokenBatch:
    """Shifted, right-padded numpy arrays of `sequences`, padded to `bucket_length` of the longest row (to a
    multiple of `multiple`, else the next power of two).

    Errors name the offending row: ids and mask of different lengths, fewer than 2 tokens, a mask value other
    than 0/1.
    """
    if not sequences:
        raise ValueError("make_batch needs at least one sequence")
    for row, sequence in enumerate(sequences):
        ids, mask = sequence.token_ids, sequence.loss_mask
        if len(ids) != len(mask):
            raise ValueError(f"sequence {row} has {len(ids)} token ids but a loss mask of {len(mask)}")
        if len(ids) < 2:
            raise ValueError(f"sequence {row} has {len(ids)} token(s); a training example needs at least 2")
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"sequence {row} has loss mask values other than 0 and 1")
    length = bucket_length(max(len(s.token_ids) for s in sequences) - 1, multiple)
    shape = (len(sequences), length)
    input_ids, targets = np.full(shape, pad_id, np.int32), np.full(shape, pad_id, np.int32)
    attention_mask, loss_mask = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    for row, sequence in enumerate(sequences):
        ids, mask = np.asarray(sequence.token_ids, np.int32), np.asarray(sequence.loss_mask, np.int32)
        n = len(ids) - 1
        input_ids[row, :n], targets[row, :n] = ids[:-1], ids[1:]
        attention_mask[row, :n], loss_mask[row, :n] = 1, mask[1:]
    return TokenBatch(input_ids, targets, attention_mask, loss_mask)


def batch_indices(step: int, num_examples: int, batch_size: int, seed: int) -> np.ndarray:
    """Which examples make up the batch of `step`: epochs of seeded shuffles, a pure function of the step.

    Because it depends on nothing but its arguments, a run resumed from a checkpoint at step k sees exactly the
    batches an uninterrupted run sees from step k on. Batches may straddle two epochs.
    """
    if num_examples < 1 or batch_size < 1 or step < 0:
        raise ValueError(f"batch_indices needs num_examples >= 1, batch_size >= 1 and step >= 0, "
                         f"got {num_examples}, {batch_size}, {step}")
    start = step * batch_size
    positions = np.arange(start, start + batch_size)
    epochs = positions // num_examples
    orders = {int(epoch): np.random.default_rng([seed, int(epoch)]).permutation(num_examples)
              for epoch in np.unique(epochs)}
    return np.array([orders[int(epoch)][position % num_examples] for epoch, position in zip(epochs, positions)])
