"""The KV-cache-aware rollout balancer (SPEC section 6; DESIGN "One protocol per boundary"): a `GenerationEngine`
over many engines that never makes one overflow its KV cache.

It is a `FailoverEngine` (the same fail-over loop: a turn whose engine dies is retried on another, the dead engine
is drained) whose admission of each attempt is KV-aware:
- it reserves, on the engine it picks, the request's prompt and max new tokens but the last (never stored): the
  most KV the request can hold, in the engine's whole blocks, with the leading prefix blocks that requests in
  flight there share counted once (`prefix_blocks`: on an engine with prefix caching a GRPO group's prompt is
  stored once); the reservation is released when the attempt finishes, fails or is cancelled. With a KV-aware
  policy a turn longer than `part_tokens` goes out in parts (`turn_parts`), so a reservation is the context plus
  one part instead of the whole budget left (which most turns, stopping at a tool call, never use);
- the policy (`balancing.POLICIES`, by gin) picks an engine among the live ones from their free KV tokens: the
  engine's cache less this balancer's reservations less what a recent capacity reading showed others using
  (`capacity_readings`); `kv_aware` prefers the engine that served the trajectory's previous request (the routing
  key of `SamplingParams`) while its load is within a margin of the best engine's, where the prefix cache holds
  the context;
- when the policy finds no engine that can take the request without overflowing, it waits in a FIFO queue and
  goes out as reservations are released or new readings show room (so engines never preempt, and queue nothing
  themselves); while the queue is blocked the engines are read again at the scrape interval, since room can also
  come from outside (another client's requests ending, a gauge catching up) with nothing here to notice; the next
  part of a turn already running goes ahead of new turns, and with `kv_aware` a queued turn whose trajectory last
  ran on the engine that frees room goes there ahead of the head of the queue (`affinity_lookahead`): when every
  engine is full, the head would otherwise take the room, and the returning turn the next room on any engine,
  losing its context (issue 26: on two JAX engines 61 of 96 trajectories ran turns on both).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from typing import Sequence

import gin

from rstar_jax.rollout.balancing import POLICIES, EngineState, Turn, make_policy
from rstar_jax.rollout.capacity_readings import CapacityReadings
from rstar_jax.rollout.engine import Generation, GenerationEngine, RoutingKey, SamplingParams
from rstar_jax.rollout.prefix_blocks import HeldBlocks
from rstar_jax.rollout.router import Admission, FailoverEngine
from rstar_jax.rollout.turn_parts import generate_in_parts

BLOCKED_RETRY_S = 0.01  # the least wait between two looks at a blocked queue (with scrape_interval_s = 0)


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A queued request and the future its admission is delivered to."""

    turn: Turn
    admitted: asyncio.Future[Admission]


