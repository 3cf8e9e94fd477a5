"""The JAX engine's host-side bookkeeping: one request's progress, the table of decoding slots, and what each cache
row holds for later requests to start from.

Plain Python and numpy, touched only by the engine's stepping thread (except `Request.deliver`, which hands a
result to the caller's event loop thread-safely). The slot table holds exactly the per-slot arrays a decode step
takes, so a step reads them without per-step Python loops over requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Sequence

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


@dataclasses.dataclass(frozen=True)
class Start:
    """How a request starts (`CacheMemo.plan`): kind 'copy' (the whole prompt and the logits after it from row
    `source`), 'extend' (its first `shared` tokens from row `source`, the rest prefilled) or 'prefill'; `in_place`:
    `source` is a free slot whose tokens all begin the prompt, so the request can start in it and lose nothing."""

    kind: str
    source: int | None = None
    shared: int = 0
    in_place: bool = False


class CacheMemo:
    """What each cache row holds: the tokens whose keys and values are in its first positions, the logits after its
    prompt, and when it was last used; what a new request can start from instead of a prefill (one mechanism for
    the 2G rollouts of a GRPO group and for the turns of one trajectory).

    Rows 0..slots-1 are the decoding cache's slots, rows slots..slots+park_rows-1 the park store's. A slot keeps its
    tokens until the next prefill, copy or extension into it: decoding only appends, and a released slot is left as
    it was, so when a turn ends its slot still holds prompt + sampled tokens (but the last, never fed back) and the
    trajectory's next turn, whose prompt extends exactly those tokens, needs only its new tokens prefilled. An entry
    holds for the weights it was computed with: `forget` drops them all. The engine keeps the numpy arrays and the
    device logits; this class only decides (pure bookkeeping, unit-tested without a model).
    """

    def __init__(self, slots: int, park_rows: int = 0) -> None:
        self.slots, self.park_rows = slots, park_rows
        rows = slots + park_rows
        self._tokens: list[np.ndarray | None] = [None] * rows
        self._logits: list[tuple[int, Any] | None] = [None] * rows  # (prompt length, logits after it)
        self._used = [0] * rows
        self._clock = 0

    @property
    def park(self) -> range:
        """Row numbers of the park store."""
        return range(self.slots, self.slots + self.park_rows)

    def tokens(self, row: int) -> np.ndarray | None:
        """The tokens `row` holds (its cache's first len(...) positions), or None."""
        return self._tokens[row]

    def logits(self, row: int) -> Any:
        """The logits after the prompt `row` holds (the whole prompt a 'copy' takes), or None."""
        entry = self._logits[row]
        return None if entry is None else entry[1]

    def hold(self, row: int, tokens: np.ndarray, logits: Any = None) -> None:
        """`row` now holds `tokens` (and, given, the logits after all of them); whatever it held before is gone."""
        self._tokens[row] = tokens
        self._logits[row] = None if logits is None else (len(tokens), logits)
        self.touch(row)

    def grow(self, row: int, tokens: np.ndarray) -> None:
        """A turn ended in slot `row`: it holds `tokens`, which extend what it held (its prompt). Nothing if the row
        was forgotten meanwhile (new weights during the turn: its cache mixes two weight versions)."""
        held = self._tokens[row]
        if held is None:
            return
        if len(tokens) < len(held) or not np.array_equal(tokens[:len(held)], held):
            raise RuntimeError(f"row {row}: the finished turn does not extend the prompt the row holds")
        self._tokens[row] = tokens
        self.touch(row)

    def move(self, source: int, row: int) -> None:
        """`row` now holds a copy of `source`'s entry (the engine copied the cache row)."""
        self._tokens[row], self._logits[row] = self._tokens[source], self._logits[source]
        self.touch(row)

    def drop(self, row: int) -> None:
        """`row` holds nothing reusable any more."""
        self._tokens[row] = self._logits[row] = None

    def touch(self, row: int) -> None:
        """`row` was just used: the last to be evicted."""
        self._clock += 1
        self._used[row] = self._clock

    def forget(self) -> None:
        """New weights: no cached row is valid any more."""
        for row in range(len(self._tokens)):
            self.drop(row)

    def plan(self, prompt: np.ndarray, free: Sequence[int], busy: Sequence[int],
             worth_extending: Callable[[int], bool] | None = None) -> Start:
        """How a request with `prompt` starts, given the free and the busy (decoding) slots.

        'copy' when a row begins with the whole prompt and kept the logits after it; else, if `worth_extending`
        (given the shared tokens, whether prefilling only the rest beats a full prefill), 'extend' from the row
        that shares the longest prefix (at most len(prompt) - 1 tokens: the last is prefilled for its logits);
        else 'prefill'. Ties go to a free slot the request can start in without losing anything (its tokens all
        begin the prompt), then to any slot (no copy out of the park store), then to the earliest row.
        """
        n = len(prompt)
        order = [*free, *busy, *self.park]
        free_rows = set(free)

        def in_place(row: int, shared: int) -> bool:
            return row in free_rows and len(self._tokens[row]) == shared

        exact = [row for row in order if self._begins_with(row, prompt)]
        if exact:
            row = next((row for row in exact if in_place(row, n)), exact[0])
            return Start("copy", row, n, in_place(row, n))
        if worth_extending is None:
            return Start("prefill")
        best: tuple[tuple[int, bool, bool], Start] | None = None
        for row in order:
            held = self._tokens[row]
            if held is None:
                continue
            common = common_prefix(prompt, held)
            shared = min(common, n - 1)
            if shared < 1:
                continue
            start = Start("extend", row, shared, in_place(row, common))
            key = (shared, start.in_place, row < self.slots)
            if best is None or key > best[0]:
                best = (key, start)
        if best is not None and worth_extending(best[1].shared):
            return best[1]
        return Start("prefill")

    def _begins_with(self, row: int, prompt: np.ndarray) -> bool:
        entry, held = self._logits[row], self._tokens[row]
        return entry is not None and entry[0] == len(prompt) and np.array_equal(held[:len(prompt)], prompt)

    def victim(self, rows: Sequence[int]) -> int:
        """The row of `rows` to overwrite: one that holds nothing (the first), else the least recently used."""
        empty = [row for row in rows if self._tokens[row] is None]
        return empty[0] if empty else min(rows, key=self._used.__getitem__)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))
