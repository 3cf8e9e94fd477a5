"""Live capacity of each engine for the rollout balancer (SPEC section 6): rate-limited scrapes, corrected by the
balancer's own accounting.

An engine's `capacity()` (vLLM: its /metrics gauges; the JAX engine: its slots) is read in the background, at most
once per `interval_s` per engine, so routing never waits for a scrape except an engine's very first. Between
scrapes a reading goes stale; the balancer does not trust its usage figure but its own, always current, record of
what it has reserved on the engine, and counts against the engine only the KV the reading showed in use beyond the
balancer's reservations at the time (another client's requests). Times are the event loop's, so a simulated fleet
in virtual time is read at the same rate as a real one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Sequence

from rstar_jax.rollout.engine import EngineCapacity, EngineUnavailable, GenerationEngine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Reading:
    """One capacity reading, with what the balancer had reserved on the engine when the scrape was sent."""

    capacity: EngineCapacity
    reserved_at_read: int
    at: float

    @property
    def foreign_tokens(self) -> int:
        """KV tokens in use beyond the balancer's reservations when read (another client's requests)."""
        return max(0, self.capacity.kv_tokens_used - self.reserved_at_read)

    def free_tokens(self, reserved_now: int) -> int:
        """KV tokens free for new reservations: the cache less what the balancer reserves now and foreign use."""
        return self.capacity.kv_tokens_total - reserved_now - self.foreign_tokens


class CapacityReadings:
    """The latest `Reading` of each engine, refreshed in the background at most once per `interval_s` each.

    `reserved(i)` gives the balancer's reservation on engine i now; `on_down(i, error)` is called when engine i
    raises EngineUnavailable; `on_reading(i)` after every new reading of engine i (the balancer may now have room
    for queued turns).
    """

    def __init__(self, engines: Sequence[GenerationEngine], interval_s: float, reserved: Callable[[int], int],
                 on_down: Callable[[int, EngineUnavailable], None], on_reading: Callable[[int], None]) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.engines, self.interval_s = list(engines), interval_s
        self._reserved, self._on_down, self._on_reading = reserved, on_down, on_reading
        self._latest: list[Reading | None] = [None] * len(self.engines)
        self._sent_at = [float("-inf")] * len(self.engines)
        self._next_due = float("-inf")  # no engine's reading is stale before then
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._first_reads: asyncio.Task[None] | None = None  # shared by every caller of `ensure` meanwhile
        self.scrapes = 0

    def latest(self, index: int) -> Reading | None:
        """Engine `index`'s latest reading (None before its first)."""
        return self._latest[index]

    def refresh_stale(self, indices: Sequence[int]) -> None:
        """Scrape in the background each engine of `indices` whose last scrape was sent `interval_s` ago or more."""
        now = asyncio.get_running_loop().time()
        if now < self._next_due or not indices:
            return
        for index in indices:
            if now - self._sent_at[index] >= self.interval_s:
                self._task(index)
        self._next_due = min(self._sent_at[index] for index in indices) + self.interval_s

    async def ensure(self, indices: Sequence[int]) -> None:
        """Wait until every engine of `indices` has a reading, scraping those that have none (SPEC section 6).

        An engine that raises EngineUnavailable is reported through `on_down`; any other error propagates.
        """
        missing = [index for index in indices if self._latest[index] is None]
        if not missing:
            return
        loop = asyncio.get_running_loop()
        reads = self._first_reads
        if reads is None or reads.done() or reads.get_loop() is not loop:
            reads = self._first_reads = loop.create_task(self._read(missing))
        await asyncio.shield(reads)  # a caller that goes away does not stop the reads the others wait for

    async def _read(self, indices: Sequence[int]) -> None:
        await asyncio.gather(*(self._task(index) for index in indices))

    def _task(self, index: int) -> asyncio.Task[None]:
        """The scrape of engine `index` under way in this event loop, or a new one."""
        loop = asyncio.get_running_loop()
        task = self._pending.get(index)
        if task is None or task.done() or task.get_loop() is not loop:
            self._sent_at[index] = loop.time()
            task = loop.create_task(self._scrape(index))
            task.add_done_callback(_log_failure)
            self._pending[index] = task
        return task

    async def _scrape(self, index: int) -> None:
        sent_at = asyncio.get_running_loop().time()
        reserved = self._reserved(index)
        self.scrapes += 1
        try:
            capacity = await self.engines[index].capacity()
        except EngineUnavailable as error:
            self._on_down(index, error)
            return
        self._latest[index] = Reading(capacity, reserved, sent_at)
        self._on_reading(index)


def _log_failure(task: asyncio.Task[None]) -> None:
    """A background scrape that failed other than by EngineUnavailable: say so (the old reading stays in use)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("capacity scrape failed: %r", task.exception())
