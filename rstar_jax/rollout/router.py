"""Fail-over across generation engines: one `GenerationEngine` over many (issue 5 item 5; DESIGN "One protocol
per boundary": the balancer is itself a GenerationEngine, so the agent loop never knows how many engines exist).

Each request (one whole assistant turn) goes to a live engine chosen by a pluggable routing policy (least requests
in flight by default). The KV-aware balancer of SPEC section 6 (`balancer.Balancer`) subclasses this engine and
replaces only the admission of an attempt (`_acquire` / `_release`: it may hold an attempt back until an engine has
room, and reserves KV there), not the fail-over loop. When the
chosen engine raises `EngineUnavailable`, it is marked down and the same request is sent to another live engine:
re-generating a turn from the same prompt ids is exactly right, because the caller appends a turn only once it
has come back whole. When no engine is left, `AllEnginesDown` (an `EngineUnavailable`) names every failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Sequence

import gin

from rstar_jax.rollout.engine import EngineCapacity, EngineUnavailable, Generation, GenerationEngine, SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What a routing policy sees of one live engine: its position in the router and requests it is serving."""

    index: int
    in_flight: int


RoutingPolicy = Callable[[Sequence[EngineLoad]], int]


@dataclasses.dataclass(frozen=True)
class Admission:
    """One attempt at a turn let through to engine `index`, with the KV tokens reserved there for it alone and
    the keys of the leading prefix blocks it holds with other requests there (SPEC 6; `prefix_blocks`)."""

    index: int
    reserved_tokens: int = 0
    prefix_keys: tuple[int, ...] = ()


@gin.register
def least_in_flight(loads: Sequence[EngineLoad]) -> int:
    """The index of the live engine with the fewest requests in flight (ties: the lowest index).

    Counts are taken before the await, so a burst of simultaneous requests spreads evenly over the engines.
    """
    return min(loads, key=lambda load: (load.in_flight, load.index)).index


class AllEnginesDown(EngineUnavailable):
    """Every engine of a `FailoverEngine` has failed; the message lists why each went down."""


@gin.configurable
class FailoverEngine:
    """Routes each turn to a live engine and retries it on another when that engine fails (a GenerationEngine).

    `policy` picks among live engines (see `least_in_flight`); an engine that raises EngineUnavailable for a
    generate, capacity or weight update is marked down for good. Other errors (e.g. ValueError for a prompt too
    long) are the caller's and propagate unchanged.
    """

    def __init__(self, engines: Sequence[GenerationEngine], policy: RoutingPolicy = least_in_flight) -> None:
        if not engines:
            raise ValueError("FailoverEngine needs at least one engine")
        self.engines = list(engines)
        self.policy = policy
        self._in_flight = [0] * len(self.engines)
        self._down: dict[int, str] = {}
        self.retries = 0

    @property
    def live(self) -> list[int]:
        """Indices of the engines not marked down."""
        return [index for index in range(len(self.engines)) if index not in self._down]

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Turns each engine is generating for this router right now (what `least_in_flight` routes on)."""
        return tuple(self._in_flight)

    @property
    def down(self) -> dict[int, str]:
        """Index -> the failure that took each engine down."""
        return dict(self._down)

    def _mark_down(self, index: int, error: Exception) -> None:
        if index not in self._down:
            self._down[index] = f"{type(error).__name__}: {error}"
            logger.warning("engine %d marked down (%s); %d live", index, self._down[index], len(self.live))

    def _all_down(self) -> AllEnginesDown:
        reasons = "; ".join(f"engine {index}: {reason}" for index, reason in sorted(self._down.items()))
        return AllEnginesDown(f"all {len(self.engines)} engines are down ({reasons})")

    def _choose(self) -> int:
        live = self.live
        if not live:
            raise self._all_down()
        chosen = self.policy([EngineLoad(index, self._in_flight[index]) for index in live])
        if chosen not in live:
            raise ValueError(f"routing policy chose engine {chosen!r}, which is not among the live engines {live}")
        return chosen

    async def _acquire(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Admission:
        """The engine that serves this attempt at the turn, counted in flight there (a subclass may make the
        attempt wait here, and reserve capacity for it)."""
        index = self._choose()
        self._in_flight[index] += 1
        return Admission(index)

    def _release(self, admission: Admission) -> None:
        """The attempt admitted by `_acquire` is over: it finished, failed or was cancelled."""
        self._in_flight[admission.index] -= 1

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Generate the turn on a live engine; on EngineUnavailable retry it on the next until none is left."""
        while True:
            admission = await self._acquire(prompt_ids, sampling)
            try:
                return await self.engines[admission.index].generate(prompt_ids, sampling)
            except EngineUnavailable as error:
                self._mark_down(admission.index, error)
                self.retries += 1
            finally:
                self._release(admission)

    async def capacity(self) -> EngineCapacity:
        """The live engines' capacities summed (engines that fail to answer are marked down and left out)."""
        indices = self.live
        answers = await asyncio.gather(*(self.engines[i].capacity() for i in indices), return_exceptions=True)
        total = EngineCapacity(0, 0, 0, 0, max_sequences=0)
        for index, answer in zip(indices, answers):
            if isinstance(answer, EngineUnavailable):
                self._mark_down(index, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                total = total + answer
        if not self.live:
            raise self._all_down()
        return total

    async def update_weights(self, params: Any, version: int) -> None:
        """Push `params` to every live engine concurrently; engines that fail are marked down."""
        indices = self.live
        results = await asyncio.gather(*(self.engines[i].update_weights(params, version) for i in indices),
                                       return_exceptions=True)
        for index, result in zip(indices, results):
            if isinstance(result, EngineUnavailable):
                self._mark_down(index, result)
            elif isinstance(result, BaseException):
                raise result
        if not self.live:
            raise self._all_down()