@gin.configurable
class Balancer(FailoverEngine):
    """Routes turns over `engines` by `policy` (one of `balancing.POLICIES`; SPEC section 6), with fail-over.

    affinity_margin: how much more loaded (share of its KV cache) the trajectory's previous engine may be than the
    best one and still get the request (`kv_aware`); part_tokens: with a KV-aware policy, the new tokens one
    request asks for, run on to one token past the end of a KV block of the largest block size among the engines
    (None: whole turns); scrape_interval_s: the least time between two capacity reads of one engine;
    affinity_keys: trajectories whose last engine is remembered (the oldest are forgotten); affinity_lookahead:
    how far behind the head of the queue a request returning to the engine that has room may be and still go first.
    """

    def __init__(self, engines: Sequence[GenerationEngine], policy: str = "kv_aware", affinity_margin: float = 0.25,
                 part_tokens: int | None = 256, scrape_interval_s: float = 1.0,
                 affinity_keys: int = 1 << 16, affinity_lookahead: int = 64) -> None:
        super().__init__(engines)
        if policy not in POLICIES:
            raise ValueError(f"unknown balancing policy {policy!r}; choose one of {POLICIES}")
        if part_tokens is not None and part_tokens < 1:
            raise ValueError(f"part_tokens must be >= 1 or None, got {part_tokens}")
        self.policy_name = policy
        self.balancing = make_policy(policy, len(self.engines), affinity_margin)
        self.part_tokens = part_tokens if self.balancing.reserves_kv else None
        self.readings = CapacityReadings(self.engines, scrape_interval_s, self._reserved_on, self._mark_down,
                                         self._on_reading)
        self.affinity_keys = affinity_keys
        if affinity_lookahead < 0:
            raise ValueError(f"affinity_lookahead must be >= 0, got {affinity_lookahead}")
        self.affinity_lookahead = affinity_lookahead
        self._reserved = [0] * len(self.engines)  # tokens each admission holds alone
        self._held = [HeldBlocks() for _ in self.engines]  # prefix blocks admissions hold together
        self._states = [EngineState(index, 0, 0, 0) for index in range(len(self.engines))]
        self._live = self.live
        self._all_read = False
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._look_due_in: asyncio.AbstractEventLoop | None = None  # the loop a blocked queue's next look is due in
        self._affinity: collections.OrderedDict[RoutingKey, int] = collections.OrderedDict()
        self.queued_requests = 0  # attempts that had to wait in the queue
        self.max_queue = 0

    @property
    def reserved(self) -> tuple[int, ...]:
        """KV tokens reserved on each engine by the attempts in flight there."""
        return tuple(self._reserved_on(index) for index in range(len(self.engines)))

    @property
    def queued(self) -> int:
        """Requests waiting for an engine with room."""
        return len(self._queue)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Generate the turn on the engines, in parts of at most `part_tokens` tokens with a KV-aware policy."""
        if self.part_tokens is None or sampling.max_new_tokens <= self.part_tokens:
            return await super().generate(prompt_ids, sampling)
        await self._ensure_read()  # the engines' block sizes come with their first readings
        block_size = max((reading.capacity.block_size for reading in map(self.readings.latest, self._live)
                          if reading is not None), default=1)
        return await generate_in_parts(super().generate, prompt_ids, sampling, self.part_tokens, block_size)

    async def _ensure_read(self) -> None:
        """Every live engine read once (capacities, block sizes) before the first request is routed."""
        if not self._all_read:
            await self.readings.ensure(self._live)
            self._all_read = True

    def _reserved_on(self, index: int) -> int:
        held = len(self._held[index])  # prefix blocks are only held on an engine read as sharing them
        return self._reserved[index] + (held * self.readings.latest(index).capacity.block_size if held else 0)

    def _prefix_keys(self, turn: Turn, index: int) -> tuple[int, ...]:
        """The turn's leading full blocks on engine `index`, if that engine shares prefix blocks."""
        reading = self.readings.latest(index)
        if reading is None or not reading.capacity.shares_prefixes:
            return ()
        return turn.block_keys(reading.capacity.block_size)

    def _state_for(self, turn: Turn, index: int) -> EngineState:
        """Engine `index` as the policy sees it for `turn`: with the tokens of the turn's prefix blocks held there."""
        state = self._states[index]
        shared = self._held[index].shared(self._prefix_keys(turn, index))
        return dataclasses.replace(state, shared_tokens=shared * state.block_size) if shared else state

    async def _acquire(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Admission:
        """Admit the attempt on the engine the policy picks, or queue it until one has room (SPEC section 6)."""
        await self._ensure_read()
        turn = Turn.of(prompt_ids, sampling)
        if not self._queue or turn.continuing:  # the next part of a running turn does not queue behind new turns
            index = self._place(turn)
            if index is not None:
                return self._admit(index, turn)
        waiter = _Waiter(turn, asyncio.get_running_loop().create_future())
        if turn.continuing:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        self._look_again_later()
        self.queued_requests += 1
        self.max_queue = max(self.max_queue, len(self._queue))
        try:
            return await waiter.admitted
        except asyncio.CancelledError:
            if not waiter.admitted.done():
                waiter.admitted.cancel()
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif not waiter.admitted.cancelled() and waiter.admitted.exception() is None:
                self._release(waiter.admitted.result())  # admitted just as the caller went away
            raise

    def _release(self, admission: Admission) -> None:
        """The attempt is over: its reservation goes, and queued requests may now fit."""
        super()._release(admission)
        self._reserved[admission.index] -= admission.reserved_tokens
        self._held[admission.index].release(admission.prefix_keys)
        self._update_state(admission.index)
        self._dispatch()

    def _mark_down(self, index: int, error: Exception) -> None:
        """Drain engine `index` (its attempts in flight fail and are retried elsewhere); queued requests re-route,
        and fail with AllEnginesDown when no engine is left."""
        super()._mark_down(index, error)
        self._live = self.live
        if self._live:
            self._dispatch()
            return
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.admitted.done():
                waiter.admitted.set_exception(self._all_down())

    def _on_reading(self, index: int) -> None:
        self._update_state(index)
        self._dispatch()

    def _admit(self, index: int, turn: Turn) -> Admission:
        state, keys = self._states[index], self._prefix_keys(turn, index)
        need = state.need(turn)
        if keys and need < state.kv_tokens_total:  # its own tokens beyond the blocks it may share
            alone = need - len(keys) * state.block_size
        else:  # shares nothing, or takes the whole cache
            alone, keys = need, ()
        self._reserved[index] += alone
        self._held[index].hold(keys)
        self._in_flight[index] += 1
        self._update_state(index)
        if turn.key is not None:
            self._affinity[turn.key] = index
            self._affinity.move_to_end(turn.key)
            if len(self._affinity) > self.affinity_keys:
                self._affinity.popitem(last=False)
        return Admission(index, alone, keys)

    def _place(self, turn: Turn) -> int | None:
        """The engine the policy picks for `turn` now, or None (wait); stale readings are refreshed meanwhile."""
        live = self._live
        if not live:
            raise self._all_down()
        self.readings.refresh_stale(live)
        previous = self._affinity.get(turn.key) if turn.key is not None else None
        sticky = self._states[previous] if previous is not None and previous not in self._down else None
        sticky = self._state_for(turn, previous) if sticky is not None else None
        chosen = self.balancing.choose(turn, [self._state_for(turn, index) for index in live], sticky)
        if chosen is not None and chosen not in live:
            raise ValueError(f"policy {self.policy_name} chose engine {chosen!r}, not among the live engines {live}")
        return chosen

    def _update_state(self, index: int) -> None:
        """Engine `index` as the policy sees it: in flight, and its cache less reservations and foreign use."""
        reading = self.readings.latest(index)
        if reading is None:  # not read yet: room for nothing
            self._states[index] = EngineState(index, self._in_flight[index], 0, 0)
            return
        capacity = reading.capacity
        self._states[index] = EngineState(index, self._in_flight[index], capacity.kv_tokens_total,
                                          reading.free_tokens(self._reserved_on(index)), capacity.max_sequences,
                                          capacity.block_size)

    def _dispatch(self) -> None:
        """Admit queued requests while the policy finds the head an engine. The head goes first, unless the policy
        keeps affinity and one of the next `affinity_lookahead` requests last ran on the engine the head would get
        and fits there: that one goes there first (the engine holds its context), and the head is placed again."""
        while self._queue and self._live:
            waiter = self._queue[0]
            if waiter.admitted.done():  # cancelled while queued
                self._queue.popleft()
                continue
            index = self._place(waiter.turn)
            if index is None:
                self._look_again_later()
                return
            if self.balancing.affinity and self._affinity.get(waiter.turn.key) != index:
                waiter = self._returning_to(index) or waiter
            self._queue.remove(waiter)
            waiter.admitted.set_result(self._admit(index, waiter.turn))

    def _look_again_later(self) -> None:
        """The queue is blocked: dispatch again once the readings may be refreshed (scrape_interval_s, at least
        BLOCKED_RETRY_S), unless a look is already due. Releases and readings dispatch too, but when nothing of this
        balancer's runs and the latest readings still count use that has since ended, neither comes, and the queue
        waited for ever (tests/rollout/test_balancer_units.py)."""
        loop = asyncio.get_running_loop()
        if self._look_due_in is not loop:  # none due, or due in a loop that has ended
            self._look_due_in = loop
            loop.call_later(max(self.readings.interval_s, BLOCKED_RETRY_S), self._look_again)

    def _look_again(self) -> None:
        self._look_due_in = None
        self._dispatch()

    def _returning_to(self, index: int) -> _Waiter | None:
        """The first of the next `affinity_lookahead` queued requests whose trajectory last ran on engine `index`,
        if it fits there now."""
        for waiter in itertools.islice(self._queue, 1, 1 + self.affinity_lookahead):
            turn = waiter.turn
            if (not waiter.admitted.done() and turn.key is not None and self._affinity.get(turn.key) == index
                    and self._state_for(turn, index).fits(turn)):
                return waiter
        return None
