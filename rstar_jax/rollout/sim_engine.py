"""A simulated generation engine for the fleet simulator (SPEC section 6): vLLM's paged KV cache and scheduler as a
discrete-event model, behind the real `GenerationEngine` protocol.

The model, per engine:
- KV cache of `kv_tokens` tokens holding every running sequence's context (prompt plus tokens generated so far);
  at most `max_num_seqs` run at once; others wait in FIFO order (vLLM's FCFS scheduler).
- Decode: every step adds one token to each running sequence and takes `step_s + sequence_s * batch +
  context_token_s * (context tokens of the batch)` seconds; between events the batch is fixed, so the steps
  taken in a span of time have a closed form (tokens are counted as a fluid: no step is cut short by an event).
- Prefill: admitting a sequence computes its context less what the prefix cache holds; the whole batch stalls
  for `prefill_token_s` per computed token.
- Admission: the head of the queue starts when its context plus one more step of the batch fits the free cache.
- Overflow: when the running sequences' contexts fill the cache, the most recently admitted one is preempted
  (vLLM V1: `running[-1]`, put back at the head of the queue, its KV freed); it must be recomputed when it runs
  again.
- Prefix cache: a finished or preempted sequence's context stays cached (keyed by its trajectory's routing key)
  until the space is needed (the least recently used context first, its last tokens first); the trajectory's
  next turn on this engine skips computing what is left of it. With `shares_prefixes` the cache is vLLM's: full
  blocks named by their prefix (`prefix_blocks`), so a group's prompt stays cached for its later samples too.
- Blocks (`block_size` > 1, vLLM's paged cache): a running sequence holds whole blocks of its context, and a
  decode step that needs a new block when none is free preempts, as above; with `shares_prefixes` the leading full
  blocks of a prompt that running sequences have in common (a GRPO group's problem) are held, and computed, once.
  Prefix-cache hits come in whole blocks.
- Requests: each costs `request_s` outside the engine's loop before it queues (HTTP and tokenizing on a server).
What a request generates is the simulated policy's choice: `turn_length(prompt tokens, sampling)` tokens (at most
max_new_tokens).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import itertools
import math
from typing import Callable, Sequence

from rstar_jax.rollout.engine import (FINISH_LENGTH, FINISH_STOP, EngineCapacity, EngineUnavailable, Generation,
                                      RoutingKey, SamplingParams)
from rstar_jax.rollout.prefix_blocks import HeldBlocks, block_keys
from rstar_jax.rollout.turn_parts import ContinuedIds

_EPS = 1e-6  # tokens: what counts as equal in the fluid model


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """Size and speed of one simulated engine (see the module docstring; calibrations in `sim_profiles`)."""

    name: str
    kv_tokens: int
    max_num_seqs: int
    step_s: float
    sequence_s: float
    context_token_s: float
    prefill_token_s: float
    block_size: int = 1
    shares_prefixes: bool = False
    request_s: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_tokens < self.block_size:
            raise ValueError(f"profile {self.name}: need 1 <= block_size <= kv_tokens, got {self.block_size}, "
                             f"{self.kv_tokens}")

    def steps_in(self, seconds: float, batch: int, context: float) -> float:
        """Decode steps a batch of `batch` sequences holding `context` tokens completes in `seconds`.

        Step k (from 0) takes B + 2 A k seconds with B = step_s + sequence_s * batch + context_token_s * context
        and A = context_token_s * batch / 2 (each step adds `batch` tokens of context), so k steps take
        B k + A k^2 seconds; this inverts that.
        """
        b_term = self.step_s + self.sequence_s * batch + self.context_token_s * context
        a_term = self.context_token_s * batch / 2
        return 2 * seconds / (b_term + math.sqrt(b_term * b_term + 4 * a_term * seconds))

    def seconds_for(self, steps: float, batch: int, context: float) -> float:
        """Seconds for `steps` decode steps of a batch (the inverse of `steps_in`)."""
        b_term = self.step_s + self.sequence_s * batch + self.context_token_s * context
        return b_term * steps + self.context_token_s * batch / 2 * steps * steps


@dataclasses.dataclass
class EngineStats:
    """What one simulated engine did."""

    turns: int = 0  # turns delivered whole
    generated_tokens: int = 0
    preemptions: int = 0
    prefill_tokens: float = 0.0  # tokens computed at admission (prefix-cache hits excluded)
    recomputed_tokens: float = 0.0  # of those, tokens computed again after a preemption
    prefix_hit_tokens: float = 0.0
    busy_s: float = 0.0  # time with a sequence running or a prefill under way
    sequence_s: float = 0.0  # integral over time of the running batch's size
    kv_token_s: float = 0.0  # integral over time of the KV tokens the running batch holds


class _Sequence:
    """One turn inside the engine."""

    __slots__ = ("prompt", "target", "done", "joined", "key", "future", "running", "preempted", "ids", "prefix")

    def __init__(self, prompt_ids: Sequence[int], target: int, key: RoutingKey | None, future: asyncio.Future[int],
                 prefix: tuple[int, ...] = ()) -> None:
        self.prompt, self.target, self.key, self.future = len(prompt_ids), target, key, future
        self.ids = prompt_ids  # to name its context's blocks, where the engine shares them
        self.prefix = prefix  # keys of the prompt's full blocks, where the engine shares them
        self.done = 0.0  # tokens generated as of engine step `joined`
        self.joined = 0.0
        self.running = False
        self.preempted = False

    def context_at(self, steps: float) -> float:
        """Tokens in the KV cache at engine step `steps` while running."""
        return self.prompt + self.done + steps - self.joined


class SimEngine:
    """A simulated engine implementing `GenerationEngine` in the running loop's (virtual) time."""

    def __init__(self, profile: EngineProfile, turn_length: Callable[[int, SamplingParams], int]) -> None:
        self.profile, self._turn_length = profile, turn_length
        self.stats = EngineStats()
        self.dead: str | None = None
        self._running: list[_Sequence] = []
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._finishes: list[tuple[float, int, _Sequence]] = []  # (engine step it finishes at, tie, sequence)
        self._order = itertools.count()
        self._steps = 0.0  # decode steps done (fluid)
        self._base = 0.0  # sum over running of prompt + done - joined: their context is _base + batch * _steps
        self._clock = 0.0  # time up to which progress is accounted
        self._stall_until = 0.0  # prefill under way until then: no decode progress
        self._cache: collections.OrderedDict[RoutingKey, float] = collections.OrderedDict()
        self._cached = 0.0
        self._held = HeldBlocks()  # prompt blocks the running sequences hold (with shares_prefixes)
        self._timer: asyncio.TimerHandle | None = None

    # ---- GenerationEngine ---------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Queue the turn; return once the simulated batch has generated its tokens (GenerationEngine)."""
        if self.dead is not None:
            raise EngineUnavailable(self.dead)
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) + sampling.max_new_tokens > self.profile.kv_tokens:
            raise ValueError(f"a turn of {len(prompt_ids)} + {sampling.max_new_tokens} tokens exceeds the engine's "
                             f"KV cache of {self.profile.kv_tokens} (vLLM refuses longer than max_model_len)")
        if self.profile.request_s:
            await asyncio.sleep(self.profile.request_s)
        planned = max(1, self._turn_length(len(prompt_ids), sampling))
        target = min(planned, sampling.max_new_tokens)
        prefix = block_keys(prompt_ids, self.profile.block_size) if self.profile.shares_prefixes else ()
        sequence = _Sequence(prompt_ids, target, sampling.routing_key, asyncio.get_running_loop().create_future(),
                             prefix)
        self._waiting.append(sequence)
        self._replan()
        try:
            tokens = await sequence.future
        except asyncio.CancelledError:
            self._drop(sequence)
            raise
        finish = FINISH_STOP if planned <= sampling.max_new_tokens else FINISH_LENGTH  # the model's stop, or cut
        token = sampling.routing_key.trajectory if sampling.routing_key is not None else 0  # one id per trajectory
        return Generation((token,) * tokens, (0.0,) * tokens, finish)

    async def capacity(self) -> EngineCapacity:
        """KV tokens in use by running sequences out of `kv_tokens`; running and waiting counts."""
        if self.dead is not None:
            raise EngineUnavailable(self.dead)
        self._advance(asyncio.get_running_loop().time())
        return EngineCapacity(self.profile.kv_tokens, int(self._used()), len(self._running), len(self._waiting),
                              block_size=self.profile.block_size, shares_prefixes=self.profile.shares_prefixes)

    async def update_weights(self, params: object, version: int) -> None:
        """Weights do not change what a simulated engine does."""

    # ---- control -----------------------------------------------------------------------------------------------

    def kill(self, reason: str = "simulated engine died") -> None:
        """Die now: every turn it holds and every later call raise EngineUnavailable."""
        self.dead = reason
        if self._timer is not None:
            self._timer.cancel()
        for sequence in [*self._running, *self._waiting]:
            if not sequence.future.done():
                sequence.future.set_exception(EngineUnavailable(reason))
        self._running, self._waiting, self._finishes = [], collections.deque(), []

    def settle(self, now: float) -> None:
        """Account time up to `now` (at the end of a run, so idle time is counted)."""
        self._advance(now)

    # ---- the model ---------------------------------------------------------------------------------------------

    def _context(self) -> float:
        """Context tokens of the running batch, each sequence's own (what a decode step attends over)."""
        return self._base + len(self._running) * self._steps

    def _used(self) -> float:
        """KV tokens the running sequences hold: their contexts, or in blocks their whole blocks (shared ones
        once)."""
        size = self.profile.block_size
        if size == 1:
            return self._context()
        own = sum(self._blocks(sequence) - len(sequence.prefix) for sequence in self._running)
        return float((own + len(self._held)) * size)

    def _stored(self, sequence: _Sequence) -> float:
        """Tokens of a running sequence's context in its blocks: all but the token it sampled last, which the
        next step feeds (the turn's last token is never stored: what the balancer reserves, `Turn.kv_tokens`)."""
        return sequence.context_at(self._steps) - 1

    def _blocks(self, sequence: _Sequence) -> int:
        """Blocks a running sequence's stored tokens fill (the last one partly)."""
        return math.ceil(self._stored(sequence) / self.profile.block_size - _EPS)

    def _to_next_block(self, sequence: _Sequence) -> float:
        """Decode steps until a running sequence's next token needs a block it does not hold yet (0: now)."""
        left = self._blocks(sequence) * self.profile.block_size - self._stored(sequence)
        return 0.0 if left < _EPS else left

    def _steps_to_overflow(self) -> float:
        """Decode steps until the running batch needs more KV than the cache has (with blocks: the first block
        asked for when none is free; the round-k allocations of a batch all come before round k + 1's)."""
        batch, room = len(self._running), self.profile.kv_tokens - self._used()
        size = self.profile.block_size
        if size == 1:
            return room / batch
        free = int(room // size)
        offsets = sorted(self._to_next_block(sequence) for sequence in self._running)
        return offsets[free % batch] + (free // batch) * size

    def _overflowing(self) -> bool:
        """Whether the running batch's next step finds no room for its tokens."""
        size = self.profile.block_size
        if size == 1:
            return self._used() >= self.profile.kv_tokens - _EPS
        return self._used() + self._asking() * size > self.profile.kv_tokens + _EPS

    def _asking(self) -> int:
        """Running sequences whose next token needs a block they do not hold yet."""
        return sum(1 for sequence in self._running if self._to_next_block(sequence) == 0.0)

    def _advance(self, now: float) -> None:
        """Decode progress from the accounted time to `now` (none while a prefill stalls the batch)."""
        if now <= self._clock:
            return
        batch = len(self._running)
        if batch or self._clock < self._stall_until:
            self.stats.busy_s += now - self._clock
        start = max(self._clock, self._stall_until)
        used_before = self._used()
        if batch and now > start:
            self._steps += self.profile.steps_in(now - start, batch, self._context())
        self.stats.sequence_s += batch * (now - self._clock)
        self.stats.kv_token_s += (used_before + self._used()) / 2 * (now - self._clock)
        self._clock = now

    def _replan(self) -> None:
        """At an event: deliver finished turns, preempt on overflow, admit waiting turns, schedule the next event."""
        if self.dead is not None:
            return
        now = asyncio.get_running_loop().time()
        self._advance(now)
        self._evict(self.profile.kv_tokens - self._used())  # what the batch's growth since the last event took
        self._finish_due()
        if not self._preempt_overflow():
            self._admit(now)
        self._evict(self.profile.kv_tokens - self._used())
        self._schedule(now)

    def _finish_due(self) -> None:
        while self._finishes and self._finishes[0][0] <= self._steps + _EPS:
            _, _, sequence = heapq.heappop(self._finishes)
            if not sequence.running:  # preempted or cancelled since: a stale entry
                continue
            self._leave(sequence)
            self._remember(sequence, sequence.target)
            self.stats.turns += 1
            self.stats.generated_tokens += sequence.target
            if not sequence.future.done():
                sequence.future.set_result(sequence.target)

    def _preempt_overflow(self) -> bool:
        """Preempt the newest running sequences while the cache has no room for the next step (vLLM V1)."""
        preempted = False
        while self._running and self._overflowing():
            victim = self._running[-1]
            self._leave(victim)
            victim.done = math.floor(victim.done + _EPS)
            victim.preempted = True
            self._remember(victim, int(victim.done))
            self._waiting.appendleft(victim)
            self.stats.preemptions += 1
            preempted = True
        return preempted

    def _admit(self, now: float) -> None:
        """Start waiting turns in order while the head's context and one more batch step fit the free cache (in
        blocks: the head's blocks not shared, and one for each running sequence about to need one)."""
        profile, size = self.profile, self.profile.block_size
        while self._waiting and len(self._running) < profile.max_num_seqs:
            sequence = self._waiting[0]
            context = sequence.prompt + sequence.done
            shared = self._held.shared(sequence.prefix)
            if size == 1:
                need = context + len(self._running) + 1
            else:
                need = (math.ceil(context / size) - shared + self._asking()) * size
            if need > profile.kv_tokens - self._used():
                return
            self._waiting.popleft()
            hit = min(self._forget(sequence), context - 1) // size * size  # the last token is computed again
            computed = context - hit
            self.stats.prefix_hit_tokens += hit
            self.stats.prefill_tokens += computed
            if sequence.preempted:
                self.stats.recomputed_tokens += computed
            self._stall_until = max(self._stall_until, now) + computed * profile.prefill_token_s
            sequence.joined, sequence.running = self._steps, True
            self._running.append(sequence)
            self._held.hold(sequence.prefix)
            self._base += sequence.prompt + sequence.done - sequence.joined
            heapq.heappush(self._finishes, (self._steps + sequence.target - sequence.done, next(self._order),
                                            sequence))

    def _schedule(self, now: float) -> None:
        """Set the timer for the next finish or overflow of the running batch."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._finishes and not self._finishes[0][2].running:
            heapq.heappop(self._finishes)
        if not self._running:
            return
        batch = len(self._running)
        steps = min(self._finishes[0][0] - self._steps, self._steps_to_overflow())
        start = max(now, self._stall_until)
        when = start + self.profile.seconds_for(max(steps, 0.0), batch, self._context())
        self._timer = asyncio.get_running_loop().call_at(when, self._replan)

    def _leave(self, sequence: _Sequence) -> None:
        """Take a running sequence out of the batch, recording the tokens it generated so far."""
        self._running.remove(sequence)
        self._held.release(sequence.prefix)
        self._base -= sequence.prompt + sequence.done - sequence.joined
        sequence.done += self._steps - sequence.joined
        sequence.running = False

    def _drop(self, sequence: _Sequence) -> None:
        """A caller cancelled its turn: free what the sequence holds."""
        if sequence.running:
            self._advance(asyncio.get_running_loop().time())
            self._leave(sequence)
        elif sequence in self._waiting:
            self._waiting.remove(sequence)
        self._replan()

    def _context_keys(self, sequence: _Sequence, generated: int) -> tuple[int, ...]:
        """The keys of the full blocks of a sequence's prompt and `generated` tokens (a simulated engine samples
        its trajectory's id, as the simulated agent's contexts hold it: `sim_workload.ContextIds`)."""
        token = sequence.key.trajectory if sequence.key is not None else 0
        return block_keys(ContinuedIds(sequence.ids, [(token,) * generated]), self.profile.block_size)

    def _remember(self, sequence: _Sequence, generated: int) -> None:
        """Cache the context a sequence leaves with: with shared prefixes each of its full blocks that no running
        sequence holds, the last first (vLLM frees a request's blocks tail first, so they are evicted first);
        otherwise its whole context under its trajectory's routing key."""
        if self.profile.shares_prefixes:
            for key in reversed(self._context_keys(sequence, generated)):
                if key in self._cache:
                    self._cache.move_to_end(key)
                elif key not in self._held:
                    self._cache[key] = float(self.profile.block_size)
                    self._cached += self.profile.block_size
            return
        if sequence.key is None:
            return
        tokens = sequence.prompt + generated
        self._cached += tokens - self._cache.pop(sequence.key, 0.0)
        self._cache[sequence.key] = tokens

    def _forget(self, sequence: _Sequence) -> float:
        """The tokens of the sequence's context that need no computing as it is admitted (its leading blocks that
        running sequences hold or the cache keeps, or its trajectory's cached context); what it takes from the
        cache leaves the cache (the sequence holds it now)."""
        if self.profile.shares_prefixes:
            blocks = 0
            for key in self._context_keys(sequence, int(sequence.done)):
                if key in self._cache:
                    self._cached -= self._cache.pop(key)
                elif key not in self._held:
                    break
                blocks += 1
            return float(blocks * self.profile.block_size)
        if sequence.key is None or sequence.key not in self._cache:
            return 0.0
        tokens = self._cache.pop(sequence.key)
        self._cached -= tokens
        return tokens

    def _evict(self, room: float) -> None:
        """Evict cached tokens until the cache holds at most `room` of them: from the least recently used prefix,
        its last tokens first (vLLM frees a request's blocks tail first, so its prefix is evicted last)."""
        while self._cached > room + _EPS and self._cache:
            key, tokens = next(iter(self._cache.items()))
            excess = self._cached - room
            if tokens <= excess or self.profile.shares_prefixes:  # a block goes whole
                del self._cache[key]
                self._cached -= tokens
            else:
                self._cache[key] = tokens - excess  # keeps its place in the order
                self._cached -= excess
