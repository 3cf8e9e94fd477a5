"""The JAX engine's host-side bookkeeping: one request's progress and the table of decoding slots.

Plain Python and numpy, touched only by the engine's stepping thread (except `Request.deliver`, which hands a
result to the caller's event loop thread-safely). The slot table holds exactly the per-slot arrays a decode step
takes, so a step reads them without per-step Python loops over requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from rstar_jax.rollout.engine import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    """One `generate` call: its prompt, sampling, the tokens sampled so far, and where its result goes."""

    prompt_ids: np.ndarray  # [n] int32
    sampling: SamplingParams
    seed: np.ndarray  # [2] uint32, see sampling.seed_words
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)

    @property
    def sequence_length(self) -> int:
        """Prompt plus sampled tokens."""
        return len(self.prompt_ids) + len(self.token_ids)

    def record(self, token: int, logprob: float, max_len: int) -> str | None:
        """Append a sampled token; return why the turn ends now ('stop' / 'length'), or None to go on.

        A sampled stop token ends it ('stop', the token kept); so do max_new_tokens and a full cache ('length':
        prompt plus sampled tokens never exceed max_len).
        """
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.sampling.stop_token_ids:
            return FINISH_STOP
        if len(self.token_ids) >= self.sampling.max_new_tokens or self.sequence_length >= max_len:
            return FINISH_LENGTH
        return None

    def generation(self, finish_reason: str) -> Generation:
        """The finished turn."""
        return Generation(tuple(self.token_ids), tuple(self.logprobs), finish_reason)

    def deliver(self, outcome: Generation | BaseException) -> None:
        """Settle the caller's future from any thread; a caller that went away (cancelled, loop closed) is skipped."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, outcome)
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting
            pass


def _settle(future: asyncio.Future, outcome: Generation | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class SlotTable:
    """Which request occupies each KV-cache slot, and the decode step's per-slot inputs."""

    def __init__(self, slots: int) -> None:
        self.requests: list[Request | None] = [None] * slots
        self.pending_tokens = np.zeros(slots, np.int32)  # sampled, not yet in the cache
        self.active = np.zeros(slots, np.int32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_p = np.ones(slots, np.float32)
        self.seeds = np.zeros((slots, 2), np.uint32)

    def free_slot(self) -> int | None:
        """The lowest free slot, or None when all are busy."""
        return next((slot for slot, request in enumerate(self.requests) if request is None), None)

    def occupy(self, slot: int, request: Request, pending_token: int) -> None:
        """Put a prefilled request into `slot`, with the token it sampled at prefill waiting to be fed."""
        if self.requests[slot] is not None:
            raise RuntimeError(f"slot {slot} is already occupied")
        self.requests[slot] = request
        self.pending_tokens[slot] = pending_token
        self.active[slot] = 1
        self.temperature[slot] = request.sampling.temperature
        self.top_p[slot] = request.sampling.top_p
        self.seeds[slot] = request.seed

    def release(self, slot: int) -> None:
        """Free `slot`; the cache rows stay but are ignored until the next prefill overwrites them."""
        self.requests[slot] = None
        self.active[slot] = 0

    def occupied(self) -> list[tuple[int, Request]]:
        """(slot, request) of every busy slot."""
        return [(slot, request) for slot, request in enumerate(self.requests) if request is not None]

    @property
    def running(self) -> int:
        """Busy slots."""
        return int(self.active.sum())

    def live_tokens(self) -> int:
        """KV tokens the running requests hold: the sum of their sequence lengths."""
        return sum(request.sequence_length for request in self.requests if request is not None)


class PromptMemo:
    """Which slot's cache begins with a given prompt, and the logits after it: each prompt is prefilled once.

    A slot keeps a prompt's keys and values in its first len(prompt) positions until the next prefill or copy into
    it (decoding only appends, and a released slot is left as it was), so a later request with the same prompt can
    start from a copy of that slot. An entry holds for the weights it was computed with: `forget` drops them all.
    """

    def __init__(self, slots: int) -> None:
        self._slot_prompts: list[bytes | None] = [None] * slots
        self._entries: dict[bytes, tuple[int, Any]] = {}

    def lookup(self, prompt_ids: np.ndarray) -> tuple[int, Any] | None:
        """(slot holding the prompt, its logits), or None."""
        return self._entries.get(prompt_ids.tobytes())

    def record(self, slot: int, prompt_ids: np.ndarray, logits: Any) -> None:
        """`slot` now begins with `prompt_ids`, followed by `logits`; whatever it held before is gone."""
        previous = self._slot_prompts[slot]
        if previous is not None and self._entries[previous][0] == slot:
            others = [other for other, key in enumerate(self._slot_prompts) if key == previous and other != slot]
            if others:
                self._entries[previous] = (others[0], self._entries[previous][1])
            else:
                del self._entries[previous]
        key = prompt_ids.tobytes()
        self._slot_prompts[slot] = key
        self._entries.setdefault(key, (slot, logits))

    def forget(self) -> None:
        """New weights: no cached prompt is valid any more."""
        self._slot_prompts = [None] * len(self._slot_prompts)
        self._entries.clear()
