"""The balancer's bookkeeping under random traffic (SPEC section 6, issue 10): a property-based test.

Hypothesis draws a sequence of events: turns arriving (any prompt and max new tokens, some trajectories sharing a
routing key), engines finishing a request (stopping early or using all its tokens, so turns continue in parts),
callers cancelling, engines dying; between events the event loop runs 0-3 steps (so a caller can be cancelled just
as its admission arrives) or settles. Whenever it has settled, the real `Balancer` must hold:
each engine's reservation equals the sum of what its requests in flight there hold (so it is never negative and
nothing leaks), never exceeds the engine's cache under a KV-aware policy, its in-flight counts equal the engines'
own, and every caller still waiting is either queued in the balancer or running on an engine (none lost). At the
end, when every request has finished, every reservation and count is zero and each caller got one answer.

The engines are scripted test doubles (this is a test of the balancer's pure bookkeeping): a request completes
only when the test says so.
"""

from __future__ import annotations

import asyncio
import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.engine import (FINISH_LENGTH, FINISH_STOP, EngineCapacity, EngineUnavailable, Generation,
                                      RoutingKey, SamplingParams)
from rstar_jax.rollout.router import AllEnginesDown

KV_TOKENS = (600, 900, 1500)
PART_TOKENS = 64


@dataclasses.dataclass(eq=False)
class Pending:
    prompt: int
    max_new: int
    answer: asyncio.Future
    caller: asyncio.Task | None


