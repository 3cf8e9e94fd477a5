"""Virtual time for the fleet simulator (SPEC section 6): an asyncio event loop whose clock jumps to the next timer.

Everything the simulator runs (the real balancer, simulated engines, trajectories waiting on tool calls) is
ordinary asyncio code using `loop.time()`, `loop.call_at` and `asyncio.sleep`. This loop never waits: when no
callback is ready it moves its clock to the earliest timer, so an hour of simulated rollout costs only the CPU
time of its events, and the run is deterministic.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class _Clock:
    """The loop's virtual time in seconds."""

    def __init__(self) -> None:
        self.now = 0.0


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that polls its file descriptors without blocking and advances the clock by the loop's timeout."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("the simulation stalled: nothing is scheduled and every task waits (a lost wake-up)")
        self._clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop in virtual time (see the module docstring)."""

    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(selector=_JumpingSelector(self._clock))

    def time(self) -> float:
        """The virtual time in seconds since the loop was made."""
        return self._clock.now


def run_in_virtual_time(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to completion on a fresh `VirtualTimeLoop` (SPEC section 6: the fleet simulator)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        leftover = asyncio.all_tasks(loop)  # e.g. a capacity scrape still under way: end it, as asyncio.run does
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
