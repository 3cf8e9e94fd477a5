"""Kept rollouts -> the RL learner's micro-batches (SPEC section 4, step 6; DESIGN "Functional learner").

Each kept trajectory becomes one row: next-token inputs and targets as in SFT (`make_batch`), its advantage, and the
rollout engine's log-prob of every target token (0 where the engine did not sample it: prompt, tool responses).
Rows are sorted by length and cut into micro-batches of a fixed row count, each padded to its own bucketed length,
so short trajectories are not padded to the longest of the batch and the jitted step sees few distinct shapes. The
last micro-batch is filled up with empty rows (loss mask 0) so every micro-batch has the same row count.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import flax.struct
import jax
import numpy as np

from rstar_jax.train.batching import TokenBatch, TokenSequence, make_batch


class RolloutSequence(TokenSequence, Protocol):
    """A `TokenSequence` with the engine's log-prob of each token (a `Trajectory`)."""

    rollout_logprobs: Sequence[float]


@flax.struct.dataclass
class RLBatch:
    """One micro-batch: `tokens` (arrays [B, T]), `advantages` [B] float32, `rollout_logprobs` [B, T] float32 (the
    sampling engine's log p of each target), `old_logprobs` [B, T] float32 (the learner's own log p of each target
    under the parameters the rollouts were sampled with) and `ref_logprobs` [B, T] float32 (the reference policy's,
    for a KL term); the last two are zeros until the learner fills them in."""

    tokens: TokenBatch
    advantages: jax.Array | np.ndarray
    rollout_logprobs: jax.Array | np.ndarray
    old_logprobs: jax.Array | np.ndarray
    ref_logprobs: jax.Array | np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, padded length)."""
        return self.tokens.shape

    @property
    def loss_mask(self) -> jax.Array | np.ndarray:
        """1 on the targets the policy loss trains on."""
        return self.tokens.loss_mask


def _rows(sequences: Sequence[RolloutSequence], advantages: np.ndarray, rows: int, pad_id: int,
          multiple: int | None) -> RLBatch:
    tokens = make_batch(sequences, pad_id, multiple)
    real, length = tokens.shape
    logprobs = np.zeros((rows, length), np.float32)
    for row, sequence in enumerate(sequences):
        values = np.asarray(sequence.rollout_logprobs, np.float32)[1:]
        logprobs[row, :len(values)] = values
    padded = [np.concatenate([array, np.zeros((rows - real, length), array.dtype)])
              for array in (tokens.input_ids, tokens.targets, tokens.attention_mask, tokens.loss_mask)]
    padded[2][real:, 0] = 1  # an empty row reads one pad token, so no attention row is entirely masked
    advantages_column = np.zeros(rows, np.float32)
    advantages_column[:real] = advantages
    zeros = np.zeros((rows, length), np.float32)
    return RLBatch(TokenBatch(*padded), advantages_column, logprobs, zeros, zeros.copy())


def rl_micro_batches(sequences: Sequence[RolloutSequence], advantages: Sequence[float], rows: int,
                     pad_id: int = 0, multiple: int | None = None) -> list[RLBatch]:
    """The micro-batches of `rows` rows each that hold `sequences` (longest first) with their `advantages`, each
    padded to `bucket_length(longest, multiple)` (`RLSettings.pad_multiple`: one multiple bounds the compiled shapes).

    Every sequence appears exactly once; the rows' order within the batch does not change the loss (it is a sum).
    """
    if rows < 1:
        raise ValueError(f"micro-batch rows must be >= 1, got {rows}")
    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences but {len(advantages)} advantages")
    if not sequences:
        raise ValueError("rl_micro_batches needs at least one sequence")
    for index, sequence in enumerate(sequences):
        if len(sequence.rollout_logprobs) != len(sequence.token_ids):
            raise ValueError(f"sequence {index} has {len(sequence.token_ids)} ids but "
                             f"{len(sequence.rollout_logprobs)} rollout logprobs")
    order = sorted(range(len(sequences)), key=lambda index: -len(sequences[index].token_ids))
    advantages = np.asarray(advantages, np.float32)
    return [_rows([sequences[i] for i in order[start:start + rows]], advantages[order[start:start + rows]], rows,
                  pad_id, multiple) for start in range(0, len(order), rows)]


def batch_totals(micro_batches: Sequence[RLBatch]) -> tuple[float, float]:
    """(trained tokens, sequences with at least one trained token) over all `micro_batches`: the normalisers of
    the whole batch's loss (`rstar_jax.rl.loss_weights`)."""
    masks = [np.asarray(batch.loss_mask) for batch in micro_batches]
    return (float(sum(mask.sum() for mask in masks)),
            float(sum((mask.sum(axis=1) > 0).sum() for mask in masks)))


def logprob_gap(micro_batches: Sequence[RLBatch]) -> float:
    """Mean |rollout log-prob - learner log-prob| over the trained tokens: how far the engines' sampling policy is
    from the learner's view of the same weights (near 0 when weight sync and numerics agree; SPEC 4.6's ratio
    assumes it is)."""
    total = sum(float(np.sum(np.abs(np.asarray(b.rollout_logprobs) - np.asarray(b.old_logprobs)) * np.asarray(
        b.loss_mask))) for b in micro_batches)
    return total / max(batch_totals(micro_batches)[0], 1.0)