class ScriptedEngine:
    """Holds each request until the test finishes or fails it."""

    def __init__(self, kv_tokens: int) -> None:
        self.kv_tokens = kv_tokens
        self.pending: list[Pending] = []
        self.dead = False

    async def generate(self, prompt_ids, sampling: SamplingParams) -> Generation:
        if self.dead:
            raise EngineUnavailable("scripted engine is dead")
        request = Pending(len(prompt_ids), sampling.max_new_tokens, asyncio.get_running_loop().create_future(),
                          asyncio.current_task())
        self.pending.append(request)
        try:
            return await request.answer
        finally:
            self.pending.remove(request)

    async def capacity(self) -> EngineCapacity:
        if self.dead:
            raise EngineUnavailable("scripted engine is dead")
        return EngineCapacity(self.kv_tokens, sum(r.prompt for r in self.pending), len(self.pending), 0)

    def finish(self, request: Pending, stop: bool) -> None:
        tokens = max(1, request.max_new // 2) if stop else request.max_new
        request.answer.set_result(Generation((1,) * tokens, (-1.0,) * tokens, FINISH_STOP if stop else FINISH_LENGTH))

    def kill(self) -> None:
        self.dead = True
        for request in self.pending:
            if not request.answer.done():
                request.answer.set_exception(EngineUnavailable("scripted engine died"))


steps = st.integers(0, 3)
arrive = st.tuples(st.just("arrive"), steps, st.integers(1, 400), st.integers(1, 700), st.integers(0, 7))
finish = st.tuples(st.just("finish"), steps, st.integers(0, 1000), st.booleans())
cancel = st.tuples(st.just("cancel"), steps, st.integers(0, 1000))
# a request finishes, and the first caller queued behind it is cancelled just as its admission arrives
finish_then_cancel = st.tuples(st.just("finish_then_cancel"), steps, st.integers(0, 1000))
die = st.tuples(st.just("die"), steps, st.integers(0, len(KV_TOKENS) - 1))
check = st.tuples(st.just("check"), st.just(0))
events = st.lists(st.one_of(arrive, arrive, finish, finish, finish, cancel, finish_then_cancel, die, check, check),
                  min_size=1, max_size=80)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def check_books(balancer: Balancer, engines: list[ScriptedEngine], callers: list[asyncio.Task]) -> None:
    for index, engine in enumerate(engines):
        held = sum(min(r.prompt + r.max_new - 1, engine.kv_tokens) for r in engine.pending)
        assert balancer.reserved[index] == held >= 0
        assert balancer.in_flight[index] == len(engine.pending)
        if balancer.balancing.reserves_kv:
            assert balancer.reserved[index] <= engine.kv_tokens
    waiting = sum(not caller.done() for caller in callers)
    assert waiting == balancer.queued + sum(len(engine.pending) for engine in engines)


async def scenario(policy: str, script: list[tuple]) -> None:
    engines = [ScriptedEngine(kv) for kv in KV_TOKENS]
    balancer = Balancer(engines, policy=policy, part_tokens=PART_TOKENS, scrape_interval_s=0.0)
    callers: list[asyncio.Task] = []
    for event in script:
        if event[0] == "arrive":
            _, _, prompt, max_new, trajectory = event
            sampling = SamplingParams(max_new_tokens=max_new, routing_key=RoutingKey(trajectory))
            callers.append(asyncio.create_task(balancer.generate(range(prompt), sampling)))
        elif event[0] == "finish":
            running = [(engine, r) for engine in engines for r in engine.pending if not r.answer.done()]
            if running:
                engine, request = running[event[2] % len(running)]
                engine.finish(request, stop=event[3])
        elif event[0] == "cancel":
            alive = [caller for caller in callers if not caller.done()]
            if alive:
                alive[event[2] % len(alive)].cancel()
        elif event[0] == "finish_then_cancel":
            running = [(engine, r) for engine in engines for r in engine.pending if not r.answer.done()]
            if running:
                engine, request = running[event[2] % len(running)]
                engine.finish(request, stop=True)
                await asyncio.sleep(0)  # the finished caller releases; the queue's head is admitted, not yet resumed
                on_engines = {r.caller for e in engines for r in e.pending}
                queued = [caller for caller in callers if not caller.done() and caller not in on_engines]
                if queued:
                    queued[0].cancel()
        elif event[0] == "die":
            engines[event[2]].kill()
        else:
            await settle()
            check_books(balancer, engines, callers)
        for _ in range(event[1]):
            await asyncio.sleep(0)
    await settle()
    check_books(balancer, engines, callers)
    while any(not caller.done() for caller in callers):  # drain: every request runs to its end
        for engine in engines:
            for request in list(engine.pending):
                if not request.answer.done():
                    engine.finish(request, stop=True)
        await settle()
        check_books(balancer, engines, callers)
    assert balancer.reserved == (0,) * len(engines) and balancer.in_flight == (0,) * len(engines)
    assert balancer.queued == 0
    for caller in callers:
        if caller.cancelled():
            continue
        error = caller.exception()
        assert error is None or isinstance(error, AllEnginesDown), error
        if error is None:
            assert len(caller.result().token_ids) >= 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=events)
def test_kv_aware_reservations_never_go_negative_overflow_or_leak(script):
    asyncio.run(scenario("kv_aware", script))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=events, policy=st.sampled_from(["kv_aware_no_affinity", "least_requests", "static_split"]))
def test_every_policy_keeps_exact_books(script, policy):
    asyncio.run(scenario(policy, script))


def test_a_caller_cancelled_just_as_its_admission_arrives_leaks_nothing():
    async def run() -> tuple[tuple[int, ...], tuple[int, ...]]:
        engine = ScriptedEngine(600)
        balancer = Balancer([engine], part_tokens=None, scrape_interval_s=0.0)
        first = asyncio.create_task(balancer.generate(range(100), SamplingParams(max_new_tokens=400)))
        while not engine.pending:
            await asyncio.sleep(0)
        second = asyncio.create_task(balancer.generate(range(100), SamplingParams(max_new_tokens=400)))
        while balancer.queued == 0:
            await asyncio.sleep(0)
        engine.finish(engine.pending[0], stop=True)
        await asyncio.sleep(0)  # `first` released: `second` is admitted but has not resumed yet
        assert (balancer.queued, balancer.reserved, engine.pending) == (0, (499,), [])
        second.cancel()
        await settle()
        assert first.done() and second.cancelled()
        return balancer.reserved, balancer.in_flight

    assert asyncio.run(run()) == ((0,), (0,))
