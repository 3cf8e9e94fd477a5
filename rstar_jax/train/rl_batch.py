"""Kept rollouts -> the RL learner's micro-batches (SPEC section 4, step 6; DESIGN "Functional learner").

Each kept trajectory becomes next-token inputs and targets as in SFT (`make_batch`), its advantage on each of its
tokens, and the rollout engine's log-prob of every target token (0 where the engine did not sample it: prompt, tool
responses). Rows are sorted by length and cut into micro-batches of a fixed row count, each padded to its own
bucketed length, so short trajectories are not padded to the longest of the batch and the jitted step sees few
distinct shapes. With a pack length, several trajectories share a row instead (first fit, longest first): the
row's attention mask holds each one's segment id (1, 2, ...), so attention never crosses a trajectory and RoPE
positions restart at each (`model.segments`); the loss is the same sum over the same tokens, on fewer positions
(at the demo's lengths 79-89% of them are tokens instead of 64-70%). The last micro-batch is filled up with empty
rows (loss mask 0) so every micro-batch has the same row count.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import flax.struct
import jax
import numpy as np

from rstar_jax.train.batching import TokenBatch, TokenSequence, bucket_length, make_batch


class RolloutSequence(TokenSequence, Protocol):
    """A `TokenSequence` with the engine's log-prob of each token (a `Trajectory`)."""

    rollout_logprobs: Sequence[float]


@flax.struct.dataclass
class RLBatch:
    """One micro-batch: `tokens` (arrays [B, T]; the attention mask holds segment ids when rows are packed),
    `advantages` [B, T] float32 (each token's sequence's), `rollout_logprobs` [B, T] float32 (the
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


def _segment_arrays(sequence: RolloutSequence, advantage: float) -> list[np.ndarray]:
    """One trajectory's unpadded [n - 1] arrays: inputs, targets, loss mask, rollout log-probs of the targets, and
    its advantage on every token (its attention mask is its segment number in the row, set by `_rows`)."""
    tokens = make_batch([sequence], multiple=1)
    length = len(sequence.token_ids) - 1
    logprobs = np.asarray(sequence.rollout_logprobs, np.float32)[1:]
    return [tokens.input_ids[0, :length], tokens.targets[0, :length], tokens.loss_mask[0, :length], logprobs,
            np.full(length, advantage, np.float32)]


def _rows(rows_of_segments: Sequence[Sequence[list[np.ndarray]]], rows: int, length: int, pad_id: int) -> RLBatch:
    """A micro-batch of `rows` rows of `length` positions from each row's segments (their `_segment_arrays`), laid
    one after another; segment k of a row gets attention-mask value k (1 when a row holds one trajectory)."""
    input_ids, targets = np.full((rows, length), pad_id, np.int32), np.full((rows, length), pad_id, np.int32)
    attention_mask, loss_mask = np.zeros((rows, length), np.int32), np.zeros((rows, length), np.int32)
    logprobs, advantages = np.zeros((rows, length), np.float32), np.zeros((rows, length), np.float32)
    for row, segments in enumerate(rows_of_segments):
        start = 0
        for number, (ids, target, mask, logprob, advantage) in enumerate(segments, start=1):
            end = start + len(ids)
            input_ids[row, start:end], targets[row, start:end] = ids, target
            attention_mask[row, start:end], loss_mask[row, start:end] = number, mask
            logprobs[row, start:end], advantages[row, start:end] = logprob, advantage
            start = end
    attention_mask[len(rows_of_segments):, 0] = 1  # an empty row reads one pad token: no attention row fully masked
    zeros = np.zeros((rows, length), np.float32)
    return RLBatch(TokenBatch(input_ids, targets, attention_mask, loss_mask), advantages, logprobs, zeros,
                   zeros.copy())


def _first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` (sorted longest first) packed into bins of `capacity`: each goes into the first bin it
    fits (first-fit decreasing, within 22% of the fewest bins)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        target = next((b for b, free in enumerate(room) if free >= length), None)
        if target is None:
            bins.append([])
            room.append(capacity)
            target = len(bins) - 1
        bins[target].append(index)
        room[target] -= length
    return bins


def rl_micro_batches(sequences: Sequence[RolloutSequence], advantages: Sequence[float], rows: int,
                     pad_id: int = 0, multiple: int | None = None, pack_length: int | None = None) -> list[RLBatch]:
    """The micro-batches of `rows` rows each that hold `sequences` (longest first) with their `advantages`.

    Without `pack_length` each sequence is a row, and each micro-batch is padded to `bucket_length(longest,
    multiple)` (`RLSettings.pad_multiple`: one multiple bounds the compiled shapes). With it, sequences share rows
    of `bucket_length(max(pack_length, longest), multiple)` positions (`RLSettings.pack_length`), one shape for
    every micro-batch. Every sequence appears exactly once; neither the rows' order nor the packing changes the
    loss (a sum over tokens, each attending only within its own sequence).
    """
    if rows < 1:
        raise ValueError(f"micro-batch rows must be >= 1, got {rows}")
    if pack_length is not None and pack_length < 2:
        raise ValueError(f"a pack length must hold a trajectory of 2 tokens or more, got {pack_length}")
    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences but {len(advantages)} advantages")
    if not sequences:
        raise ValueError("rl_micro_batches needs at least one sequence")
    for index, sequence in enumerate(sequences):
        if len(sequence.rollout_logprobs) != len(sequence.token_ids):
            raise ValueError(f"sequence {index} has {len(sequence.token_ids)} ids but "
                             f"{len(sequence.rollout_logprobs)} rollout logprobs")
    order = sorted(range(len(sequences)), key=lambda index: -len(sequences[index].token_ids))
    segments = [_segment_arrays(sequences[i], float(advantages[i])) for i in order]
    lengths = [len(arrays[0]) for arrays in segments]
    if pack_length is None:
        row_segments = [[arrays] for arrays in segments]
        return [_rows(row_segments[start:start + rows], rows, bucket_length(lengths[start], multiple), pad_id)
                for start in range(0, len(row_segments), rows)]
    length = bucket_length(max(pack_length, lengths[0]), multiple)
    row_segments = [[segments[i] for i in members] for members in _first_fit(lengths, length)]
    return [_rows(row_segments[start:start + rows], rows, length, pad_id)
            for start in range(0, len(row_segments), rows)]


def batch_totals(micro_batches: Sequence[RLBatch]) -> tuple[float, float]:
    """(trained tokens, sequences with at least one trained token) over all `micro_batches`: the normalisers of
    the whole batch's loss (`rstar_jax.rl.loss_weights`). A packed row's sequences are its segments."""
    tokens = sequences = 0
    for batch in micro_batches:
        mask = np.asarray(batch.loss_mask)
        segments = np.asarray(batch.tokens.attention_mask)
        tokens += int(mask.sum())
        sequences += sum(len(np.unique(row[trained > 0])) for row, trained in zip(segments, mask))
    return float(tokens), float(sequences)


def logprob_gap(micro_batches: Sequence[RLBatch]) -> float:
    """Mean |rollout log-prob - learner log-prob| over the trained tokens: how far the engines' sampling policy is
    from the learner's view of the same weights (near 0 when weight sync and numerics agree; SPEC 4.6's ratio
    assumes it is)."""
    total = sum(float(np.sum(np.abs(np.asarray(b.rollout_logprobs) - np.asarray(b.old_logprobs)) * np.asarray(
        b.loss_mask))) for b in micro_batches)
    return total / max(batch_totals(micro_batches)[0], 1.0)
