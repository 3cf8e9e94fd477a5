"""Teacher-forced copy accuracy: how often a model writes a number it has already seen exactly right.

The tiny demo model learns the agent format long before it learns to copy numbers (a question's numbers into its
program, a program's output into its answer), and a wrong copy loses the whole trajectory (SPEC section 5's format
SFT, issue 24). These functions find the copied number tokens of chat-layout texts and score a model's argmax and
probability on them; the format SFT's copy gate (`rstar_jax.train.copy_gate`) and the copy probe
(`experiments/bench/copy_probe.py`) both use them.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rstar_jax.model import ModelConfig, forward, positions_from_mask
from rstar_jax.tokenizers.special_tokens import IM_START
from rstar_jax.train.batching import make_batch
from rstar_jax.train.sft_data import TrainingSequence

COPY_KINDS = ("first_call", "retry", "answer")


def copied_positions(tokenizer: Any, text: str) -> tuple[list[int], list[str | None]]:
    """Token ids of a chat-layout text (drills or transcripts) and, per id, the kind of copy it is part of, for
    numbers an assistant turn writes that appeared earlier in the text: "first_call" inside a tool call of a turn
    answering a question (the question's numbers into its program), "retry" inside a tool call of a turn answering a
    tool response (a failed program's numbers into its fix), "answer" anywhere else (an output into the answer);
    None for a token that is no copy."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([token]) for token in ids]
    kinds: list[str | None] = []
    seen, offset = set(), 0
    for piece in pieces:
        start = text.index(piece, offset) if piece else offset
        offset = start + len(piece)
        number = _number_at(text, start) if piece.strip().isdigit() else None
        kinds.append(_copy_kind(text, start) if number is not None and number in seen else None)
        if number is not None:
            seen.add(number)
    return ids, kinds


def _copy_kind(text: str, start: int) -> str | None:
    """The COPY_KINDS entry of a repeated number at `start`, or None outside an assistant turn."""
    turn = text.rfind(IM_START, 0, start)
    if not text.startswith(f"{IM_START}assistant", turn):
        return None
    if text.count("<tool_call>", turn, start) <= text.count("</tool_call>", turn, start):
        return "answer"
    previous = text.rfind(f"{IM_START}user\n", 0, turn)
    return "retry" if text.startswith("<tool_response>", previous + len(f"{IM_START}user\n")) else "first_call"


def _number_at(text: str, index: int) -> str:
    """The whole number (its digits) that the digit at `index` belongs to."""
    start = index
    while start > 0 and text[start - 1].isdigit():
        start -= 1
    end = index
    while end < len(text) and text[end].isdigit():
        end += 1
    return text[start:end]


def held_out_copies(tokenizer: Any, texts: Sequence[str]) -> tuple[Any, np.ndarray, np.ndarray]:
    """One batch of `texts` and, aligned with its targets, each target's copy kind (None: no copy) and its digit
    count (a number token is a chunk of 1-3 digits; 0 for any other token)."""
    held_out = [copied_positions(tokenizer, text) for text in texts]
    batch = make_batch([TrainingSequence(tuple(ids), (1,) * len(ids)) for ids, _ in held_out])
    kinds = np.full(batch.shape, None, object)
    digits = np.zeros(batch.shape, np.int32)
    for row, (ids, copied) in enumerate(held_out):
        kinds[row, :len(copied) - 1] = copied[1:]
        digits[row, :len(ids) - 1] = [len(piece) if piece.isdigit() else 0
                                      for piece in (tokenizer.decode([token]) for token in ids[1:])]
    return batch, kinds, digits


def copy_accuracy(params: Any, config: ModelConfig, batch: Any, kinds: np.ndarray,
                  digits: np.ndarray) -> dict[str, Any]:
    """Teacher-forced: the share of copied tokens predicted exactly (argmax), over all, over the tokens of 2 or 3
    digits ("multi_digit"), by COPY_KINDS and by the copied token's digits; and by digits the mean probability of the
    right token (what sampling at T=1 sees)."""
    mask = jnp.asarray(batch.attention_mask)
    logits = forward(params, config, jnp.asarray(batch.input_ids), positions_from_mask(mask), mask)
    targets = np.asarray(batch.targets)
    right = np.asarray(jnp.argmax(logits, -1)) == targets
    probability = np.exp(np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), targets[..., None], -1)[..., 0])
    copied = kinds != None  # noqa: E711 (elementwise)
    by_digits = {count: copied & (digits == count) for count in (1, 2, 3) if (copied & (digits == count)).any()}
    multi = copied & (digits >= 2)
    return {"copy_accuracy": float(right[copied].mean()),
            "multi_digit": float(right[multi].mean()) if multi.any() else float("nan"),
            "by_kind": {kind: float(right[kinds == kind].mean()) for kind in COPY_KINDS if (kinds == kind).any()},
            "copies": {kind: int((kinds == kind).sum()) for kind in COPY_KINDS},
            "by_digits": {str(count): float(right[where].mean()) for count, where in by_digits.items()},
            "probability_by_digits": {str(count): float(probability[where].mean())
                                      for count, where in by_digits.items()},
            "copies_by_digits": {str(count): int(where.sum()) for count, where in by_digits.items()}}


def shown(figures: dict[str, Any]) -> str:
    """`copy_accuracy`'s figures on one line."""
    return (f"copy accuracy {figures['copy_accuracy']:.3f} "
            + " ".join(f"{kind} {value:.3f}" for kind, value in figures["by_kind"].items())
            + "; by digits " + " ".join(f"{count}: {value:.3f} (p {figures['probability_by_digits'][count]:.3f})"
                                        for count, value in figures["by_digits"].items()))
