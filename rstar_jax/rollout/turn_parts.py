"""A long turn generated as a sequence of bounded parts, so a KV-aware balancer reserves what a part can hold rather
than the whole budget (SPEC section 6).

An agent loop asks for each turn's max new tokens = the response budget left (thousands of tokens), while most
turns stop at a tool call long before. A balancer that reserves prompt + max new tokens for every request never
lets an engine overflow, but then leaves most of each engine's KV cache reserved and unused. Generating the turn
in parts of at most `part_tokens` tokens (each part continues the previous one's ids, on the same engine when the
balancer keeps its affinity, so the engine's prefix cache holds the context) bounds each reservation to the
context plus one part: still no overflow, and little reserved that is not used. The turn comes back whole: the
parts' ids and log-probs concatenated, ending with the part that sampled a stop token or reached max new tokens.
Part 0 samples with the turn's seed (a turn shorter than a part is sampled exactly as without parts); part k with
a seed derived from it, so random streams do not repeat across parts and a retried part samples the same.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from typing import Awaitable, Callable, Iterator, Sequence, overload

from rstar_jax.rollout.engine import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams

Generate = Callable[[Sequence[int], SamplingParams], Awaitable[Generation]]


class PositionalIds(Sequence[int]):
    """Token ids told by their position, without a list of them: a subclass gives `__len__` and `at(position)`;
    negative indices and slices work as on a list."""

    @abc.abstractmethod
    def at(self, position: int) -> int:
        """The id at `position`, 0 <= position < len(self)."""

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self.at(position) for position in range(*index.indices(len(self)))]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} ids")
        return self.at(position)


class ContinuedIds(PositionalIds):
    """Prompt ids followed by the pieces of a turn generated so far, without copying any of them."""

    def __init__(self, prompt_ids: Sequence[int], pieces: Sequence[Sequence[int]] = ()) -> None:
        self._parts = (prompt_ids, *pieces)
        self._length = sum(len(part) for part in self._parts)

    @property
    def continues(self) -> bool:
        """Whether these ids continue a turn already partly generated (a part after the first)."""
        return len(self._parts) > 1

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._parts)

    def at(self, position: int) -> int:
        """The id at `position`: in the prompt or in one of the pieces."""
        for part in self._parts:
            if position < len(part):
                return part[position]
            position -= len(part)
        raise IndexError(f"position {position} is past the ids")


def part_seed(seed: int | None, part: int) -> int | None:
    """The sampling seed of part `part` of a turn sampled with `seed` (part 0 keeps it; None stays None)."""
    if seed is None or part == 0:
        return seed
    return (seed * 1_000_003 + part * 7_919) % (1 << 63)


async def generate_in_parts(generate: Generate, prompt_ids: Sequence[int], sampling: SamplingParams,
                            part_tokens: int, block_size: int = 1) -> Generation:
    """One turn through `generate`, asking for `part_tokens` new tokens at a time (SPEC section 6), each part
    running on to the end of the KV block of `block_size` tokens it ends in, and one token into the next: a paged
    cache hands that block out whole, so the part fills what is reserved for it, and the next part's context ends
    one token into a block, so a prefix cache serves all of it but that token (vLLM computes a prompt's last token
    again, and a prompt that ends on a block boundary costs it its whole last block). With vLLM's CPU blocks of
    128, a part of 64 from a context of 300 asks for 85, to 385; the next for 128.

    A part that stops short of its max tokens with finish 'length' met the engine's own length limit: the turn
    ends there with 'length', as it would have without parts.
    """
    if part_tokens < 1 or block_size < 1:
        raise ValueError(f"part_tokens and block_size must be >= 1, got {part_tokens}, {block_size}")
    pieces: list[Generation] = []
    generated = 0
    while True:
        context = len(prompt_ids) + generated
        part_end = -(-(context + part_tokens - 1) // block_size) * block_size + 1
        asked = min(part_end - context, sampling.max_new_tokens - generated)
        piece = await generate(ContinuedIds(prompt_ids, [p.token_ids for p in pieces]),
                               dataclasses.replace(sampling, max_new_tokens=asked,
                                                   seed=part_seed(sampling.seed, len(pieces))))
        pieces.append(piece)
        generated += len(piece.token_ids)
        if piece.finish_reason == FINISH_STOP or generated >= sampling.max_new_tokens or len(piece.token_ids) < asked:
            return Generation(tuple(itertools.chain.from_iterable(p.token_ids for p in pieces)),
                              tuple(itertools.chain.from_iterable(p.logprobs for p in pieces)),
                              piece.finish_reason if piece.finish_reason == FINISH_STOP else FINISH_LENGTH)
